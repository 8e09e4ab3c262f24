"""How tactmem's costs grow with the store (issue 16), beside SQLite FTS5. Run by hand.

    python bench/scale.py [--quick] [--sizes 512,2000,...] [--dir DIR] [BEFORE [AFTER]]

For N = 512, 2,000, 8,000 and 32,000 records it builds `bench.py`'s corpus extended to N
(`bench.extend_corpus`: distinct by normalized identity, secret-free, sizes spread as in the
512-record corpus) and a store with `Limits` raised in proportion to the defaults (records N,
content and page budgets N/512 times theirs). The store is created by `Store` and filled in one
bulk `INSERT` transaction, the rows as a put writes them, `normalized_identity` computed by the
store's own module; filling 32,000 records by puts would take minutes. Then, per N:

- warm `Store.scan` against FTS5 `bm25()` top 5 + the same telemetry transaction, interleaved
  query by query, the FTS5 index optimized (merged) first;
- the probation prune inside those scans (timed around `Store._prune`, where the module has one);
- `Store.put` of a record right after deleting it (a full store stays full) against bare
  `BEGIN IMMEDIATE; INSERT; COMMIT` and the same insert into the FTS5 table (which indexes it);
- a fresh process: import tactmem, open the store, first scan, then a second scan of another
  query; its peak RSS (VmHWM); against a fresh process that imports sqlite3 and runs one FTS5
  top 5 + telemetry transaction.

BEFORE and AFTER are directories holding a `tactmem.py`, or that file itself (AFTER defaults to
this checkout; e.g. `git worktree add --detach /tmp/before main`). Both are loaded into this
process, each gets its own copy of the database, and they alternate in every measurement; a
side's fresh processes run its own file. With neither, this checkout alone. It prints one table
per metric, N down the side, with the ratios to the anchor and after/before. Nothing here is a
target; exit 0.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any, Final

HERE: Final = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench  # noqa: E402

SIZES: Final = (512, 2_000, 8_000, 32_000)
DEFAULT_RECORDS: Final = 512
DEFAULT_CONTENT_BYTES: Final = 262_144
DEFAULT_DATABASE_BYTES: Final = 4_194_304

FTS_TRIGGERS: Final = (
    """CREATE TRIGGER memories_fts_insert AFTER INSERT ON memories BEGIN
        INSERT INTO memories_fts(rowid, content) VALUES (new.id, new.content);
    END""",
    """CREATE TRIGGER memories_fts_delete AFTER DELETE ON memories BEGIN
        INSERT INTO memories_fts(memories_fts, rowid, content)
            VALUES ('delete', old.id, old.content);
    END""",
)
# Peak RSS in KiB: VmHWM, the new program's own high-water mark. Linux keeps `ru_maxrss` across
# exec, so a child started from this large process would report this one's peak instead.
PEAK: Final = """
def peak_kib():
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
"""
COLD: Final = """
import json, sys, time
start = time.perf_counter_ns()
sys.path.insert(0, sys.argv[1])
import tactmem
imported = time.perf_counter_ns()
store = tactmem.Store(sys.argv[2], limits=tactmem.Limits(**json.loads(sys.argv[3])))
store.scan(sys.argv[4])
first = time.perf_counter_ns()
store.scan(sys.argv[5])
second = time.perf_counter_ns()
print(imported - start, first - imported, second - first, peak_kib())
"""
FTS_COLD: Final = f"""
import sqlite3, sys, time
start = time.perf_counter_ns()
connection = sqlite3.connect(sys.argv[1], isolation_level=None)
connection.execute("PRAGMA secure_delete = ON")
connection.execute("BEGIN IMMEDIATE")
cards = connection.execute({bench.FTS_TOP!r}, (sys.argv[2],)).fetchall()
now = time.time_ns() // 1_000_000
connection.executemany({bench.TELEMETRY!r}, [(now, card[0]) for card in cards])
connection.execute("COMMIT")
print(time.perf_counter_ns() - start, peak_kib())
"""

Samples = dict[str, list[float]]


def load(name: str, directory: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, directory / "tactmem.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def p50(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(len(ordered) / 2) - 1)]


def limits_for(records: int, content_bytes: int) -> dict[str, int]:
    """The defaults raised in proportion to N (the content budget at least what N holds)."""
    factor = records / DEFAULT_RECORDS
    return {
        "records": records,
        "total_content_bytes": max(math.ceil(DEFAULT_CONTENT_BYTES * factor), content_bytes),
        "database_bytes": math.ceil(DEFAULT_DATABASE_BYTES * factor),
    }


def bulk_fill(module: ModuleType, path: Path, limits: dict[str, int], texts: Sequence[str]) -> None:
    """A file `Store` created, then every row in one transaction, as a put would write it."""
    store = module.Store(path, limits=module.Limits(**limits))
    store.list()  # creates the file and its schema
    store.close()
    now = time.time_ns() // 1_000_000
    until = now + module.Limits().probation_ms
    identity = module.normalized_identity
    connection = bench.connect(path)
    with connection:
        connection.execute("BEGIN IMMEDIATE")
        connection.executemany(
            bench.INSERT,
            ((n, text, identity(text), now, now, until) for n, text in enumerate(texts, 1)),
        )
    connection.close()


class Side:
    """One tactmem checkout at one N: its module, its store and the keys of its records."""

    def __init__(self, name: str, directory: Path, module: ModuleType) -> None:
        self.name, self.directory, self.module = name, directory, module
        self.store: Any = None
        self.keys: list[Any] = []
        self.path = Path()

    def open(self, path: Path, limits: dict[str, int]) -> None:
        self.path = path
        self.store = self.module.Store(path, limits=self.module.Limits(**limits))
        self.keys = [record.key for record in self.store.list()]


def run_process(argv: Sequence[str], cwd: Path) -> tuple[float, list[int]]:
    """Wall milliseconds of a whole process, and the integers it printed."""
    start = time.perf_counter_ns()
    done = subprocess.run(
        argv, cwd=cwd, env=bench.PROCESS_ENV, capture_output=True, text=True, encoding="utf-8"
    )
    elapsed = (time.perf_counter_ns() - start) / 1e6
    if done.returncode != 0:
        sys.exit(f"a measured process failed with {done.returncode}: {done.stderr[-400:]}")
    return elapsed, [int(value) for value in done.stdout.split()]


ORDER: Final = random.Random(bench.SEED + 5)


def interleave(steps: Sequence[Callable[[], None]]) -> None:
    """The steps in a new shuffled order (as `bench.py` does): none always follows another."""
    for step in ORDER.sample(steps, len(steps)):
        step()


class Measurement:
    """Every sample at one N, keyed `metric` (the anchors) or `metric/side`."""

    def __init__(self, sides: Sequence[Side], work: Path, texts: Sequence[str]) -> None:
        self.sides, self.work, self.texts = sides, work, texts
        self.limits = limits_for(len(texts), sum(len(text.encode()) for text in texts))
        self.samples: Samples = {}
        for side in sides:
            bulk_fill(side.module, work / f"{side.name}.sqlite3", self.limits, texts)
            side.open(work / f"{side.name}.sqlite3", self.limits)
        self.fts, bare = work / "fts.sqlite3", work / "bare.sqlite3"
        shutil.copyfile(sides[0].path, self.fts)
        shutil.copyfile(sides[0].path, bare)
        self.anchor, self.plain = bench.connect(self.fts), bench.connect(bare)
        for statement in (*bench.FTS_SETUP, *FTS_TRIGGERS):
            self.anchor.execute(statement)

    def timed(self, name: str, action: Callable[[], object]) -> None:
        start = time.perf_counter_ns()
        action()
        self.samples.setdefault(name, []).append((time.perf_counter_ns() - start) / 1e6)

    def scans(self, queries: Sequence[str], rounds: int) -> None:
        """Warm scans against FTS5's, the FTS5 index merged first (nothing here changes it)."""
        for query in queries:  # every side's cache, and every query's terms, warm
            for side in self.sides:
                side.store.scan(query)
        self.anchor.execute(bench.FTS_OPTIMIZE)
        prunes = {side.name: prune_timer(side.store) for side in self.sides}
        gc.collect()
        for _ in range(rounds):
            for query in queries:
                steps = [
                    *(partial(self.scan, side, query, prunes[side.name]) for side in self.sides),
                    partial(
                        self.timed,
                        "fts scan",
                        partial(bench.fts_scan_telemetry, self.anchor, query),
                    ),
                ]
                interleave(steps)
        for side in self.sides:
            if prunes[side.name] is not None:
                del side.store._prune  # the class's method again

    def scan(self, side: Side, query: str, prunes: list[float] | None) -> None:
        """A timed scan, and the time its `_prune` calls took (0 when it made none)."""
        before = len(prunes) if prunes is not None else 0
        self.timed(f"scan/{side.name}", partial(side.store.scan, query))
        if prunes is not None:
            self.samples.setdefault(f"prune/{side.name}", []).append(sum(prunes[before:]))

    def puts(self, count: int) -> None:
        """Delete a record (untimed) and put its content back, so a full store stays full; the
        anchors delete the same row (untimed) and insert it again under a new id."""
        n, probation = len(self.texts), self.sides[0].module.Limits().probation_ms
        identity = self.sides[0].module.normalized_identity
        for number in range(count):
            position = number * 7919 % n  # spread over the table, never one row twice
            for side in self.sides:
                side.store.delete(side.keys[position])
            for connection in (self.plain, self.anchor):
                bench.transaction(connection, "DELETE FROM memories WHERE id = ?", (position + 1,))
            (next_id,) = self.plain.execute("SELECT next_id FROM memory_metadata").fetchone()
            text, now = self.texts[position], time.time_ns() // 1_000_000
            row = (next_id, text, identity(text), now, now, now + probation)
            steps = [
                *(partial(self.put, side, position) for side in self.sides),
                *(
                    partial(self.timed, name, partial(bench.transaction, db, bench.INSERT, row))
                    for name, db in (("bare insert", self.plain), ("fts insert", self.anchor))
                ),
            ]
            interleave(steps)
        for side in self.sides:
            side.store.close()
        self.anchor.close()
        self.plain.close()

    def put(self, side: Side, position: int) -> None:
        def put() -> None:
            side.keys[position] = side.store.put(self.texts[position]).key

        self.timed(f"put/{side.name}", put)

    def processes(self, queries: Sequence[str], rounds: int) -> None:
        """Fresh processes, each side's and FTS5's on copies, so none meets the others'
        telemetry. The first round warms the OS and bytecode caches and is not kept."""
        for side in self.sides:
            shutil.copyfile(side.path, self.work / f"{side.name}-cold.sqlite3")
        shutil.copyfile(self.fts, self.work / "fts-cold.sqlite3")
        for index in range(-1, rounds):
            first, second = queries[index % len(queries)], queries[(index + 7) % len(queries)]
            steps = [
                *(partial(self.fresh, side, first, second, index >= 0) for side in self.sides),
                partial(self.fresh_fts, first, index >= 0),
            ]
            interleave(steps)
        for side in self.sides:
            self.samples[f"file/{side.name}"] = [side.path.stat().st_size / 2**20]
        self.samples["fts file"] = [self.fts.stat().st_size / 2**20]

    def fresh(self, side: Side, first: str, second: str, keep: bool) -> None:
        cold = str(self.work / f"{side.name}-cold.sqlite3")
        argv = [sys.executable, "-c", PEAK + COLD, str(side.directory), cold]
        argv.append(json.dumps(self.limits))
        elapsed, printed = run_process([*argv, first, second], side.directory)
        imported, scanned, again, rss = printed
        if keep:
            for metric, value in (("process", elapsed), ("import", imported / 1e6),
                                  ("first", scanned / 1e6), ("second", again / 1e6),
                                  ("rss", rss / 1024)):  # fmt: skip
                self.samples.setdefault(f"{metric}/{side.name}", []).append(value)

    def fresh_fts(self, query: str, keep: bool) -> None:
        cold = str(self.work / "fts-cold.sqlite3")
        elapsed, (_, rss) = run_process(
            [sys.executable, "-c", PEAK + FTS_COLD, cold, bench.fts_match(query)], HERE
        )
        if keep:
            self.samples.setdefault("fts process", []).append(elapsed)
            self.samples.setdefault("fts rss", []).append(rss / 1024)


