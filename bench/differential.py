"""Differential test of two checkouts of tactmem: every answer, output and error must be equal.

    python bench/differential.py OLD_DIR NEW_DIR      # exit 0 only with zero differences
    python bench/differential.py --self-test OLD_DIR  # doctored copies must differ, OLD == OLD

Each side runs in its own worker process (this script with `--worker`), which loads that side's
`tactmem.py` by path (never the installed one), freezes the wall clock, and runs the same seeded
cases in a temporary directory: tool sessions over a real SQLite store, the public API and tool
definitions, the command line in process (`main(argv)`) and as `python -m tactmem` subprocesses,
and hostile databases, export files and config files. Every unit is text (JSON answers, stdout,
stderr, exit codes, files' digests before and after); the temporary root and the checkout's path
are replaced by tokens. The parent compares the two workers' units one by one.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import importlib.util
import io
import json
import os
import random
import re
import shutil
import sqlite3
import stat
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

Unit = tuple[str, str, str]  # (category, case, text)
CLOCK0 = 1_796_000_000_000  # a fixed "now" (ms), 2026-11
SESSIONS = 120
CALLS = 45
CATEGORIES = ("tool", "api", "cli", "subprocess", "hostile")


# ------------------------------------------------------------------------------ worker side


class Worker:
    def __init__(self, side: Path, fixtures: Path, root: Path) -> None:
        self.side = side.resolve()
        self.fixtures = fixtures
        self.root = root
        self.units: list[Unit] = []
        self.clock = CLOCK0
        self.tm = self._load()

    def _load(self) -> types.ModuleType:
        path = self.side / "tactmem.py"
        spec = importlib.util.spec_from_file_location("tactmem", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["tactmem"] = module  # the side's own module answers `import tactmem`
        spec.loader.exec_module(module)
        assert Path(module.__file__ or "").resolve() == path.resolve()
        return module

    def now(self) -> int:
        return self.clock

    def tick(self, ms: int = 1000) -> int:
        self.clock += ms
        return self.clock

    def norm(self, text: str) -> str:
        for real in {str(self.root), os.path.realpath(self.root)}:
            text = text.replace(real, "<TMP>")
        text = re.sub(r"/tmp/tactmem-[a-z]+-[A-Za-z0-9_]{8}", "<TMP2>", text)
        return text.replace(str(self.side), "<SIDE>")

    def add(self, category: str, case: str, text: str) -> None:
        self.units.append((category, self.norm(case), self.norm(text)))

    def fresh_dir(self, name: str) -> Path:
        path = self.root / name
        if path.exists():
            for sub in path.rglob("*"):
                with contextlib.suppress(OSError):
                    sub.chmod(0o700)
            shutil.rmtree(path)
        path.mkdir(parents=True)
        return path

    def secrets(self, name: str) -> list[str]:
        lines = (self.fixtures / "secrets" / name).read_text(encoding="utf-8").splitlines()
        cases = [s for s in lines if s.strip() and not s.startswith("#")]
        return [s.replace("\\n", "\n").replace("\\t", "\t") for s in cases]

    # -------------------------------------------------------------------- helpers

    def call(self, fn: Callable[[], Any]) -> str:
        """The value of `fn()`, or its exception's class, code and message, as text."""
        try:
            value = fn()
        except Exception as error:
            code = getattr(error, "code", None)
            return f"raise {type(error).__name__} code={code!r}: {error}"
        return "ok " + show(value)

    def store_export(self, store: Any) -> Any:
        if hasattr(store, "export"):
            return store.export(now_ms=self.now())
        return self.tm.export(store, now_ms=self.now())

    def store_merge(self, store: Any, data: bytes, dry_run: bool) -> Any:
        if hasattr(store, "merge"):
            return store.merge(data, dry_run=dry_run, now_ms=self.now())
        return self.tm.merge(store, data, dry_run=dry_run, now_ms=self.now())

    def store_restore(self, store: Any, data: bytes) -> Any:
        if hasattr(store, "restore"):
            return store.restore(data, now_ms=self.now())
        return self.tm.restore(store, data, now_ms=self.now())

    def run_main(
        self, argv: list[str], stdin: bytes = b"", env: dict[str, str] | None = None
    ) -> str:
        """`main(argv)` in process: exit status, stdout and stderr."""
        out, err = io.StringIO(), io.StringIO()
        saved = (sys.stdin, sys.stdout, sys.stderr, dict(os.environ))
        os.environ.clear()
        os.environ.update(env or {})
        sys.stdin = io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8")
        sys.stdout, sys.stderr = out, err
        try:
            try:
                status: object = self.tm.main(argv)
            except SystemExit as stop:
                status = f"SystemExit({stop.code!r})"
            except Exception as error:
                status = f"raised {type(error).__name__}: {error}"
        finally:
            sys.stdin, sys.stdout, sys.stderr = saved[0], saved[1], saved[2]
            os.environ.clear()
            os.environ.update(saved[3])
        return f"status {status}\n--- stdout\n{out.getvalue()}--- stderr\n{err.getvalue()}"

    # ------------------------------------------------------------------ 1. tool sessions

    def tool_sessions(self) -> None:
        rejected, allowed = self.secrets("rejected.txt"), self.secrets("allowed.txt")
        for seed in range(SESSIONS):
            self.tool_session(seed, rejected, allowed)

    def tool_session(self, seed: int, rejected: list[str], allowed: list[str]) -> None:
        tm, rng = self.tm, random.Random(seed)
        directory = self.fresh_dir(f"tool/{seed}")
        tiny = seed % 3 == 0
        limits = (
            tm.Limits(
                content_bytes=rng.choice([16, 40, 80]),
                records=rng.choice([1, 2, 4]),
                total_content_bytes=rng.choice([40, 100, 200]),
                scan_results=rng.choice([1, 2, 5]),
                query_bytes=rng.choice([8, 32, 64]),
                probation_ms=rng.choice([5_000, 60_000]),
            )
            if tiny
            else tm.Limits()
        )
        case = f"session {seed}"
        self.clock = CLOCK0 + seed
        with tm.Store(directory / "m.sqlite3", limits=limits) as store:
            root = tm.MemoryTool(store, root=True, min_coverage=rng.choice([0.0, 0.0, 0.34]))
            child = tm.MemoryTool(store, root=False)
            keys: list[tuple[int, int]] = []
            for step in range(CALLS):
                request = self.random_request(rng, keys, rejected, allowed)
                tool = child if rng.random() < 0.1 else root
                now = self.tick(rng.choice([1, 500, 3_000, 70_000]))
                answer = tool.call(request, now_ms=now)
                text = json.dumps(answer, ensure_ascii=False)
                self.add("tool", f"{case} call {step}", f"{show(request)}\n=> {text}")
                learn_keys(answer, keys)
            exported = self.store_export(store)
            self.add("tool", f"{case} export", show(exported))
            self.add("tool", f"{case} list", self.call(lambda: store.list(now_ms=self.now())))

    def random_request(
        self,
        rng: random.Random,
        keys: list[tuple[int, int]],
        rejected: list[str],
        allowed: list[str],
    ) -> Any:
        words = ["ledgerline", "release", "tagged", "CI", "port", "5433", "httpServer"]
        words += ["数据库", "SQLite数据库", "नमस्ते"]
        words += ["tests", "migrate", "café", "e\u0301", "🙂", "_x_", "\u202e"]

        def content() -> str:
            kind = rng.random()
            if kind < 0.12:
                return rng.choice(rejected)
            if kind < 0.2:
                return rng.choice(allowed)
            if kind < 0.25:
                return rng.choice(["", " ", "\u3000", "a\x00b", "x" * rng.choice([64, 1024, 1025])])
            n = rng.randint(1, 12)
            return " ".join(rng.choice(words) for _ in range(n))

        def key() -> dict[str, Any]:
            if keys and rng.random() < 0.75:
                ident, version = rng.choice(keys)
                if rng.random() < 0.3:
                    version += rng.choice([-1, 1])
                return {"id": ident, "version": version}
            return {"id": rng.choice([1, 2, 99, 0, -1, 2**63, "1", 1.0, True]), "version": 1}

        op = rng.choice(["scan", "scan", "scan", "read", "put", "put", "put", "delete", "junk"])
        request: dict[str, Any]
        if op == "scan":
            request = {"operation": "scan", "query": content() if rng.random() < 0.8 else "tagged"}
            if rng.random() < 0.4:
                request["limit"] = rng.choice([1, 2, 5, 6, 0, "3", None, 2.0])
        elif op == "read":
            ids: list[Any] = [k[0] for k in keys[: rng.randint(0, 4)]]
            ids += rng.sample([1, 2, 3, 50, 0, -3, "2", 2**64], rng.randint(0, 2))
            request = {"operation": "read", "ids": ids}
        elif op == "put":
            request = {"operation": "put", "content": content()}
            if rng.random() < 0.35:
                request["replace"] = key()
        elif op == "delete":
            request = {"operation": "delete", **key()}
        else:
            return rng.choice([
                "{", "[]", "null", '"scan"', "{}", '{"operation": "scan"}',
                '{"operation": "scan", "query": "x", "extra": 1}',
                '{"operation": "scan", "query": "x", "query": "y"}',
                '{"operation": "scan", "query": "\\ud800"}',
                '{"operation": "put", "content": "a", "replace": {"id": 1, "version": 1, "z": 0}}',
                '{"operation": "scan", "query": "x", "ids": null, "content": null}',
                {"operation": "fly"}, {"operation": "read", "ids": "1"},
                {"operation": "read", "ids": list(range(1030))},
                {"operation": "scan", "query": "q " * 400}, {"operation": 5},
                '{"operation": "read", "ids": [1e400]}', '{"operation": "scan", "query": NaN}',
            ])  # fmt: skip
        if rng.random() < 0.25:
            return json.dumps(request, ensure_ascii=rng.random() < 0.5)
        return request

    # ------------------------------------------------------- 2. definitions and pure API

    def api(self) -> None:
        tm = self.tm
        self.add("api", "__all__", show(sorted(tm.__all__)))
        self.add("api", "__version__", show(getattr(tm, "__version__", None)))
        for name in sorted(tm.__all__):
            value = getattr(tm, name)
            if isinstance(value, str | float | int):
                self.add("api", f"constant {name}", show(value))
            elif callable(value):
                self.add("api", f"signature {name}", signature(value))
        for limits in (tm.Limits(), tm.Limits(content_bytes=10, scan_results=2, query_bytes=7)):
            for flat in (False, True):
                for strict in (False, True):
                    for root in (False, True):
                        args = {"flat": flat, "strict": strict, "root": root, "limits": limits}
                        text = self.call(lambda a=args: tm.tool_definition(**a))  # type: ignore[misc]
                        self.add("api", f"tool_definition {show(args)}", text)
        self.add("api", "Limits(content_bytes=0)", self.call(lambda: tm.Limits(content_bytes=0)))
        rng = random.Random(7)
        texts = self.secrets("rejected.txt") + self.secrets("allowed.txt")
        alphabet = "aZ_09 -\t\n数据库कि\u0301\u200d🙂é\u202e\x00\u3000.:/@=\"'"
        texts += [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 90))) for _ in range(600)
        ]
        for i, text in enumerate(texts):
            self.add("api", f"tokenize {i}", self.call(lambda t=text: tm.tokenize(t)))  # type: ignore[misc]
            self.add("api", f"find_secret {i}", self.call(lambda t=text: tm.find_secret(t)))  # type: ignore[misc]
            self.add("api", f"identity {i}", self.call(lambda t=text: tm.normalized_identity(t)))  # type: ignore[misc]
            n = rng.choice([0, 1, 5, 64, 200])
            self.add("api", f"preview {i} {n}", self.call(lambda t=text, n=n: tm.preview(t, n)))  # type: ignore[misc]
        for i in range(150):
            docs = [(j + 1, rng.choice(texts)) for j in range(rng.randint(0, 12))]
            query = rng.choice(texts)
            limit = rng.choice([1, 3, 5, 20])
            self.add(
                "api",
                f"rank {i}",
                self.call(functools.partial(tm.rank, query, docs, limit=limit)),
            )
        for enabled in (False, True):
            for base in ("", "You are a coding agent.", "x\n\n" + tm.MEMORY_INSTRUCTIONS):
                text = self.call(
                    functools.partial(tm.with_memory_instructions, base, enabled=enabled)
                )
                self.add("api", f"with_memory_instructions {enabled} {base[:20]!r}", text)
        for origin in ("fresh", "restored", "forked", "bad"):
            for enabled in (False, True):
                self.add("api", f"review {origin} {enabled}", self.review(origin, enabled))
        for path_env in ({}, {"TACT_HOME": str(self.root / "h")}, {"TACT_CONFIG": "rel/c.toml"}):
            text = self.call(lambda e=path_env: tm.resolve_config_path(environ=e))  # type: ignore[misc]
            self.add("api", f"resolve_config_path {path_env}", text)
        for cls in sorted(tm.__all__):
            value = getattr(tm, cls)
            if isinstance(value, type) and issubclass(value, tm.TactmemError):
                self.add("api", f"error {cls}", self.call(lambda v=value: error_text(v)))  # type: ignore[misc]

    def review(self, origin: str, enabled: bool) -> str:
        tm = self.tm

        def run() -> list[Any]:
            parent = tm.ReviewCheckpoint.start(enabled=enabled)
            state = tm.ReviewCheckpoint.start(enabled=enabled, origin=origin, parent=parent)
            seen: list[Any] = []
            for kind in ("submission", "steer", "auxiliary", "promoted_steer", "submission", "x"):
                try:
                    state, prompt = state.prompt(["hi", {"type": "text", "text": "p"}], kind=kind)
                    seen.append(prompt)
                except ValueError as error:
                    seen.append(f"ValueError: {error}")
            return seen

        return self.call(run)

    # ------------------------------------------------------------------- 3. command line

    def cli_env(self, home: Path) -> dict[str, str]:
        return {"HOME": str(home), "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}

    def cli(self) -> None:
        for name, steps in cli_sequences().items():
            home = self.fresh_dir(f"cli/{name}")
            (home / ".tact").mkdir()
            (home / ".tact" / "config.toml").write_text("[memory]\nenabled = true\n")
            (home / "off.toml").write_text("[memory]\nenabled = false\n")
            self.clock = CLOCK0
            cwd = os.getcwd()
            os.chdir(home)
            try:
                for i, step in enumerate(steps):
                    argv, stdin = step
                    self.tick(60_000)
                    env = self.cli_env(home)
                    text = self.run_main(list(argv), stdin, env)
                    self.add("cli", f"{name} {i} {show(argv)}", text + self.files(home))
            finally:
                os.chdir(cwd)

    def files(self, directory: Path) -> str:
        """Every file under `directory` with its mode and content digest (sqlite files: rows)."""
        lines = []
        for path in sorted(directory.rglob("*")):
            rel = path.relative_to(directory)
            info = path.lstat()
            if stat.S_ISDIR(info.st_mode):
                lines.append(f"{rel}/ {stat.filemode(info.st_mode)}")
            elif path.name.endswith((".sqlite3", "-cache", "-wal", "-shm", "-journal")):
                lines.append(f"{rel} {stat.filemode(info.st_mode)} (sqlite)")
            else:
                digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
                lines.append(f"{rel} {stat.filemode(info.st_mode)} {digest}")
        return "--- files\n" + "\n".join(lines) + "\n"

    def subprocesses(self) -> None:
        home = self.fresh_dir("sub")
        (home / ".tact").mkdir()
        (home / ".tact" / "config.toml").write_text("[memory]\nenabled = true\n")
        env = {**self.cli_env(home), "PYTHONPATH": str(self.side), "PYTHONSAFEPATH": "1"}
        runs: list[tuple[list[str], bytes]] = [
            (["-c", "import tactmem; print(tactmem.__file__)"], b""),
            (["-m", "tactmem", "--help"], b""),
            (["-m", "tactmem", "frobnicate"], b""),
            (["-m", "tactmem", "put", "-"], b"Releases are tagged by CI\r\n"),
            (["-m", "tactmem", "put", "-"], b"\xff\xfe not utf-8\n"),
            (["-m", "tactmem", "--json", "scan", "releases tagged"], b""),
            (["-m", "tactmem", "scan", "nothing here"], b""),
            (["-m", "tactmem", "read", "0"], b""),
            (["-m", "tactmem", "delete", "1@9"], b""),
            (["-m", "tactmem", "--json", "stats"], b""),
            (["-m", "tactmem", "tool"], b'{"operation":"scan","query":"ci"}\n{\n[1]\n'),
            (["-m", "tactmem", "tool", "--child"], b'{"operation":"delete","id":1,"version":1}\n'),
            (["-m", "tactmem", "export", "-"], b""),
            (["-m", "tactmem", "import", "-", "--dry-run"], b"garbage\n"),
            (["-m", "tactmem", "--db", "/proc/version", "list"], b""),
        ]
        for i, (args, stdin) in enumerate(runs):
            done = subprocess.run(
                [sys.executable, *args], input=stdin, capture_output=True, cwd=home, env=env,
                timeout=60, check=False,
            )  # fmt: skip
            text = (
                f"status {done.returncode}\n--- stdout\n{done.stdout.decode(errors='replace')}"
                f"--- stderr\n{done.stderr.decode(errors='replace')}"
            )
            self.add("subprocess", f"{i} {show(args)}", mask_times(text))

    # ----------------------------------------------------------------- 4. hostile files

    def hostile(self) -> None:
        self.hostile_databases()
        self.hostile_exports()
        self.hostile_configs()

    def hostile_databases(self) -> None:
        tm = self.tm
        good = self.fresh_dir("hostile/good") / "m.sqlite3"
        with tm.Store(good) as store:
            for text in ("Releases are tagged by CI", "The port is 5433", "Use small commits"):
                store.put(text, now_ms=self.tick())

        def copy(script: str = "", mode: int | None = None) -> Callable[[Path], object]:
            def make(path: Path) -> None:
                shutil.copy(good, path)
                if script:
                    sql(path, script)
                if mode is not None:
                    path.chmod(mode)

            return make

        bad_rows = (
            "PRAGMA ignore_check_constraints=ON;"
            "UPDATE memories SET content = 'password = hunter2hunter2' WHERE id = 2;"
            "UPDATE memories SET version = -4 WHERE id = 3;"
        )
        wrong_columns = (
            "CREATE TABLE memories(id INTEGER PRIMARY KEY, body TEXT); PRAGMA user_version=1;"
        )
        makers: dict[str, Callable[[Path], object]] = {
            "random bytes": lambda p: p.write_bytes(random.Random(1).randbytes(8192)),
            "empty file": lambda p: p.write_bytes(b""),
            "truncated": lambda p: p.write_bytes(good.read_bytes()[:5000]),
            "header only": lambda p: p.write_bytes(good.read_bytes()[:100]),
            "directory": lambda p: p.mkdir(),
            "foreign sqlite": lambda p: sql(p, "CREATE TABLE t(x); INSERT INTO t VALUES (1);"),
            "user_version 2": copy("PRAGMA user_version=2;"),
            "user_version 0": copy("PRAGMA user_version=0;"),
            "wrong columns": lambda p: sql(p, wrong_columns),
            "bad rows": copy(bad_rows),
            "unreadable": copy(mode=0),
            "valid": copy(),
        }
        commands: list[list[str]] = [
            ["list"], ["--json", "scan", "tagged"], ["stats"], ["--json", "put", "new fact here"],
            ["read", "1", "2", "3"], ["export", "-"], ["--json", "delete", "1@1"],
        ]  # fmt: skip
        for name, make in makers.items():
            for i, argv in enumerate(commands):
                directory = self.fresh_dir(f"hostile/db/{name.replace(' ', '_')}")
                path = directory / "m.sqlite3"
                make(path)
                before = digest(path)
                text = self.run_main(["--db", str(path), *argv], env=self.cli_env(directory))
                after = digest(path)
                self.add("hostile", f"db {name} {i} {show(argv)}",
                         f"{text}--- file before {before}\n--- file after {after}\n")  # fmt: skip
            directory = self.fresh_dir(f"hostile/db/{name.replace(' ', '_')}")
            path = directory / "m.sqlite3"
            make(path)

            def api_ops(p: Path = path) -> list[str]:
                with tm.Store(p) as store:
                    return [
                        self.call(lambda: store.scan("tagged", now_ms=self.now())),
                        self.call(lambda: store.list(now_ms=self.now())),
                        self.call(lambda: self.store_export(store)),
                    ]

            self.add("hostile", f"db {name} api", self.call(api_ops))

    def hostile_exports(self) -> None:
        tm = self.tm
        directory = self.fresh_dir("hostile/export-src")
        with tm.Store(directory / "m.sqlite3") as store:
            for text in ("Releases are tagged by CI", "The port is 5433", "Use small commits"):
                store.put(text, now_ms=self.tick())
            store.read([1], now_ms=self.tick())
            data: bytes = self.store_export(store).data
        manifest, *records = data.decode().splitlines()
        head = json.loads(manifest)

        def rebuild(lines: list[str], fix_counts: bool = True) -> bytes:
            body = "".join(line + "\n" for line in lines).encode()
            if fix_counts:
                head2 = dict(head, sha256=hashlib.sha256(body).hexdigest(), records=len(lines))
                head2["content_bytes"] = sum(
                    len(json.loads(x).get("content", "").encode()) for x in lines
                    if x.startswith("{") and isinstance(json.loads(x), dict)
                    and isinstance(json.loads(x).get("content"), str)
                )  # fmt: skip
                return (json.dumps(head2, separators=(",", ":")) + "\n").encode() + body
            return (manifest + "\n").encode() + body

        def edit(index: int, **changes: Any) -> list[str]:
            lines = list(records)
            record = json.loads(lines[index])
            record.update(changes)
            lines[index] = json.dumps(record, separators=(",", ":"), ensure_ascii=False)
            return lines

        files: dict[str, bytes] = {
            "valid": data,
            "empty": b"",
            "not json": b"hello\n",
            "no final newline": data[:-1],
            "not utf-8": data[:40] + b"\xff" + data[41:],
            "bad sha": data.replace(head["sha256"].encode(), b"0" * 64),
            "truncated": data[: len(data) // 2],
            "manifest only": (manifest + "\n").encode(),
            "manifest array": b"[]\n",
            "format_version 2": data.replace(b'"format_version":1', b'"format_version":2'),
            "id as string": rebuild(edit(0, key={"id": "1", "version": 1})),
            "huge id": rebuild(edit(0, key={"id": 2**64, "version": 1})),
            "float count": rebuild(edit(1, use_count=1.5)),
            "bool count": rebuild(edit(1, scan_count=True)),
            "duplicate ids": rebuild([records[0], records[0]]),
            "duplicate content": rebuild(
                [records[0], json.dumps(dict(json.loads(records[0]), key={"id": 9, "version": 1}))]
            ),
            "descending ids": rebuild(list(reversed(records))),
            "secret content": rebuild(edit(2, content="password = hunter2hunter2 AKIA1234")),
            "nul content": rebuild(edit(2, content="a\x00b")),
            "oversize content": rebuild(edit(2, content="x" * 2000)),
            "unknown field": rebuild(edit(0, colour="red")),
            "null content": rebuild(edit(0, content=None)),
            "NaN": rebuild(records).replace(b'"scan_count":0', b'"scan_count":NaN', 1),
            "repeated field": rebuild(
                [records[0].replace('"scan_count":', '"scan_count":1,"scan_count":', 1)]
            ),
            "wrong counts": rebuild(records[:2], fix_counts=False),
            "many records": rebuild(
                [
                    json.dumps(
                        {
                            **json.loads(records[0]),
                            "key": {"id": i, "version": 1},
                            "content": f"fact number {i}",
                        }
                    )
                    for i in range(1, 530)
                ]
            ),
        }
        for name, blob in files.items():
            base = self.fresh_dir(f"hostile/export/{name.replace(' ', '_')}")
            path = base / "in.jsonl"
            path.write_bytes(blob)
            shutil.copy(directory / "m.sqlite3", base / "held.sqlite3")
            for argv in (
                ["--db", str(base / "new.sqlite3"), "restore", str(path)],
                ["--db", str(base / "held.sqlite3"), "import", "--dry-run", str(path)],
                ["--db", str(base / "held.sqlite3"), "--json", "import", str(path)],
                ["--db", str(base / "held.sqlite3"), "restore", "-"],
                ["--db", str(base / "held.sqlite3"), "list"],
            ):
                before = self.files(base)
                text = self.run_main(argv, stdin=blob, env=self.cli_env(base))
                self.add("hostile", f"export {name} {show(argv)}",
                         f"{text}{before}{self.files(base)}")  # fmt: skip
            with tm.Store(base / "api.sqlite3") as fresh:
                self.add("hostile", f"export {name} api restore",
                         self.call(lambda s=fresh, b=blob: self.store_restore(s, b)))  # type: ignore[misc]  # fmt: skip
                self.add("hostile", f"export {name} api merge",
                         self.call(lambda s=fresh, b=blob: self.store_merge(s, b, True)))  # type: ignore[misc]  # fmt: skip

    def hostile_configs(self) -> None:
        tm = self.tm
        token = "abc.DEF-123_token"
        remote = (
            '[memory]\nenabled = true\n[memory.remote]\nendpoint = "http://127.0.0.1:9"\n'
            f'namespace = "alice"\nbearer_token = "{token}"\nworkspace_roots = ["ws"]\n'
        )
        configs: dict[str, bytes | None] = {
            "enabled": b"[memory]\nenabled = true\n",
            "disabled": b"[memory]\nenabled = false\n",
            "no memory table": b"[other]\nx = 1\n",
            "empty": b"",
            "not toml": b"[memory\nenabled = true\n",
            "unknown key": b"[memory]\nenabled = true\ncolour = 'red'\n",
            "enabled string": b'[memory]\nenabled = "yes"\n',
            "memory not table": b"memory = 5\n",
            "not utf-8": b"[memory]\nenabled = true # \xff\n",
            "deep nesting": b"x = " + b"[" * 2000 + b"]" * 2000 + b"\n",
            "huge": b"[memory]\nenabled = true\n" + b"# pad\n" * 12000,
            "nul": b"[memory]\x00\nenabled = true\n",
            "remote partial": b'[memory]\nenabled = true\n[memory.remote]\nnamespace = "a"\n',
            "remote bad endpoint": remote.replace(
                "http://127.0.0.1:9", "http://example.com"
            ).encode(),
            "remote bad namespace": remote.replace('"alice"', '"a b"').encode(),
            "remote token 0644": remote.encode(),
            "remote unknown key": (remote + "extra = 1\n").encode(),
            "directory": None,
        }
        for name, blob in configs.items():
            home = self.fresh_dir(f"hostile/config/{name.replace(' ', '_')}")
            config = home / "c.toml"
            if blob is None:
                config.mkdir()
            else:
                config.write_bytes(blob)
                config.chmod(0o644 if "0644" in name else 0o600)
            env = self.cli_env(home)
            c = str(config)
            commands = (["list"], ["--json", "stats"], ["--json", "put", "a fact"], ["tool"])
            for argv in (["--config", c, *command] for command in commands):
                before = self.files(home)
                text = self.run_main(argv, stdin=b'{"operation":"scan","query":"a"}\n', env=env)
                self.add("hostile", f"config {name} {show(argv)}",
                         f"{text}{before}{self.files(home)}".replace(token, "<TOKEN>"))  # fmt: skip
            self.add("hostile", f"config {name} load_config",
                     self.call(lambda c=config: tm.load_config(c, environ={})))  # type: ignore[misc]  # fmt: skip
            env2 = {"TACT_CONFIG": str(config), "HOME": str(home)}
            self.add("hostile", f"config {name} TACT_CONFIG",
                     self.run_main(["--json", "stats"], env=env2))  # fmt: skip

    def run_all(self) -> None:
        original = time.time_ns
        time.time_ns = lambda: self.clock * 1_000_000  # the wall clock, frozen (only here)
        try:
            self.tool_sessions()
            self.api()
            self.cli()
            self.hostile()
        finally:
            time.time_ns = original
        self.subprocesses()


def show(value: Any) -> str:
    """A stable text of a value: attrs classes by their repr, bytes by digest and head."""
    if isinstance(value, bytes):
        return f"bytes[{len(value)}] sha256={hashlib.sha256(value).hexdigest()} {value[:2000]!r}"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(show(v) for v in value) + "]"
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False, default=repr)
    return repr(value)


def signature(fn: Any) -> str:
    import inspect

    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "<no signature>"


def error_text(cls: type[Exception]) -> str:
    import inspect

    params = inspect.signature(cls).parameters
    args: list[Any] = []
    for p in params.values():
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty:
            args.append(7 if p.name in ("limit", "found", "supported") else "x")
    error = cls(*args)
    return f"{getattr(error, 'code', None)}: {error}"


def learn_keys(answer: dict[str, Any], keys: list[tuple[int, int]]) -> None:
    def walk(value: Any) -> Iterator[dict[str, Any]]:
        if isinstance(value, dict):
            if isinstance(value.get("id"), int) and isinstance(value.get("version"), int):
                yield value
            for v in value.values():
                yield from walk(v)
        elif isinstance(value, list):
            for v in value:
                yield from walk(v)

    for key in walk(answer):
        pair = (key["id"], key["version"])
        if pair not in keys:
            keys.append(pair)


def sql(path: Path, script: str) -> None:
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.executescript(script)
        db.commit()


def digest(path: Path) -> str:
    if path.is_dir():
        return "directory"
    if not path.exists():
        return "missing"
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    except OSError as error:
        return f"unreadable ({error.strerror})"


def mask_times(text: str) -> str:
    """Subprocesses run on the real clock: mask millisecond times (13 digits) and ages."""
    text = re.sub(r"\b1[0-9]{12}\b", "<MS>", text)
    text = re.sub(r"\b[0-9a-f]{64}\b", "<SHA256>", text)
    return re.sub(r"\b\d+ (seconds?|minutes?|s|m)\b", "<AGE>", text)


def cli_sequences() -> dict[str, list[tuple[list[str], bytes]]]:
    put = "Releases in `ledgerline` are tagged by CI, never by hand"
    basic: list[tuple[list[str], bytes]] = [
        (["put", put], b""),
        (["put", "The integration tests need port 5433"], b""),
        (["--json", "put", "数据库 migrations run with SQLite数据库 tooling"], b""),
        (["put", put], b""),
        (["put", "-"], b"echoed fact about httpServer\r\n"),
        (["put", "password = hunter2hunter2"], b""),
        (["put", "x" * 1100], b""),
        (["put", ""], b""),
        (["scan", "how are ledgerline releases tagged"], b""),
        (["--json", "scan", "port", "--limit", "2"], b""),
        (["scan", "port", "--limit", "9"], b""),
        (["scan", "tagged", "--min-coverage", "0.9"], b""),
        (["scan", "zzzz"], b""),
        (["scan", "   "], b""),
        (["read", "1", "2", "99"], b""),
        (["--json", "read", "2"], b""),
        (["read", "0"], b""),
        (["read", "-1"], b""),
        (["read", "77"], b""),
        (["put", "Releases are tagged by the release workflow", "--replace", "1@1"], b""),
        (["put", "stale replace", "--replace", "1@1"], b""),
        (["--json", "put", "bad key", "--replace", "x@y"], b""),
        (["delete", "2@5"], b""),
        (["delete", "5@0"], b""),
        (["delete", "40@1"], b""),
        (["--json", "delete", "2@1"], b""),
        (["list"], b""),
        (["list", "--sort", "newest"], b""),
        (["list", "--sort", "least"], b""),
        (["--json", "list", "--sort", "oldest"], b""),
        (["list", "--sort", "bogus"], b""),
        (["stats"], b""),
        (["--json", "stats"], b""),
        (["export", "backup.jsonl"], b""),
        (["--json", "export", "-"], b""),
        (["export", ".tact/memory/v1.sqlite3"], b""),
        (["--db", "new.sqlite3", "restore", "backup.jsonl"], b""),
        (["--db", "new.sqlite3", "--json", "list"], b""),
        (["--db", "new.sqlite3", "restore", "backup.jsonl"], b""),
        (["import", "backup.jsonl"], b""),
        (["--db", "other.sqlite3", "put", "another store's fact"], b""),
        (["--db", "other.sqlite3", "import", "--dry-run", "backup.jsonl"], b""),
        (["--db", "other.sqlite3", "--json", "import", "backup.jsonl"], b""),
        (["--db", "other.sqlite3", "import", "missing.jsonl"], b""),
        (["tool"], b'{"operation":"scan","query":"port"}\n{"operation":"put","content":"x y"}\n'
                   b'{"operation":"put","content":"x y"}\nnot json\n'
                   b'{"operation":"read","ids":[1]}\n'),
        (["tool", "--child"], b'{"operation":"put","content":"child fact"}\n'),
        (["--json", "tool", "--min-coverage", "2"], b""),
    ]  # fmt: skip
    usage: list[tuple[list[str], bytes]] = [
        ([], b""), (["--help"], b""), (["--version"], b""), (["frob"], b""), (["scan"], b""),
        (["--bogus", "list"], b""), (["--db", "a", "--config", "b", "list"], b""),
        (["scan", "x", "--limit", "abc"], b""), (["read"], b""), (["delete", "1"], b""),
        (["put", "a", "--replace", "1"], b""), (["list", "extra"], b""),
        (["--json", "read", "abc"], b""), (["eval", "missing.toml"], b""),
        (["push", "--dry-run"], b""), (["pull", "--all"], b""), (["browse"], b""),
        (["scan", "--help"], b""), (["demo"], b""),
    ]  # fmt: skip
    disabled: list[tuple[list[str], bytes]] = [
        (["--config", "off.toml", "list"], b""), (["--config", "off.toml", "--json", "stats"], b""),
        (["--config", "missing/c.toml", "put", "a fact"], b""),
        (["--config", "off.toml", "tool"], b'{"operation":"scan","query":"a"}\n'),
        (["--config", "off.toml", "--json", "tool"], b""),
    ]  # fmt: skip
    return {"basic": basic, "usage": usage, "disabled": disabled}


def worker_main(side: str, fixtures: str, out: str) -> int:
    with tempfile.TemporaryDirectory(prefix="tactmem-diff-") as root:
        os.umask(0o022)
        worker = Worker(Path(side), Path(fixtures), Path(root).resolve())
        worker.run_all()
        Path(out).write_text(json.dumps(worker.units, ensure_ascii=False), encoding="utf-8")
    return 0


# ------------------------------------------------------------------------------ parent side


def run_side(side: Path, fixtures: Path, out: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TACT_", "PYTHON"))}
    command = [sys.executable, "-I", __file__, "--worker", str(side), str(fixtures), str(out)]
    return subprocess.Popen(command, env=env, cwd=tempfile.gettempdir(), stderr=subprocess.PIPE)


def compare(old: Path, new: Path, *, quiet: bool = False, show_first: int = 5) -> int:
    """Run both sides; print the summary; return the number of differences (or -1)."""
    start = time.monotonic()
    fixtures = old / "fixtures"
    with tempfile.TemporaryDirectory(prefix="tactmem-diff-out-") as out:
        outs = Path(out, "old.json"), Path(out, "new.json")
        procs = [run_side(old, fixtures, outs[0]), run_side(new, fixtures, outs[1])]
        errors = [p.communicate()[1] for p in procs]
        for label, proc, err in zip(("OLD", "NEW"), procs, errors, strict=True):
            if proc.returncode != 0:
                print(f"{label} worker failed ({proc.returncode}):\n{err.decode()[-4000:]}")
                return -1
        sides: list[list[Unit]] = [
            [(u[0], u[1], u[2]) for u in json.loads(p.read_text(encoding="utf-8"))] for p in outs
        ]
    elapsed = time.monotonic() - start
    a, b = (keyed(side) for side in sides)
    counts: dict[str, list[int]] = {c: [0, 0, 0] for c in CATEGORIES}  # cases, units, diffs
    diffs: list[tuple[Unit, Unit | None]] = []
    seen_cases: dict[str, set[str]] = {c: set() for c in CATEGORIES}
    for key, unit in a.items():
        category, case, _text = unit
        seen_cases[category].add(group_of(category, case))
        counts[category][1] += 1
        other = b.get(key)
        if other != unit:
            counts[category][2] += 1
            diffs.append((unit, other))
    added = [unit for key, unit in b.items() if key not in a]  # NEW's additions: listed, not hidden
    for c in CATEGORIES:
        counts[c][0] = len(seen_cases[c])
    total = sum(v[2] for v in counts.values())
    if not quiet:
        print(f"tactmem differential: OLD {old}  NEW {new}  ({elapsed:.1f} s)")
        print(f"{'category':<12}{'cases':>8}{'units':>9}{'differences':>13}")
        for c in CATEGORIES:
            cases, units, d = counts[c]
            print(f"{c:<12}{cases:>8}{units:>9}{d:>13}")
        print(f"{'total':<12}{sum(v[0] for v in counts.values()):>8}{len(a):>9}{total:>13}")
        for unit in added:
            print(f"NEW only ({unit[0]}): {unit[1]}: {unit[2][:200]}")
        for old_unit, new_unit in diffs[:show_first]:
            print(f"\n--- difference in {old_unit[0]}: {old_unit[1]}")
            print(describe(old_unit[2], None if new_unit is None else new_unit[2]))
        if len(diffs) > show_first:
            print(f"\n... and {len(diffs) - show_first} more")
        print("\nzero differences" if total == 0 else f"\n{total} differences")
    return total


def keyed(units: list[Unit]) -> dict[tuple[str, str, int], Unit]:
    """The units by category, case and how many of that case came before: a unit one side adds
    (a new public name) shifts none of the others."""
    seen: dict[tuple[str, str], int] = {}
    out = {}
    for unit in units:
        n = seen[unit[:2]] = seen.get(unit[:2], -1) + 1
        out[(unit[0], unit[1], n)] = unit
    return out


def group_of(category: str, case: str) -> str:
    """What the summary counts as one case: a tool session, a CLI sequence, a hostile file."""
    if category == "tool":
        return case.split(" call ")[0].split(" export")[0].split(" list")[0]
    if category == "cli":
        return case.split(" ")[0]
    if category == "hostile":
        return " ".join(case.split(" [")[0].split(" ")[:-1]) or case
    return case


def describe(old: str, new: str | None) -> str:
    import difflib

    if new is None:
        return "NEW has no such unit"
    lines = difflib.unified_diff(old.splitlines(), new.splitlines(), "OLD", "NEW", n=1, lineterm="")
    return "\n".join(line[:400] for line in list(lines)[:24])


def self_test(old: Path) -> int:
    """OLD against OLD must be equal; doctored copies of OLD must differ."""
    source = (old / "tactmem.py").read_text(encoding="utf-8")
    doctored = {
        "reworded error message": ('"memory was not found"', '"memory was not found."'),
        "ranking change (k1 1.2 -> 1.3)": ("_BM25_K1: Final = 1.2", "_BM25_K1: Final = 1.3"),
    }
    failures = 0
    print("== OLD against OLD (determinism)")
    if compare(old, old, show_first=2) != 0:
        failures += 1
    with tempfile.TemporaryDirectory(prefix="tactmem-doctored-") as base:
        for name, (before, after) in doctored.items():
            if source.count(before) != 1:
                print(f"cannot doctor {name}: {before!r} is not in tactmem.py once")
                failures += 1
                continue
            side = Path(base, name.split()[0])
            side.mkdir()
            (side / "tactmem.py").write_text(source.replace(before, after), encoding="utf-8")
            print(f"\n== OLD against a doctored copy: {name}")
            if compare(old, side, show_first=2) <= 0:
                print(f"NOT DETECTED: {name}")
                failures += 1
    print("\nself-test passed" if failures == 0 else f"\nself-test failed ({failures})")
    return 0 if failures == 0 else 1


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        return worker_main(sys.argv[2], sys.argv[3], sys.argv[4])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--self-test", action="store_true", help="check the harness can fail")
    parser.add_argument("old", type=Path, help="a checkout holding tactmem.py (the baseline)")
    parser.add_argument("new", type=Path, nargs="?", help="a checkout holding tactmem.py")
    parser.add_argument("--show", type=int, default=5, help="differences shown in detail")
    args = parser.parse_args()
    for side in (args.old, args.new):
        if side is not None and not (side / "tactmem.py").is_file():
            parser.error(f"{side} holds no tactmem.py")
    if args.self_test:
        return self_test(args.old.resolve())
    if args.new is None:
        parser.error("NEW_DIR is required (or --self-test)")
    return 0 if compare(args.old.resolve(), args.new.resolve(), show_first=args.show) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