def measure(
    sides: Sequence[Side],
    work: Path,
    texts: Sequence[str],
    queries: Sequence[str],
    counts: tuple[int, int, int],
) -> Samples:
    scan_rounds, puts, process_rounds = counts
    started = time.perf_counter()
    measurement = Measurement(sides, work, texts)
    measurement.scans(queries, scan_rounds)
    measurement.puts(puts)
    measurement.processes(queries, process_rounds)
    for path in work.iterdir():
        path.unlink()
    print(f"  N {len(texts):,}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return measurement.samples


def prune_timer(store: Any) -> list[float] | None:
    """Times `store._prune` from now on (an instance attribute over the class's method), or
    None when this tactmem has no such method."""
    original = getattr(store, "_prune", None)
    if original is None:
        return None
    spent: list[float] = []

    def prune(*args: object, **kwargs: object) -> object:
        start = time.perf_counter_ns()
        try:
            return original(*args, **kwargs)
        finally:
            spent.append((time.perf_counter_ns() - start) / 1e6)

    store._prune = prune
    return spent


# name, title, unit format, anchor (a key of the samples, or None), anchor's title
TABLES: Final = (
    ("scan", "warm Store.scan p50 ms", "{:.2f}", "fts scan", "FTS5 top 5 + telemetry"),
    ("prune", "Store._prune inside a warm scan p50 ms", "{:.3f}", None, ""),
    ("put", "Store.put after a delete p50 ms", "{:.2f}", "bare insert",
     "bare BEGIN IMMEDIATE; INSERT; COMMIT"),
    ("put", "Store.put after a delete p50 ms", "{:.2f}", "fts insert",
     "the same INSERT into the FTS5-indexed table"),
    ("process", "fresh process: import, open, first scan, second scan p50 ms (wall)", "{:.0f}",
     "fts process", "fresh process: import sqlite3, FTS5 top 5 + telemetry"),
    ("first", "first scan inside a fresh process p50 ms", "{:.1f}", None, ""),
    ("second", "second scan (another query) inside that process p50 ms", "{:.1f}", None, ""),
    ("rss", "peak RSS of that process MiB", "{:.1f}", "fts rss", "the FTS5 process"),
    ("file", "database file after the run MiB", "{:.1f}", "fts file",
     "the FTS5 copy (content and index)"),
)  # fmt: skip


def report(results: dict[int, Samples], sides: Sequence[Side]) -> None:
    names = [side.name for side in sides]
    for key, title, form, anchor, anchor_title in TABLES:
        if not any(f"{key}/{name}" in samples for samples in results.values() for name in names):
            print(f"\n{title}: not measurable in this tactmem")
            continue
        print(f"\n{title}" + (f"; anchor: {anchor_title}" if anchor else ""))
        header = [f"{'N':>7}", *(f"{name:>9}" for name in names)]
        if anchor:
            header += [f"{'anchor':>9}", *(f"{name + '/anchor':>15}" for name in names)]
        if key == "prune":
            header += [f"{name + ' share of scan':>21}" for name in names]
        if len(names) == 2:
            header.append(f"{'after/before':>13}")
        print("  ".join(header))
        for n, samples in results.items():
            value = {name: p50(samples[f"{key}/{name}"]) for name in names}
            cells = [f"{n:>7,}", *(f"{form.format(value[name]):>9}" for name in names)]
            if anchor:
                base = p50(samples[anchor])
                cells += [f"{form.format(base):>9}"]
                cells += [f"{value[name] / base:>14.2f}x" for name in names]
            if key == "prune":
                shares = (value[name] / p50(samples[f"scan/{name}"]) for name in names)
                cells += [f"{share:>21.0%}" for share in shares]
            if len(names) == 2:
                cells.append(f"{value['after'] / value['before']:>12.2f}x")
            print("  ".join(cells))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "checkouts", type=Path, nargs="*", metavar="BEFORE [AFTER]", help="checkouts or tactmem.py"
    )
    parser.add_argument("--quick", action="store_true", help="512 and 2,000 records, few samples")
    parser.add_argument("--sizes", help="comma-separated record counts (default: 512,2000,...)")
    parser.add_argument("--dir", type=Path, help="where the databases go (default: a temp dir)")
    options = parser.parse_args(argv)
    if len(options.checkouts) > 2:
        parser.error("at most two checkouts: BEFORE [AFTER]")
    checkouts = [path.parent if path.name == "tactmem.py" else path for path in options.checkouts]
    dirs = dict(zip(("before", "after"), checkouts, strict=False))
    if dirs:
        dirs.setdefault("after", HERE.parent)
    else:
        dirs = {"tactmem": HERE.parent}
    for name, directory in dirs.items():
        if not (directory / "tactmem.py").is_file():
            parser.error(f"{name}: no tactmem.py in {directory}")
    sizes = [int(size) for size in options.sizes.split(",")] if options.sizes else list(SIZES)
    if options.quick and not options.sizes:
        sizes = [512, 2_000]
    started = time.perf_counter()
    sides = [
        Side(name, directory.resolve(), load(f"tactmem_{name}", directory.resolve()))
        for name, directory in dirs.items()
    ]
    rng = random.Random(bench.SEED)
    base = bench.build_corpus(rng)
    queries = bench.build_queries(rng)
    corpus = bench.extend_corpus(base, max(sizes))
    print(bench.machine())
    for side in sides:
        print(f"{side.name}: {side.directory / 'tactmem.py'}")
    print(
        f"corpus: bench.py's {len(base)} records extended to {max(sizes):,} in"
        f" {time.perf_counter() - started:.0f} s; {len(queries)} queries"
    )
    work = Path(tempfile.mkdtemp(prefix="tactmem-scale-", dir=options.dir))
    print(f"databases: {work} ({bench.file_system(work)})", flush=True)
    results: dict[int, Samples] = {}
    try:
        for n in sizes:
            scan_rounds = 1 if options.quick else max(1, 4096 // n)
            processes = 3 if options.quick else 8 if n <= 8_000 else 6  # 4 s each at 32,000
            counts = (scan_rounds, 12 if options.quick else 40, processes)
            results[n] = measure(sides, work, corpus[:n], queries, counts)
            texts = corpus[:n]
            print(
                f"N {n:,}: {sum(len(t.encode()) for t in texts):,} content bytes,"
                f" limits {limits_for(n, 0)};"
                f" {len(results[n][f'scan/{sides[0].name}'])} scans, {counts[1]} puts,"
                f" {counts[2]} fresh processes per side",
                flush=True,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(results, sides)
    print(
        "\nInterleaved: sides and anchors run in a new shuffled order at every step."
        " Compare ratios within this run, not milliseconds across runs."
        f"\ntotal time {time.perf_counter() - started:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
