"""Tests of tactmem-server: real server processes on 127.0.0.1 spoken to over real HTTP, on a real
SQLite file and on a real PostgreSQL cluster that this test run starts (initdb, pg_ctl).

The compatibility cases are ported from the original's `crates/memory/src/server/tests.rs`; each
runs against both backends. The PostgreSQL tests never skip: without a PostgreSQL they can start,
they fail and say why.
"""

from __future__ import annotations

import contextlib
import glob
import http.client
import io
import itertools
import json
import os
import pathlib
import pwd
import random
import re
import resource
import selectors
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import unittest.mock
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn
from urllib.parse import urlsplit

import attrs
import pytest
import tactmem
from hypothesis import given
from hypothesis import strategies as st

import tactmem_server

ALICE = "alice-test-token-000000000001"
BOB = "bob-test-token-00000000000002"
READER = "reader-test-token-00000000004"
ALICE_ROTATED = "alice-rotated-token-0000000009"
CREDENTIALS = f"""
[[credentials]]
namespace = "alice"
role = "writer"
token = "{ALICE}"

[[credentials]]
namespace = "bob"
role = "writer"
token = "{BOB}"

[[credentials]]
namespace = "reader"
role = "reader"
token = "{READER}"

[[credentials]]
namespace = "alice"
role = "writer"
token = "{ALICE_ROTATED}"
"""
TOKENS = {"alice": ALICE, "bob": BOB, "reader": READER}
SERVER = [sys.executable, "-m", "tactmem_server"]


def error(code: str) -> bytes:
    return json.dumps({"code": code}, separators=(",", ":")).encode()


# ============================================================================ PostgreSQL


def _postgres_binary(name: str) -> str | None:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=_version_key)
    return found[-1] if found else shutil.which(name)


def _version_key(path: str) -> tuple[int, ...]:
    part = path.split("/")[4]
    return tuple(int(piece) for piece in part.split(".") if piece.isdigit())


class Cluster:
    def __init__(self, socket_dir: str, restart: Callable[[], None]) -> None:
        self.socket_dir = socket_dir
        self.restart = restart

    def dsn(self, database: str) -> str:
        return f"host={self.socket_dir} user=postgres dbname={database}"

    def url(self, database: str) -> str:
        return f"postgresql://postgres@/{database}?host={self.socket_dir}"

    def new_database(self) -> str:
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.dsn("postgres"), autocommit=True) as connection:
            connection.execute(f'CREATE DATABASE "{name}" ENCODING UTF8 TEMPLATE template0')
        return name


def _unavailable(reason: str) -> NoReturn:
    pytest.fail(f"these tests need PostgreSQL (apt-get install postgresql), but {reason}")


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    """A throwaway cluster on a Unix socket only, run as `nobody` when the tests run as root
    (PostgreSQL refuses to run as root)."""
    initdb, pg_ctl = _postgres_binary("initdb"), _postgres_binary("pg_ctl")
    if initdb is None or pg_ctl is None:
        _unavailable("initdb and pg_ctl were not found")
    base = tempfile.mkdtemp(prefix="tactmem-pg-")
    user: dict[str, Any] = {}
    if os.geteuid() == 0:
        nobody = pwd.getpwnam("nobody")
        os.chown(base, nobody.pw_uid, nobody.pw_gid)
        os.chmod(base, 0o755)
        user = {"user": nobody.pw_uid, "group": nobody.pw_gid}
    data, sockets, log = (os.path.join(base, name) for name in ("data", "sockets", "log"))
    run = functools_partial_run(user, base)
    try:
        run([initdb, "-D", data, "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-locale"])
        run(["mkdir", sockets])
        options = f"-k {sockets} -c listen_addresses='' -c max_connections=300 -c fsync=off"
        run([pg_ctl, "-D", data, "-l", log, "-o", options, "-w", "start"])
    except subprocess.CalledProcessError as failure:
        shutil.rmtree(base, ignore_errors=True)
        _unavailable(f"{failure.cmd[0]} failed: {failure.stderr!r}")

    def restart() -> None:
        run([pg_ctl, "-D", data, "-l", log, "-m", "fast", "-o", options, "-w", "restart"])

    try:
        yield Cluster(sockets, restart)
    finally:
        subprocess.run([pg_ctl, "-D", data, "-m", "immediate", "stop"], **user, capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


def functools_partial_run(user: dict[str, Any], cwd: str) -> Callable[[list[str]], None]:
    def run(command: list[str]) -> None:
        subprocess.run(
            command, **user, cwd=cwd, check=True, capture_output=True, text=True, timeout=120
        )

    return run


# ============================================================================ servers and clients


class Client:
    """A real HTTP client: one fresh connection per request, so threads may share it."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80

    def call(
        self,
        path: str,
        body: object = None,
        *,
        namespace: str | None = "alice",
        token: str | None = None,
        method: str = "POST",
        headers: dict[str, str] | None = None,
        raw: bytes | None = None,
        timeout: float = 120,
    ) -> tuple[int, bytes]:
        sent = {"content-type": "application/json"}
        token = TOKENS.get(namespace or "", ALICE) if token is None else token
        if token:
            sent["authorization"] = f"Bearer {token}"
        if namespace is not None:
            sent["x-tact-memory-namespace"] = namespace
        sent.update(headers or {})
        data = raw if raw is not None else None if body is None else json.dumps(body).encode()
        connection = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            connection.request(
                method, path, body=data, headers={k: v for k, v in sent.items() if v}
            )
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    def ok(self, path: str, body: object = None, **options: Any) -> Any:
        status, data = self.call(path, body, **options)
        assert status == 200, (status, data)
        return json.loads(data)

    def put(self, content: str, namespace: str = "alice", replacement: object = None) -> Any:
        body = {"content": content, "replacement": replacement}
        return self.ok("/v1/memories/put", body, namespace=namespace)["memory"]

    def export(self, namespaces: list[str] | None = None, limit: int = 128) -> list[Any]:
        records, cursor = [], None
        while True:
            body = {"namespaces": namespaces, "cursor": cursor, "limit": limit}
            page = self.ok("/v1/memories/export", body, namespace="reader")
            records += page["memories"]
            cursor = page["next_cursor"]
            if cursor is None:
                return records


class Server:
    """`tactmem-server` as a subprocess on a free port; its log lines are kept."""

    def __init__(
        self, arguments: list[str], credentials: str, *extra: str,
        preexec_fn: Callable[[], object] | None = None,
    ) -> None:  # fmt: skip
        command = [*SERVER, *arguments, "--credentials", credentials, "--port", "0", *extra]
        self.process = subprocess.Popen(
            command, stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn
        )
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.url = ""
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(60) or not self.url:
            self.process.kill()
            raise AssertionError(f"the server did not start: {self.lines}")
        self.client = Client(self.url)

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line)
            if '"event":"listening"' in line:
                self.url = json.loads(line)["url"]
                self._ready.set()
        self._ready.set()

    def stop(self, sign: int = signal.SIGTERM) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sign)
        return self.process.wait(60)


@pytest.fixture
def credentials(tmp_path: pathlib.Path) -> str:
    path = tmp_path / "credentials.toml"
    path.write_text(CREDENTIALS)
    path.chmod(0o600)
    return str(path)


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> list[str]:
    if request.param == "sqlite":
        return ["--sqlite", str(tmp_path / "team.sqlite3")]
    cluster: Cluster = request.getfixturevalue("cluster")
    return ["--postgres", cluster.url(cluster.new_database())]


@pytest.fixture
def start(backend: list[str], credentials: str) -> Iterator[Callable[..., Server]]:
    servers: list[Server] = []

    def started(*extra: str) -> Server:
        servers.append(Server(backend, credentials, *extra))
        return servers[-1]

    yield started
    for server in servers:
        server.stop(signal.SIGKILL)


@pytest.fixture
def client(start: Callable[..., Server]) -> Client:
    return start().client


@contextlib.contextmanager
def store_locked(backend: list[str]) -> Iterator[None]:
    """Hold every table of the server's database locked from outside, with a real second
    connection, until the block ends."""
    kind, target = backend
    if kind == "--sqlite":
        connection = sqlite3.connect(target, isolation_level=None)
        connection.execute("BEGIN IMMEDIATE")
        try:
            yield
        finally:
            connection.execute("ROLLBACK")
            connection.close()
        return
    import psycopg

    with psycopg.connect(target) as locked:
        locked.execute("LOCK TABLE memory_namespaces, memories IN ACCESS EXCLUSIVE MODE")
        try:
            yield
        finally:
            locked.rollback()


def outside(backend: list[str], *statements: tuple[str, list[object]]) -> None:
    """Run statements (`?` placeholders) on the server's database from a second connection,
    as a foreign writer or an operator would, and commit them."""
    kind, target = backend
    if kind == "--sqlite":
        with contextlib.closing(sqlite3.connect(target)) as connection, connection:
            for sql, params in statements:
                connection.execute(sql, params)
        return
    import psycopg

    with psycopg.connect(target) as postgres:
        for sql, params in statements:
            postgres.execute(sql.replace("?", "%s"), params)


def assert_error(answer: tuple[int, bytes], status: int, code: str) -> None:
    assert answer == (status, error(code))


def snapshot_record(doc_id: int, version: int, content: str) -> dict[str, Any]:
    return {
        "key": {"id": doc_id, "version": version},
        "content": content,
        "created_at_ms": 10,
        "updated_at_ms": 10 + version,
        "last_scanned_at_ms": None,
        "scan_count": 0,
        "last_used_at_ms": None,
        "use_count": 0,
        "probation_until_ms": None,
    }


def key_of(record: dict[str, Any]) -> tuple[str, int, int]:
    key = record["key"]
    return key["namespace"], key["id"], key["version"]


# ============================================================================ the original's cases


@pytest.mark.slow
def test_authentication_namespace_and_role_are_enforced(client: Client) -> None:
    assert_error(client.call("/v1/session", method="GET", token=""), 401, "unauthorized")
    assert_error(
        client.call("/v1/session", method="GET", token=ALICE, namespace="reader"),
        403,
        "namespace_mismatch",
    )
    session = client.ok("/v1/session", method="GET")
    assert session == {"protocol_version": 1, "namespace": "alice", "role": "writer"}
    reader = client.ok("/v1/session", method="GET", namespace="reader")
    assert reader == {"protocol_version": 1, "namespace": "reader", "role": "reader"}
    denied = [
        ("/v1/memories/put", {"content": "reader cannot write", "replacement": None}),
        ("/v1/memories/delete", {"key": {"id": 1, "version": 1, "namespace": "reader"}}),
        ("/v1/memories/sync", {"memories": []}),
        ("/v1/memories/put", b"not json at all"),  # the role is checked before the body
    ]
    for path, body in denied:
        raw = body if isinstance(body, bytes) else None
        answer = client.call(path, None if raw else body, namespace="reader", raw=raw)
        assert_error(answer, 403, "forbidden")


BEARER_CASES = [
    (f"bearer {ALICE}", "alice", 200, None),  # the scheme is case-insensitive
    (f"BEARER {ALICE_ROTATED}", "alice", 200, None),  # a second token of the namespace
    (f"Basic {ALICE}", "alice", 401, "unauthorized"),
    (f"Bearer  {ALICE}", "alice", 401, "unauthorized"),
    (f"Bearer {ALICE}!", "alice", 401, "unauthorized"),
    ("Bearer unknown-token-000000000000", "alice", 401, "unauthorized"),
    ("Bearer", "alice", 401, "unauthorized"),
    (f"Bearer {ALICE}", None, 403, "namespace_mismatch"),
    (f"Bearer {ALICE}", "Alice", 403, "namespace_mismatch"),
    ("Bearer unknown-token-000000000000", None, 401, "unauthorized"),  # 401 before 403
]


def test_bearer_and_namespace_headers(client: Client) -> None:
    for authorization, namespace, status, code in BEARER_CASES:
        answer = client.call(
            "/v1/session", method="GET", token="", namespace=namespace,
            headers={"authorization": authorization},
        )  # fmt: skip
        assert answer[0] == status, authorization
        if code is not None:
            assert answer[1] == error(code), authorization


@pytest.mark.slow
def test_scan_read_and_list_return_only_caller_visible_records(client: Client) -> None:
    alice = client.put("alice private indexing note")
    bob = client.put("bob visible concurrent sqlite note", namespace="bob")
    listed = client.ok("/v1/memories/list", None)["memories"]
    assert [record["key"] for record in listed] == [alice["key"], bob["key"]]
    scanned = client.ok("/v1/memories/scan", {"query": "concurrent sqlite", "limit": 5})
    assert [card["key"] for card in scanned["candidates"]] == [bob["key"]]
    read = client.ok("/v1/memories/read", {"ids": [alice["key"]["id"]], "keys": [bob["key"]]})
    assert sorted(map(key_of, read["memories"])) == [("alice", 1, 1), ("bob", 1, 1)]
    # An unversioned id is the caller's own namespace; a stale versioned key returns nothing.
    bob_id = client.ok("/v1/memories/read", {"ids": [bob["key"]["id"]]}, namespace="bob")
    assert [key_of(r) for r in bob_id["memories"]] == [("bob", 1, 1)]
    stale = {**bob["key"], "version": 2}
    assert client.ok("/v1/memories/read", {"keys": [stale]})["memories"] == []
    local = {"id": bob["key"]["id"], "version": 1}  # no namespace: names no remote record
    assert client.ok("/v1/memories/read", {"keys": [local]}, namespace="reader")["memories"] == []


@pytest.mark.slow
def test_put_replace_and_delete_are_server_authored(client: Client) -> None:
    inserted = client.put("initial server-authored note")
    assert inserted["key"] == {"id": 1, "version": 1, "namespace": "alice"}
    replaced = client.put("replacement server-authored note", replacement=inserted["key"])
    assert replaced["key"] == {"id": 1, "version": 2, "namespace": "alice"}
    assert replaced["created_at_ms"] == inserted["created_at_ms"]
    assert client.call("/v1/memories/delete", {"key": replaced["key"]}) == (200, b"{}")
    read = client.ok("/v1/memories/read", {"ids": [1]})
    assert read["memories"] == []
    # Ids are never reused, even after every row is gone.
    assert client.put("a later note")["key"]["id"] == 2


@pytest.mark.slow
def test_foreign_keys_cannot_be_mutated(client: Client) -> None:
    alice = client.put("alice owns this note")
    local = {"id": alice["key"]["id"], "version": alice["key"]["version"]}
    assert_error(client.call("/v1/memories/delete", {"key": local}), 403, "forbidden")
    bob = client.put("bob owns this note", namespace="bob")
    replace = {"content": "alice cannot replace bob", "replacement": bob["key"]}
    assert_error(client.call("/v1/memories/put", replace), 403, "forbidden")
    assert_error(client.call("/v1/memories/delete", {"key": bob["key"]}), 403, "forbidden")
    local_replace = {"content": "nor a local key", "replacement": local}
    assert_error(client.call("/v1/memories/put", local_replace), 403, "forbidden")
    assert [key_of(r) for r in client.export()] == [("alice", 1, 1), ("bob", 1, 1)]


@pytest.mark.slow
def test_concurrent_puts_allocate_distinct_monotonic_ids(client: Client) -> None:
    assert client.put("initialize concurrent database")["key"]["id"] == 1
    with ThreadPoolExecutor(16) as pool:
        ids = list(
            pool.map(lambda n: client.put(f"concurrent note number {n}")["key"]["id"], range(16))
        )
    assert sorted(ids) == list(range(2, 18))


@pytest.mark.slow
def test_sync_replaces_the_callers_complete_snapshot(client: Client) -> None:
    first = [
        snapshot_record(10, 1, "first snapshot note"),
        snapshot_record(20, 1, "second snapshot note"),
    ]
    report = client.ok("/v1/memories/sync", {"memories": first})
    assert report == {"inserted": 2, "replaced": 0, "unchanged": 0, "deleted": 0}
    second = [
        snapshot_record(20, 2, "second snapshot revised"),
        snapshot_record(30, 1, "third snapshot note"),
    ]
    report = client.ok("/v1/memories/sync", {"memories": second})
    assert report == {"inserted": 1, "replaced": 1, "unchanged": 0, "deleted": 1}
    exported = client.export(["alice"], limit=10)
    assert [record["key"]["id"] for record in exported] == [20, 30]
    assert exported[0] == {**second[0], "key": {"id": 20, "version": 2, "namespace": "alice"}}
    report = client.ok("/v1/memories/sync", {"memories": second})  # full equality: unchanged
    assert report == {"inserted": 0, "replaced": 0, "unchanged": 2, "deleted": 0}
    # The allocator moves past the snapshot's ids.
    assert client.put("after the snapshot")["key"]["id"] == 31


SYNC_REFUSALS = [
    (
        [snapshot_record(10, 1, "first value"), snapshot_record(10, 2, "second value")],
        400,
        "bad_request",
    ),
    (
        [
            {
                **snapshot_record(1, 1, "remote key"),
                "key": {"id": 1, "version": 1, "namespace": "alice"},
            }
        ],
        400,
        "bad_request",
    ),
    ([snapshot_record(0, 1, "id zero")], 400, "bad_request"),
    ([snapshot_record(1, 1, "   ")], 400, "bad_request"),
    ([snapshot_record(1, 1, "x" * 1025)], 400, "bad_request"),
    ([{**snapshot_record(1, 1, "times"), "updated_at_ms": 9}], 400, "bad_request"),
    ([snapshot_record(1, 1, "x" * 1024), snapshot_record(2, 1, "x" * 1024)], 409, "duplicate"),
    ([snapshot_record(1, 1, "Same  words"), snapshot_record(2, 1, "same words")], 409, "duplicate"),
    (
        [{**snapshot_record(1, 1, "version too large"), "key": {"id": 1, "version": 2**63}}],
        409,
        "conflict",
    ),
    ([{**snapshot_record(1, 1, "count too large"), "use_count": 2**64 - 1}], 409, "conflict"),
    ([{**snapshot_record(1, 1, "count beyond u64"), "use_count": 2**64}], 400, "bad_request"),
    ([snapshot_record(1, 1, "password = hunter2hunter2")], 400, "bad_request"),
    ([snapshot_record(2**63 - 1, 1, "the id after it does not fit")], 400, "bad_request"),
    ([snapshot_record(1, 1, "nul \x00 inside")], 400, "bad_request"),
    ([snapshot_record(n, 1, f"note {n}") for n in range(1, 514)], 400, "bad_request"),
    ([snapshot_record(n, 1, f"{n:04}" + "y" * 1020) for n in range(1, 258)], 400, "bad_request"),
]


@pytest.mark.slow
def test_sync_refusals_change_nothing(client: Client) -> None:
    kept = client.put("kept through every refused sync")
    for memories, status, code in SYNC_REFUSALS:
        assert_error(client.call("/v1/memories/sync", {"memories": memories}), status, code)
        assert client.export(["alice"]) == [kept]


@pytest.mark.slow
def test_the_last_ids_are_refused_not_a_wedged_namespace(client: Client) -> None:
    """The allocator records the id after each one it hands out, and that must fit in 64 bits:
    the highest id a namespace holds is 2^63 - 2. A put with no id left is the original's
    storage-capacity answer, 507 `content_capacity`, and stays so: ids are never reused."""
    top = 2**63 - 2
    report = client.ok("/v1/memories/sync", {"memories": [snapshot_record(top, 1, "highest")]})
    assert report["inserted"] == 1
    for _ in range(2):
        answer = client.call("/v1/memories/put", {"content": "no id is left for this"})
        assert_error(answer, 507, "content_capacity")
    replaced = client.put("highest, replaced", replacement={"id": top, "version": 1, **NS})
    assert key_of(replaced) == ("alice", top, 2)
    assert client.ok("/v1/memories/sync", {"memories": []})["deleted"] == 1
    assert_error(
        client.call("/v1/memories/put", {"content": "still none"}), 507, "content_capacity"
    )
    assert client.export(["alice"]) == []
    assert client.put("other namespaces are untouched", namespace="bob")["key"]["id"] == 1


NS = {"namespace": "alice"}


@pytest.mark.slow
def test_counters_at_their_limit_saturate_or_are_refused(client: Client) -> None:
    """Every count and version the server writes is a 64-bit SQL integer on both backends: at
    2^63 - 1 a scan or read count stays there (SQLite would make it REAL, PostgreSQL fail),
    and a replace of the last version is a conflict."""
    top = 2**63 - 1
    snapshot = [
        {**snapshot_record(1, 1, "saturated counter gotcha one"), "scan_count": top},
        {**snapshot_record(2, 1, "saturated counter gotcha two"), "use_count": top},
        {**snapshot_record(3, top, "the last version there is"), "updated_at_ms": 20},
    ]
    assert client.ok("/v1/memories/sync", {"memories": snapshot})["inserted"] == 3
    for _ in range(2):
        cards = client.ok("/v1/memories/scan", {"query": "saturated counter gotcha", "limit": 5})
        assert sorted(card["key"]["id"] for card in cards["candidates"]) == [1, 2]
        read = client.ok("/v1/memories/read", {"ids": [1, 2]})["memories"]
        assert [r["key"]["id"] for r in read] == [1, 2]
    exported = {r["key"]["id"]: r for r in client.export(["alice"])}
    assert (exported[1]["scan_count"], exported[1]["use_count"]) == (top, 2)
    assert (exported[2]["scan_count"], exported[2]["use_count"]) == (2, top)
    last = {"content": "one version more", "replacement": {"id": 3, "version": top, **NS}}
    assert_error(client.call("/v1/memories/put", last), 409, "conflict")
    assert exported[3]["key"]["version"] == top and exported[3]["content"] == snapshot[2]["content"]


@pytest.mark.slow
def test_export_paginates_all_or_selected_without_deduplication(client: Client) -> None:
    client.put("same normalized content")
    client.put("alice second export note")
    client.put("same normalized content", namespace="bob")
    pages, body = [], {"namespaces": None, "cursor": None, "limit": 1}
    while True:
        page = client.ok("/v1/memories/export", body)
        pages.append(page)
        if page["next_cursor"] is None:
            break
        last = page["memories"][-1]["key"]
        assert page["next_cursor"] == {"namespace": last["namespace"], "id": last["id"]}
        body = {**body, "cursor": page["next_cursor"]}
    records = [record for page in pages for record in page["memories"]]
    assert [key_of(r) for r in records] == [("alice", 1, 1), ("alice", 2, 1), ("bob", 1, 1)]
    assert len(pages) == 3  # next_cursor is null exactly when nothing follows
    selected = client.ok("/v1/memories/export", {"namespaces": ["bob"], "limit": 10})
    assert [key_of(r) for r in selected["memories"]] == [("bob", 1, 1)]
    assert selected["next_cursor"] is None


@pytest.mark.slow
def test_export_orders_ids_as_numbers(client: Client) -> None:
    for n in range(12):
        client.put(f"numbered note {n}")
    ids = [record["key"]["id"] for record in client.export(["alice"], limit=5)]
    assert ids == list(range(1, 13))  # not 1, 10, 11, 12, 2, ... as text would order them


@pytest.mark.slow
def test_body_and_request_bounds_are_content_free_client_errors(client: Client) -> None:
    too_long = {"query": "q" * 513, "limit": 1}
    assert_error(client.call("/v1/memories/scan", too_long), 413, "query_too_large")
    content = {"content": "c" * 1025, "replacement": None}
    assert_error(client.call("/v1/memories/put", content), 413, "content_too_large")
    for limit in (0, 6):
        answer = client.call("/v1/memories/scan", {"query": "bounded", "limit": limit})
        assert_error(answer, 400, "bad_request")
    for export in (
        {"namespaces": None, "limit": 0},
        {"namespaces": None, "limit": 129},
        {"namespaces": [], "limit": 1},
    ):
        assert_error(client.call("/v1/memories/export", export), 400, "bad_request")
    many = {"ids": list(range(1, 514)), "keys": []}
    assert_error(client.call("/v1/memories/read", many), 400, "bad_request")
    client.put("duplicate response marker")
    duplicate = {"content": "Duplicate   response MARKER", "replacement": None}
    assert_error(client.call("/v1/memories/put", duplicate), 409, "duplicate")
    oversized = b"x" * (2 * 1024 * 1024 + 1)
    assert_error(client.call("/v1/memories/put", raw=oversized), 413, "bad_request")
    assert_error(client.call("/v1/memories/sync", raw=oversized), 413, "bad_request")
    assert client.ok("/v1/memories/read", {"ids": list(range(1, 513))})["memories"] != []


MALFORMED = [
    ("/v1/memories/scan", b"not json", {}),
    ("/v1/memories/scan", b'{"query": "q", "limit": 1}', {"content-type": ""}),
    ("/v1/memories/scan", b'{"query": "q", "limit": 1}', {"content-type": "text/plain"}),
    ("/v1/memories/scan", b'{"query": "q", "limit": 1, "scope": "all"}', {}),
    ("/v1/memories/scan", b'{"query": "q"}', {}),
    ("/v1/memories/scan", b'{"query": "q", "limit": 1.0}', {}),
    ("/v1/memories/scan", b'{"query": "q", "limit": true}', {}),
    ("/v1/memories/scan", b'{"query": "q", "limit": NaN}', {}),
    ("/v1/memories/scan", b'{"query": "q", "query": "r", "limit": 1}', {}),
    ("/v1/memories/scan", b'{"query": "\\ud800", "limit": 1}', {}),
    ("/v1/memories/scan", b'{"query": "\xff", "limit": 1}', {}),
    ("/v1/memories/scan", b'["q", 1] trailing', {}),
    ("/v1/memories/read", b'{"ids": null}', {}),
    ("/v1/memories/read", b'{"ids": [0]}', {}),
    ("/v1/memories/read", b'{"ids": [9223372036854775808]}', {}),
    ("/v1/memories/read", b'{"keys": [{"id": 1, "version": 0, "namespace": "bob"}]}', {}),
    ("/v1/memories/read", b'{"keys": [{"id": 1, "version": 1, "namespace": "b b"}]}', {}),
    ("/v1/memories/put", b'{"content": "   \\u3000 "}', {}),
    ("/v1/memories/put", b'{"content": "aws key AKIAIOSFODNN7EXAMPLE here"}', {}),
    ("/v1/memories/put", b'{"content": "nul \\u0000 inside"}', {}),
    ("/v1/memories/export", b'{"limit": 1, "cursor": {"namespace": "alice", "id": 0}}', {}),
    ("/v1/memories/export", b'{"limit": 1, "cursor": {"namespace": "alice", "id": 1, "x": 1}}', {}),
    ("/v1/memories/export", b'{"limit": 1, "namespaces": ["ok", ""]}', {}),
    ("/v1/memories/delete", b"{}", {}),
    ("/v1/memories/sync", b'{"memories": [{"key": {"id": 1, "version": 1}}]}', {}),
]


@pytest.mark.slow
def test_malformed_requests_are_bad_requests(client: Client) -> None:
    for path, raw, headers in MALFORMED:
        assert client.call(path, raw=raw, headers=headers) == (400, error("bad_request")), raw
    assert client.export() == []


@pytest.mark.slow
def test_versions_and_missing_rows(client: Client) -> None:
    record = client.put("versioned note")
    stale = {**record["key"], "version": 2}
    assert_error(
        client.call("/v1/memories/put", {"content": "new", "replacement": stale}), 409, "conflict"
    )
    assert_error(client.call("/v1/memories/delete", {"key": stale}), 409, "conflict")
    missing = {"id": 99, "version": 1, "namespace": "alice"}
    assert_error(
        client.call("/v1/memories/put", {"content": "new", "replacement": missing}),
        404,
        "not_found",
    )
    assert client.call("/v1/memories/delete", {"key": missing}) == (200, b"{}")  # idempotent
    other = client.put("another note")
    clash = {"content": "ANOTHER note", "replacement": record["key"]}
    assert_error(client.call("/v1/memories/put", clash), 409, "duplicate")
    # The original's order: duplicate before not found and conflict.
    for key in (missing, stale):
        clash = {"content": "another   NOTE", "replacement": key}
        assert_error(client.call("/v1/memories/put", clash), 409, "duplicate")
    assert [key_of(r) for r in client.export()] == [("alice", 1, 1), ("alice", 2, 1)]
    assert other["key"]["id"] == 2


@pytest.mark.slow
def test_unknown_routes_and_wrong_methods_have_empty_bodies(client: Client) -> None:
    assert client.call("/v1/memories/unknown", {}) == (404, b"")
    assert client.call("/v2/session", method="GET") == (404, b"")
    assert client.call("/v1/memories/scan", method="GET") == (405, b"")
    assert client.call("/v1/session", method="POST") == (405, b"")
    assert client.call("/v1/session/", method="GET") == (404, b"")  # no redirect


@pytest.mark.slow
def test_list_ignores_its_body(client: Client) -> None:
    client.put("listed whatever the body")
    for raw in (b"null", b"not json", b"x" * (3 * 1024 * 1024)):
        assert (
            len(client.ok("/v1/memories/list", raw=raw, headers={"content-type": ""})["memories"])
            == 1
        )


@pytest.mark.slow
def test_record_and_content_capacity_per_namespace(client: Client) -> None:
    full = [snapshot_record(n, 1, f"{n:04}" + "z" * 1020) for n in range(1, 257)]
    assert client.ok("/v1/memories/sync", {"memories": full})["inserted"] == 256
    assert_error(
        client.call("/v1/memories/put", {"content": "one byte more"}), 507, "content_capacity"
    )
    small = [snapshot_record(n, 1, f"small note {n}") for n in range(1, 513)]
    assert client.ok("/v1/memories/sync", {"memories": small}, namespace="bob")["inserted"] == 512
    assert_error(
        client.call("/v1/memories/put", {"content": "one more"}, namespace="bob"),
        507,
        "record_capacity",
    )
    replace = {"content": "y" * 1024, "replacement": {"id": 1, "version": 1, "namespace": "alice"}}
    assert client.ok("/v1/memories/put", replace)["memory"]["key"]["version"] == 2  # same size fits
    assert len(client.export(["alice"])) == 256 and len(client.export(["bob"])) == 512


@pytest.mark.slow
def test_telemetry_of_scan_read_and_replace(client: Client) -> None:
    record = client.put("telemetry gotcha in the ledgerline repository")
    assert record["probation_until_ms"] == record["updated_at_ms"] + 604_800_000
    cards = client.ok("/v1/memories/scan", {"query": "ledgerline", "limit": 5}, namespace="reader")
    assert [card["key"] for card in cards["candidates"]] == [record["key"]]
    assert cards["candidates"][0]["preview"] == record["content"][:64]
    (scanned,) = client.export()
    assert scanned["scan_count"] == 1 and scanned["last_scanned_at_ms"] is not None
    (read,) = client.ok("/v1/memories/read", {"keys": [record["key"]]}, namespace="reader")[
        "memories"
    ]
    assert read["use_count"] == 1 and read["probation_until_ms"] is None
    assert read["last_used_at_ms"] is not None and read["scan_count"] == 1
    assert client.export() == [read]
    replaced = client.put("telemetry gotcha, revised", replacement=record["key"])
    assert (replaced["scan_count"], replaced["use_count"], replaced["last_used_at_ms"]) == (
        0,
        0,
        None,
    )
    assert replaced["probation_until_ms"] is not None
    assert replaced["created_at_ms"] == record["created_at_ms"]


@pytest.mark.slow
def test_expired_probation_is_pruned_in_every_namespace(client: Client) -> None:
    expired = snapshot_record(1, 1, "expired unread note")
    expired["probation_until_ms"] = 1
    graduated = {**snapshot_record(2, 1, "graduated note"), "probation_until_ms": 1, "use_count": 1}
    client.ok("/v1/memories/sync", {"memories": [expired, graduated]}, namespace="bob")
    listed = client.ok("/v1/memories/list", None, namespace="reader")["memories"]
    assert [key_of(r) for r in listed] == [("bob", 2, 1)]


@pytest.mark.slow
def test_scan_ranks_the_combined_corpus_as_the_core_does(client: Client) -> None:
    documents = {
        ("bob", 1): "deploy with make release from the main branch",
        ("alice", 1): "deploy with make release from the main branch",  # a tie: alice first
        ("alice", 2): "release notes are written by hand",
        ("bob", 2): "the main database migrations run on deploy",
        ("alice", 3): "unrelated gotcha about caching",
    }
    for (namespace, _), content in documents.items():
        client.put(content, namespace=namespace)
    ordered = sorted(documents)
    query = "deploy release main"
    expected = tactmem.rank(query, [(i, documents[key]) for i, key in enumerate(ordered)], limit=5)
    cards = client.ok("/v1/memories/scan", {"query": query, "limit": 5})["candidates"]
    got = [((c["key"]["namespace"], c["key"]["id"]), c["score"]) for c in cards]
    assert got == [(ordered[i], score) for i, score in expected]
    assert got[0][0] == ("alice", 1) and got[1][0] == ("bob", 1) and got[0][1] == got[1][1]
    limited = client.ok("/v1/memories/scan", {"query": query, "limit": 2})["candidates"]
    assert [c["key"] for c in limited] == [c["key"] for c in cards[:2]]
    # The per-process statistics follow a change in one namespace only.
    client.put("release release release deploy main", namespace="bob")
    documents["bob", 3] = "release release release deploy main"
    ordered = sorted(documents)
    expected = tactmem.rank(query, [(i, documents[key]) for i, key in enumerate(ordered)], limit=5)
    cards = client.ok("/v1/memories/scan", {"query": query, "limit": 5})["candidates"]
    assert [((c["key"]["namespace"], c["key"]["id"]), c["score"]) for c in cards] == [
        (ordered[i], score) for i, score in expected
    ]


# ============================================================================ limits and operations


def wait_for(condition: Callable[[], bool], what: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def health(client: Client) -> dict[str, Any]:
    status, data = client.call("/healthz", method="GET", token="", namespace=None)
    assert status in (200, 503), status
    answer: dict[str, Any] = json.loads(data)
    return answer


@pytest.mark.slow
def test_in_flight_limit_queues_requests_beyond_64(
    backend: list[str], start: Callable[..., Server]
) -> None:
    server = start()
    client = server.client
    assert health(client) == {"status": "ok", "in_flight": 0, "waiting": 0}
    with ThreadPoolExecutor(65) as pool, store_locked(backend):
        answers = [pool.submit(client.call, "/v1/memories/list", None) for _ in range(65)]
        wait_for(
            lambda: (
                {k: health(client)[k] for k in ("in_flight", "waiting")}
                == {"in_flight": 64, "waiting": 1}
            ),
            "64 requests in flight and one waiting",
        )
        time.sleep(0.3)  # and it stays so while the store is held
        assert {k: health(client)[k] for k in ("in_flight", "waiting")} == {
            "in_flight": 64,
            "waiting": 1,
        }
    assert [answer.result() for answer in answers] == [(200, b'{"memories":[]}')] * 65
    assert health(client) == {"status": "ok", "in_flight": 0, "waiting": 0}


@pytest.mark.slow
def test_store_timeout_answers_unavailable_and_writes_nothing(
    backend: list[str], start: Callable[..., Server]
) -> None:
    client = start("--store-timeout", "1").client
    with store_locked(backend):
        began = time.monotonic()
        answer = client.call("/v1/memories/put", {"content": "never written"})
        waited = time.monotonic() - began
    assert_error(answer, 503, "unavailable")
    assert 0.9 < waited < 6, waited  # the store timeout, not the grace period after it
    time.sleep(0.5)
    assert client.export() == []
    assert client.put("written after the lock")["key"]["id"] == 1


class SlowPeers:
    """`count` connections to a server from one thread, each sending `head` once connected and
    then one byte of `trickle` every `every_s` (nothing, when it is empty): slow bodies, slow
    heads or idle keep-alive connections. A connection the server closes is counted and
    opened again, so the pressure stays until the block ends. Connecting never blocks: a
    server that accepts slowly only slows the peers down."""

    def __init__(
        self, port: int, count: int, head: bytes = b"", trickle: bytes = b"", every_s: float = 0.5
    ) -> None:  # fmt: skip
        self.port, self.count, self.head, self.trickle, self.every_s = (
            port, count, head, trickle, every_s,
        )  # fmt: skip
        self.closed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> SlowPeers:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(60)

    def _open(self, selector: selectors.BaseSelector) -> None:
        peer = socket.socket()
        peer.setblocking(False)
        peer.connect_ex(("127.0.0.1", self.port))
        selector.register(peer, selectors.EVENT_WRITE, [0])  # bytes of `trickle` sent

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        for _ in range(self.count):
            self._open(selector)
        tick = time.monotonic()
        while not self._stop.is_set():
            for key, events in selector.select(0.05):
                self._answer(selector, key, events)
            if self.trickle and time.monotonic() >= tick:
                tick = time.monotonic() + self.every_s
                for key in list(selector.get_map().values()):
                    if key.events == selectors.EVENT_READ:  # connected, its head sent
                        self._send(selector, key, self.trickle[key.data[0] : key.data[0] + 1])
                        key.data[0] += 1
        for key in list(selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]

    def _answer(self, selector: selectors.BaseSelector, key: Any, events: int) -> None:
        if events & selectors.EVENT_WRITE:  # connected (or refused): send the head
            selector.modify(key.fileobj, selectors.EVENT_READ, key.data)
            self._send(selector, key, self.head)
            return
        with contextlib.suppress(OSError):  # an answer to drain, or the server closed it
            if key.fileobj.recv(65536):
                return
        self._replace(selector, key)

    def _send(self, selector: selectors.BaseSelector, key: Any, data: bytes) -> None:
        try:
            key.fileobj.send(data)
        except OSError:
            self._replace(selector, key)

    def _replace(self, selector: selectors.BaseSelector, key: Any) -> None:
        if key.fileobj.fileno() < 0 or key.fileobj not in selector.get_map():
            return
        selector.unregister(key.fileobj)
        key.fileobj.close()
        self.closed += 1
        self._open(selector)


def put_head(length: int) -> bytes:
    return (
        f"POST /v1/memories/put HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ALICE}\r\n"
        "x-tact-memory-namespace: alice\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def answered_at_once(client: Client) -> None:
    """A fresh request answered within 10 seconds (a socket timeout, not a speed check)."""
    assert client.call("/v1/session", method="GET", timeout=10)[0] == 200


@pytest.mark.slow
def test_slow_bodies_hold_no_place_and_are_cut_off(
    tmp_path: pathlib.Path, credentials: str
) -> None:
    """70 connections sending a put's body a byte every half second: none holds one of the 64
    places (a request takes one once its body is in), a fresh request is answered at once,
    and the server closes each once its body is not in within `--read-timeout`. The place
    limit does not depend on the backend, so SQLite alone is used."""
    arguments = ["--sqlite", str(tmp_path / "team.sqlite3")]
    server = Server(arguments, credentials, "--store-timeout", "1", "--read-timeout", "2")
    port = urlsplit(server.url).port or 0
    try:
        with SlowPeers(port, 70, put_head(100_000), b"x" * 100_000) as peers:
            time.sleep(0.5)
            answered_at_once(server.client)
            assert health(server.client) == {"status": "ok", "in_flight": 0, "waiting": 0}
            wait_for(lambda: peers.closed >= 70, "every slow body cut off", 20)
            answered_at_once(server.client)
    finally:
        server.stop()
    cut = [e for e in _events(server) if e.get("operation") == "put"]
    assert cut and {(e["status"], e["error_code"]) for e in cut} == {(400, "bad_request")}


@pytest.mark.slow
def test_slow_heads_and_idle_connections_cannot_stop_a_fresh_request(
    tmp_path: pathlib.Path, credentials: str
) -> None:
    """300 idle connections and 300 sending a request head a byte every half second, opened
    again as soon as the server closes them, against a server allowed 256 open files: a fresh
    request is still answered at once, each time, and the server never runs out of files. A
    head must arrive within `--read-timeout`, and when connections run short the one that has
    waited longest for its head or body is closed to make room."""

    def few_files() -> None:  # soft and hard: the server raises its soft limit to the hard
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    arguments = ["--sqlite", str(tmp_path / "team.sqlite3")]
    server = Server(arguments, credentials, "--read-timeout", "2", preexec_fn=few_files)
    port = urlsplit(server.url).port or 0
    slow_head = b"GET /v1/session HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"s" * 10_000
    try:
        with SlowPeers(port, 300) as idle, SlowPeers(port, 300, b"", slow_head) as slow:
            for _ in range(3):
                answered_at_once(server.client)
                time.sleep(1)
            wait_for(lambda: min(idle.closed, slow.closed) >= 100, "peers closed", 30)
            answered_at_once(server.client)
    finally:
        server.stop()
    assert all(line.startswith("{") for line in server.lines)  # never out of files


@pytest.mark.slow
def test_logs_are_structured_and_hold_no_token_or_content(start: Callable[..., Server]) -> None:
    server = start()
    client = server.client
    secret_words = "zebracorn-marker-in-content"
    record = client.put(f"note about {secret_words}")
    client.ok("/v1/memories/scan", {"query": "zebracorn-query-marker", "limit": 5})
    client.call("/v1/memories/put", {"content": "password = hunter2hunter2"})
    client.call("/v1/session", method="GET", token="wrong-token-zebracorn")
    client.ok("/v1/memories/read", {"keys": [record["key"]]})
    assert server.stop() == -signal.SIGTERM  # uvicorn re-raises the signal once it has stopped
    events = [json.loads(line) for line in server.lines]
    assert events[-1] == {"event": "stopped"}
    operations = [
        (e["operation"], e["status"], e.get("error_code"))
        for e in events
        if e["event"] == "operation"
    ]
    assert operations == [
        ("put", 200, None), ("scan", 200, None), ("put", 400, "bad_request"),
        ("session", 401, "unauthorized"), ("read", 200, None),
    ]  # fmt: skip
    text = "".join(server.lines)
    for leak in ("zebracorn", "hunter2", ALICE, READER, "password"):
        assert leak not in text


@pytest.mark.slow
def test_an_internal_error_logs_its_type_and_never_its_message(
    backend: list[str], start: Callable[..., Server]
) -> None:
    """An operator who drops a table under a running server gets 500 `internal`, and the log
    names what failed (the error's class and the one it came from) without its message."""
    server = start()
    server.client.put("written before the table went")
    outside(backend, ("DROP TABLE memories", []))
    answer = server.client.call("/v1/memories/put", {"content": "zebracorn after the drop"})
    assert_error(answer, 500, "internal")
    server.stop()
    failed = [
        event
        for event in map(json.loads, server.lines)
        if event.get("event") == "operation" and event["status"] == 500
    ]
    cause = "OperationalError" if backend[0] == "--sqlite" else "UndefinedTable"
    assert [(e["operation"], e["error_type"], e["error_cause"]) for e in failed] == [
        ("put", "StorageError", cause)
    ]
    text = "".join(server.lines)
    for leak in ("zebracorn", "memories", "does not exist", "no such table", "Traceback"):
        assert leak not in text


@pytest.mark.slow
def test_a_body_cut_short_is_a_logged_bad_request_not_a_traceback(
    start: Callable[..., Server],
) -> None:
    server = start()
    port = urlsplit(server.url).port
    head = (
        f"POST /v1/memories/put HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ALICE}\r\n"
        "x-tact-memory-namespace: alice\r\nContent-Type: application/json\r\n"
        "Content-Length: 100\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", port or 0)) as connection:
        connection.sendall(head.encode() + b'{"content": "zebracorn cut')
    wait_for(lambda: any('"operation":"put"' in line for line in server.lines), "the put's log")
    assert server.client.put("the server still answers")["key"]["id"] == 1
    server.stop()
    events = _events(server)
    assert [(e["operation"], e["status"]) for e in events if e["event"] == "operation"] == [
        ("put", 400), ("put", 200),
    ]  # fmt: skip
    assert "zebracorn" not in "".join(server.lines)


@pytest.mark.slow
def test_uvicorns_own_records_are_json_lines_too(start: Callable[..., Server]) -> None:
    """A request that is not HTTP makes uvicorn log a warning: it is a JSON line like the
    others, the fixed message only, never what the peer sent."""
    server = start()
    with socket.create_connection(("127.0.0.1", urlsplit(server.url).port or 0)) as peer:
        peer.sendall(b"NOT HTTP zebracorn\r\n\r\n")
        assert peer.recv(100).startswith(b"HTTP/1.1 400 ")
    wait_for(lambda: any("server_log" in line for line in server.lines), "uvicorn's warning")
    server.stop()
    assert {
        "event": "server_log",
        "logger": "uvicorn.error",
        "level": "WARNING",
        "message": "Invalid HTTP request received.",
        "error_type": None,
    } in _events(server)
    assert "zebracorn" not in "".join(server.lines)  # fmt: skip


@pytest.mark.slow
def test_hostile_rows_are_hidden_not_a_500(
    backend: list[str], start: Callable[..., Server]
) -> None:
    """Rows no server wrote, from a foreign writer with the database's own rights: namespaces
    no credential can name (not ASCII, too long), text that is not UTF-8 (SQLite), content a
    put would refuse, an allocator at its end. Every route still answers, hiding them."""
    client = start().client
    kept = client.put("kept note beside hostile rows")
    long_name, rows = "n" * 200, [("\u00e9", "note from a namespace with an accent")]
    rows += [(long_name, "note from a namespace too long"), ("bob", "   ")]
    rows += [("bob", "password = hunter2hunter2"), ("bob", "note " + "x" * 1100)]
    insert = (
        "INSERT INTO memories (namespace, id, version, content, identity, created_at_ms,"
        " updated_at_ms) VALUES (?, ?, 1, ?, ?, 1, 1)"
    )
    statements: list[tuple[str, list[object]]] = [
        ("INSERT INTO memory_namespaces (namespace) VALUES (?) ON CONFLICT DO NOTHING", [ns])
        for ns in ("\u00e9", long_name, "bob", "zz")
    ]
    statements += [(insert, [ns, n, text, f"i{n}"]) for n, (ns, text) in enumerate(rows, 1)]
    if backend[0] == "--sqlite":
        statements.append(
            ("INSERT INTO memories (namespace, id, version, content, identity, created_at_ms,"
             " updated_at_ms) VALUES ('zz', 1, 1, CAST(x'ff6e6f7465' AS TEXT), 'z', 1, 1)", [])
        )  # fmt: skip
    statements.append(
        ("UPDATE memories SET created_at_ms = updated_at_ms + 1 WHERE namespace = 'alice'", [])
    )
    statements.append(("UPDATE memory_namespaces SET changes = changes + 1", []))
    statements.append(
        ("UPDATE memory_namespaces SET next_id = ? WHERE namespace = 'bob'", [2**63 - 1])
    )
    outside(backend, *statements)
    bodies = {"list": None, "read": {"keys": [kept["key"]]}, "export": {"limit": 5}}
    for route, body in bodies.items():  # created after updated: the client would refuse it
        assert client.ok(f"/v1/memories/{route}", body)["memories"] == [], route
    outside(
        backend,
        ("UPDATE memories SET created_at_ms = updated_at_ms WHERE namespace = 'alice'", []),
        ("UPDATE memory_namespaces SET changes = ? WHERE namespace = 'alice'", [2**63 - 1]),
    )
    second = client.put("second kept note")  # the change counter wraps, not a failed write
    scan = client.ok("/v1/memories/scan", {"query": "note kept", "limit": 5})["candidates"]
    assert sorted(c["key"]["id"] for c in scan) == [1, 2] and {
        c["key"]["namespace"] for c in scan
    } == {"alice"}
    shown = [key_of(kept), key_of(second)]
    assert [key_of(r) for r in client.ok("/v1/memories/list")["memories"]] == shown
    assert [key_of(r) for r in client.export()] == shown
    assert [key_of(r) for r in client.export(limit=1)] == shown
    keys = [{"id": n, "version": 1, "namespace": "bob"} for n in (3, 4, 5)]
    assert client.ok("/v1/memories/read", {"keys": keys})["memories"] == []
    answer = client.call("/v1/memories/put", {"content": "bob has no id left"}, namespace="bob")
    assert_error(answer, 507, "content_capacity")


@pytest.mark.slow
def test_scan_offers_only_what_read_returns(
    backend: list[str], start: Callable[..., Server]
) -> None:
    """Rows a foreign writer left that read, list and export hide (NUL in the text, which only
    SQLite can hold; blank, secret-shaped or oversized content; times the client refuses; a
    namespace no credential names) are never a scan's card either, on /v1 and at /mcp."""
    server = start()
    shown = server.client.put("zebracorn note anyone may read")
    rows = [("bob", "   \u3000 "), ("bob", "zebracorn password = hunter2hunter2")]
    rows += [("bob", "zebracorn " + "x" * 1100), ("\u00e9", "zebracorn in no namespace")]
    rows += [("bob", "zebracorn created after it was updated")]
    if backend[0] == "--sqlite":  # PostgreSQL text cannot hold U+0000 at all
        rows.append(("bob", "zebracorn nul \0 inside"))
    statements: list[tuple[str, list[object]]] = [
        ("INSERT INTO memory_namespaces (namespace) VALUES (?) ON CONFLICT DO NOTHING", [ns])
        for ns in ("bob", "\u00e9")
    ]
    insert = (
        "INSERT INTO memories (namespace, id, version, content, identity, created_at_ms,"
        " updated_at_ms) VALUES (?, ?, 1, ?, ?, ?, 5)"
    )
    statements += [
        (insert, [ns, n, text, f"i{n}", 6 if "after" in text else 0])
        for n, (ns, text) in enumerate(rows, 1)
    ]
    outside(backend, *statements)
    keys = [{"id": n, "version": 1, "namespace": ns} for n, (ns, _) in enumerate(rows, 1)]
    keys = [key for key in keys if key["namespace"] == "bob"]  # a read cannot name the other
    client = server.client
    assert client.ok("/v1/memories/read", {"keys": keys}, namespace="reader")["memories"] == []
    for query in ("zebracorn", "zebracorn nul inside", "zebracorn created updated"):
        cards = client.ok("/v1/memories/scan", {"query": query, "limit": 5})["candidates"]
        assert [card["key"] for card in cards] == [shown["key"]], query
    _, (scan,) = mcp_calls(server.url, BOB, [{"operation": "scan", "query": "zebracorn nul"}])
    assert [card["key"] for card in scan["candidates"]] == [shown["key"]]


@pytest.mark.slow
def test_what_is_gone_leaves_no_copy_in_the_sqlite_files(
    tmp_path: pathlib.Path, credentials: str
) -> None:
    """Deleted, replaced, synced-away and pruned content is in neither the main file nor its
    -wal (nor a journal) once the operation is acknowledged: secure_delete zeroes it in the
    pages, and no older copy of a page is kept beside them."""
    server = Server(["--sqlite", str(tmp_path / "team.sqlite3")], credentials)
    client = server.client

    def on_disk(marker: str) -> bool:
        files = [path.read_bytes() for path in tmp_path.glob("team.sqlite3*")]
        return any(marker.encode() in data for data in files)

    try:
        deleted = client.put("zebracorn-deleted note")
        assert on_disk("zebracorn-deleted")  # while a record lives, its text is on disk
        assert client.call("/v1/memories/delete", {"key": deleted["key"]}) == (200, b"{}")
        assert not on_disk("zebracorn-deleted")
        replaced = client.put("zebracorn-replaced note")
        client.put("its successor, in other words", replacement=replaced["key"])
        assert not on_disk("zebracorn-replaced") and on_disk("its successor")
        synced = [snapshot_record(7, 1, "zebracorn-synced note")]
        client.ok("/v1/memories/sync", {"memories": synced}, namespace="bob")
        client.ok("/v1/memories/sync", {"memories": []}, namespace="bob")
        assert not on_disk("zebracorn-synced")
        expired = {**snapshot_record(8, 1, "zebracorn-pruned note"), "probation_until_ms": 1}
        client.ok("/v1/memories/sync", {"memories": [expired]}, namespace="bob")
        client.ok("/v1/memories/list")  # any operation but a delete prunes, in every namespace
        assert not on_disk("zebracorn-pruned")
    finally:
        server.stop()


@pytest.mark.slow
def test_graceful_shutdown_finishes_requests_in_flight(
    backend: list[str], start: Callable[..., Server]
) -> None:
    server = start()
    with ThreadPoolExecutor(1) as pool, store_locked(backend):
        answer = pool.submit(server.client.put, "written during shutdown")
        wait_for(lambda: health(server.client)["in_flight"] == 1, "the put in flight")
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert server.process.poll() is None  # still finishing the put
    assert answer.result()["key"]["id"] == 1
    assert server.process.wait(30) == -signal.SIGTERM
    assert json.loads(server.lines[-1]) == {"event": "stopped"}
    assert [key_of(r) for r in start().client.export()] == [("alice", 1, 1)]


def test_help_and_startup_errors(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shown = subprocess.run([*SERVER, "--help"], capture_output=True, text=True, check=True).stdout
    for option in (
        "--sqlite",
        "--postgres",
        "--credentials",
        "--host",
        "--port",
        "--store-timeout",
    ):
        assert option in shown
    good = 'namespace = "alice"\nrole = "writer"\ntoken = "tok-000000000000000001"\n'
    cases = {
        "repeated token": f"[[credentials]]\n{good}[[credentials]]\n{good.replace('alice', 'bob')}",
        "no credentials": "",
        "empty list": "credentials = []\n",
        "bad role": f"[[credentials]]\n{good.replace('writer', 'admin')}",
        "bad namespace": f"[[credentials]]\n{good.replace('alice', 'a/b')}",
        "bad token": f"[[credentials]]\n{good.replace('tok-', 'tok ')}",
        "unknown key": f"[[credentials]]\n{good}comment = 1\n",
        "not toml": "[[credentials]\ntoken = tok-000000000000000001",
    }
    database = str(tmp_path / "x.sqlite3")
    for name, text in cases.items():
        path = tmp_path / f"{name}.toml"
        path.write_text(text)
        path.chmod(0o600)
        assert tactmem_server.main(["--sqlite", database, "--credentials", str(path)]) == 2, name
        stderr = capsys.readouterr().err
        assert stderr.startswith("tactmem-server: ") and "Traceback" not in stderr, name
        assert "tok-000000000000000001" not in stderr and "tok 000" not in stderr, name
    path = tmp_path / "open.toml"
    path.write_text(f"[[credentials]]\n{good}")
    path.chmod(0o644)
    assert tactmem_server.main(["--sqlite", database, "--credentials", str(path)]) == 2
    assert "0600" in capsys.readouterr().err
    path.chmod(0o600)
    unreachable = "host=/nonexistent-socket-dir dbname=x password=pw-zebra"
    assert tactmem_server.main(["--postgres", unreachable, "--credentials", str(path)]) == 2
    stderr = capsys.readouterr().err
    assert "could not connect to PostgreSQL" in stderr and "pw-zebra" not in stderr


BAD_OPTIONS = [
    ("--store-timeout", "nan"), ("--store-timeout", "inf"), ("--store-timeout", "-inf"),
    ("--store-timeout", "0"), ("--store-timeout", "-1"), ("--store-timeout", "1e300"),
    ("--store-timeout", "soon"), ("--port", "99999"), ("--port", "65536"), ("--port", "-1"),
    ("--port", "http"), ("--pool-size", "0"), ("--pool-size", "-2"), ("--pool-size", "1.5"),
    ("--read-timeout", "0"), ("--read-timeout", "nan"), ("--read-timeout", "soon"),
]  # fmt: skip


@pytest.mark.parametrize(("option", "value"), BAD_OPTIONS)
@pytest.mark.slow
def test_bad_options_are_one_line_usage_errors(
    tmp_path: pathlib.Path, credentials: str, option: str, value: str
) -> None:
    database = tmp_path / "never.sqlite3"
    run = subprocess.run(
        [*SERVER, "--sqlite", str(database), "--credentials", credentials, option, value],
        capture_output=True, text=True, timeout=20,
    )  # fmt: skip
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.startswith("usage: tactmem-server ")
    last = run.stderr.splitlines()[-1]
    assert last.startswith(f"tactmem-server: error: argument {option}: expected "), last
    assert not database.exists()


def _hostile_file(tmp_path: pathlib.Path, kind: str) -> str:
    """A path that is no usable start-up file: each kind a way a file can be wrong."""
    path = tmp_path / kind.replace(" ", "-")
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link to a fifo":
        os.mkfifo(tmp_path / "target-fifo")
        path.symlink_to(tmp_path / "target-fifo")
    elif kind == "directory":
        path.mkdir()
    elif kind == "socket":
        with socket.socket(socket.AF_UNIX) as bound:
            bound.bind(str(path))
    elif kind == "symlink loop":
        path.symlink_to(tmp_path / "loop-back")
        (tmp_path / "loop-back").symlink_to(path)
    elif kind == "/dev/zero":
        return "/dev/zero"
    else:
        texts = {
            "not UTF-8": b"\xff\xfe[[credentials]]\n",
            "deep arrays": b"a = " + b"[" * 100_000 + b"]" * 100_000 + b"\n",
            "deep tables": b"a = " + b"{b = " * 5_000 + b"1" + b"}" * 5_000 + b"\n",
            "huge": b"",
        }
        path.write_bytes(texts[kind])
        if kind == "huge":
            os.truncate(path, 10 * 2**30)  # sparse: 10 GiB of zeros
        path.chmod(0o600)
    return str(path)


HOSTILE_FILES = [
    "fifo", "link to a fifo", "directory", "socket", "symlink loop", "/dev/zero", "not UTF-8",
    "deep arrays", "deep tables", "huge",
]  # fmt: skip
ODD_VALUES: list[tuple[str, bytes]] = [
    ("--host", b"\xff"), ("--host", b"local\nhost"), ("--host", b"999.1.1.1"),
    ("--host", b"[::1]"), ("--host", b"h" * 300),
    ("--postgres", b"\xff"), ("--postgres", b"postgresql://%ff@/x?host=/nonexistent"),
    ("--postgres", b"host=" + b"a" * 3000), ("--postgres", b"postgresql://["),
    ("--postgres", b"host=/nonexistent dbname=\xff"),
]  # fmt: skip


def _start_refused(arguments: list[str | bytes], saying: str = "") -> str | None:
    """Start a real server that must refuse at once: one line on stderr (`saying` this), exit
    status 2, no traceback (a hang fails by the timeout rather than holding the suite). What
    went wrong, if anything."""
    try:
        run = subprocess.run([*SERVER, *arguments], capture_output=True, timeout=20)
    except subprocess.TimeoutExpired:
        return f"{arguments}: no answer in 20 s"
    stderr = run.stderr.decode("utf-8", "replace")
    one_line = stderr.startswith("tactmem-server: ") and stderr.count("\n") == 1
    if run.returncode != 2 or not one_line or "Traceback" in stderr or run.stdout:
        return f"{arguments}: exit {run.returncode}, {stderr[-300:]!r}"
    return None if saying in stderr else f"{arguments}: {stderr!r}"


@pytest.mark.slow
def test_every_start_up_input_is_one_line_and_exit_2(
    tmp_path: pathlib.Path, credentials: str
) -> None:
    """Whatever the credentials file or the SQLite file is (a FIFO, a directory, a device, a
    socket, a symlink loop, huge, not UTF-8, nested without end), and whatever odd --host or
    --postgres is given, start-up ends at once with one line and exit status 2."""
    database = str(tmp_path / "team.sqlite3")
    runs: list[list[str | bytes]] = []
    for number, kind in enumerate(HOSTILE_FILES):
        place = tmp_path / f"c{number}"
        place.mkdir()
        runs.append(["--sqlite", database, "--credentials", _hostile_file(place, kind)])
        place = tmp_path / f"s{number}"
        place.mkdir()
        runs.append(["--sqlite", _hostile_file(place, kind), "--credentials", credentials])
    for option, value in ODD_VALUES:
        storage = [] if option == "--postgres" else ["--sqlite", database]
        runs.append([*storage, option, value, "--credentials", credentials, "--port", "0"])
    with ThreadPoolExecutor(4) as pool:
        failures = [failed for failed in pool.map(_start_refused, runs) if failed]
    assert not failures, "\n".join(failures)
    for number, kind in enumerate(HOSTILE_FILES):  # a refused SQLite file gets no sidecars
        left = set(os.listdir(tmp_path / f"s{number}"))
        assert left <= {kind.replace(" ", "-"), "target-fifo", "loop-back"}, kind


def test_the_peer_bounds_by_default() -> None:
    """The production bounds the slow-peer tests run smaller: 10 s for a head and then for a
    body, and connections and the accept backlog sized to the files the process may open."""
    defaults = tactmem_server._parser().parse_args(["--sqlite", "x", "--credentials", "y"])
    assert defaults.read_timeout == 10 and defaults.store_timeout == 30
    bounds = {files: tactmem_server._bounds_for(files, 64) for files in (100, 256, 1024, 1 << 20)}
    assert bounds == {100: (16, 4), 256: (32, 128), 1024: (128, 704), 1 << 20: (2048, 1024)}


def _events(server: Server) -> list[dict[str, Any]]:
    return [json.loads(line) for line in server.lines]


@pytest.mark.slow
def test_listening_beyond_loopback_warns_that_tokens_travel_in_clear(
    tmp_path: pathlib.Path, credentials: str
) -> None:
    exposed = Server(["--sqlite", str(tmp_path / "team.sqlite3")], credentials, "--host", "0.0.0.0")
    try:
        port = urlsplit(exposed.url).port
        assert exposed.url == f"http://0.0.0.0:{port}"
        local = Client(f"http://127.0.0.1:{port}")  # traffic only to this machine
        assert local.ok("/v1/session", method="GET")["namespace"] == "alice"
    finally:
        exposed.stop()
    events = _events(exposed)
    assert [e["event"] for e in events[:2]] == ["warning", "listening"]
    assert [e for e in events if e["event"] == "warning"] == [events[0]]
    message = events[0]["message"]
    for words in ("0.0.0.0", "beyond this machine", "bearer tokens", "in clear", "TLS"):
        assert words in message, message
    loopback = Server(["--sqlite", str(tmp_path / "team.sqlite3")], credentials)
    loopback.client.ok("/v1/session", method="GET")
    loopback.stop()
    assert [e["event"] for e in _events(loopback)] == ["listening", "operation", "stopped"]


@pytest.mark.slow
def test_a_tactmem_store_file_is_not_a_team_database(
    tmp_path: pathlib.Path, credentials: str
) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("not a database at all, some zebracorn words\n" * 200)
    run = subprocess.run(
        [*SERVER, "--sqlite", str(text), "--credentials", credentials],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert run.stderr.startswith("tactmem-server: memory database file is not a SQLite database")
    path = tmp_path / "memory.sqlite3"
    with tactmem.Store(path) as store:
        store.put("a local conclusion")
    run = subprocess.run(
        [*SERVER, "--sqlite", str(path), "--credentials", credentials],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 2 and "not a tactmem-server database" in run.stderr


def _server_file(path: pathlib.Path) -> None:
    """A SQLite file as tactmem-server leaves it: its tables and one record."""
    store = tactmem_server.TeamStore(tactmem_server.SqliteEngine(str(path)))
    put = tactmem.core.check_put(
        "a record the server wrote", None, tactmem.Limits(), tactmem.core.now_ms()
    )
    store.put("alice", put, time.monotonic() + 30)
    store.close()


def _run_sql(path: pathlib.Path, *statements: str) -> None:
    with contextlib.closing(sqlite3.connect(path)) as connection, connection:
        for statement in statements:
            connection.execute(statement)


_LOOSE_MEMORIES = tactmem_server._SCHEMA[1].format(ns="TEXT", int="INTEGER", strict="")
SQLITE_PLANTED = {  # what a foreign writer adds to a file the server made
    "trigger": "CREATE TRIGGER lose AFTER INSERT ON memories BEGIN"
    " DELETE FROM memories WHERE namespace = NEW.namespace AND id = NEW.id; END",
    "view": "CREATE VIEW everything AS SELECT * FROM memories",
    "index": "CREATE INDEX by_content ON memories (content)",
    "table": "CREATE TABLE app_users (id INTEGER PRIMARY KEY, email TEXT)",
    "user version": "PRAGMA user_version = 3",
    "memories of another definition": f"DROP TABLE memories; {_LOOSE_MEMORIES}",
}


def _foreign_sqlite_file(path: pathlib.Path, kind: str) -> None:
    if kind in SQLITE_PLANTED:
        _server_file(path)
        with contextlib.closing(sqlite3.connect(path)) as connection:
            connection.executescript(SQLITE_PLANTED[kind])
    elif kind == "another application":
        _run_sql(path, "CREATE TABLE accounts (id INTEGER PRIMARY KEY, email TEXT)")
    elif kind == "a local tactmem store":
        with tactmem.Store(path) as store:
            store.put("a local conclusion")
    else:  # the server's own tables, in a file whose text is UTF-16
        with contextlib.closing(sqlite3.connect(path)) as connection:
            connection.execute("PRAGMA encoding = 'UTF-16le'")
            for statement in tactmem_server._SCHEMA:
                connection.execute(statement.format(ns="TEXT", int="INTEGER", strict=" STRICT"))


def _files_of(directory: pathlib.Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def _refused_untouched(arguments: list[str], watched: Callable[[], object]) -> str | None:
    """Start a real server on a database it must refuse; what went wrong, if anything: it
    must say so in one line and exit 2, and leave what `watched` sees (every file of the
    database's directory, or a dump of the PostgreSQL database) as it was."""
    before = watched()
    failed = _start_refused([*arguments, "--port", "0"], "not a tactmem-server database")
    if watched() != before:
        failed = f"{arguments}: the refused database changed ({failed})"
    return failed


@pytest.mark.slow
def test_a_sqlite_file_the_server_did_not_create_is_refused_untouched(
    tmp_path: pathlib.Path, credentials: str
) -> None:
    """The local store's rules, before anything writes: a file holding a trigger (one that
    deletes every row the server inserts), a view, an index or a table the server did not
    create, a `memories` table of another definition, another user_version, UTF-16 text,
    another application's tables or a local tactmem store is refused, byte for byte as it
    was, and no -wal or -shm file appears beside it."""
    kinds = [*SQLITE_PLANTED, "another application", "a local tactmem store", "UTF-16 text"]

    def refused(number: int) -> str | None:
        directory = tmp_path / f"f{number}"
        directory.mkdir()
        _foreign_sqlite_file(directory / "team.sqlite3", kinds[number])
        arguments = ["--sqlite", str(directory / "team.sqlite3"), "--credentials", credentials]
        return _refused_untouched(arguments, lambda: _files_of(directory))

    with ThreadPoolExecutor(4) as pool:
        failures = [failed for failed in pool.map(refused, range(len(kinds))) if failed]
    assert not failures, "\n".join(failures)
    ours = tmp_path / "ours"
    ours.mkdir()
    _server_file(ours / "team.sqlite3")
    _run_sql(ours / "team.sqlite3", "ANALYZE")  # an operator's statistics are welcome
    server = Server(["--sqlite", str(ours / "team.sqlite3")], credentials)
    try:
        assert [r["content"] for r in server.client.export()] == ["a record the server wrote"]
    finally:
        server.stop()


_ELSEWHERE = "CREATE SCHEMA elsewhere"
_LOSE = (
    "CREATE FUNCTION elsewhere.lose() RETURNS trigger LANGUAGE plpgsql AS"
    " 'BEGIN DELETE FROM memories WHERE namespace = NEW.namespace AND id = NEW.id; RETURN NULL;"
    " END'"
)
POSTGRES_PLANTED: dict[str, list[str]] = {  # what another application adds beside the tables
    "a table": ["CREATE TABLE notes (id bigint PRIMARY KEY, body text)"],
    "a view": ["CREATE VIEW everything AS SELECT * FROM memories"],
    "a materialized view": ["CREATE MATERIALIZED VIEW counted AS SELECT count(*) FROM memories"],
    "a sequence": ["CREATE SEQUENCE tickets"],
    "a function": ["CREATE FUNCTION answer() RETURNS int LANGUAGE sql AS 'SELECT 42'"],
    "a type": ["CREATE TYPE mood AS ENUM ('fine')"],
    "an operator": [
        "CREATE FUNCTION text_eq(text, text) RETURNS boolean LANGUAGE sql AS 'SELECT true'",
        "CREATE OPERATOR === (LEFTARG = text, RIGHTARG = text, FUNCTION = text_eq)",
    ],
    "a trigger": [
        _ELSEWHERE, _LOSE,
        "CREATE TRIGGER lose AFTER INSERT ON memories FOR EACH ROW"
        " EXECUTE FUNCTION elsewhere.lose()",
    ],
    "a rule": ["CREATE RULE lose AS ON INSERT TO memories DO INSTEAD NOTHING"],
    "a policy": [
        "ALTER TABLE memories ENABLE ROW LEVEL SECURITY",
        "CREATE POLICY hidden ON memories USING (false)",
    ],
    "row security alone": ["ALTER TABLE memories FORCE ROW LEVEL SECURITY"],
    "an index": ["CREATE INDEX by_content ON memories (content)"],
    "a column": ["ALTER TABLE memories ADD COLUMN note text"],
    "a dropped check": ["ALTER TABLE memories DROP CONSTRAINT memories_version_check"],
    "another column type": ["ALTER TABLE memories ALTER COLUMN scan_count TYPE numeric"],
    "another collation": ['ALTER TABLE memories ALTER COLUMN content TYPE text COLLATE "POSIX"'],
    "a child table elsewhere": [_ELSEWHERE, "CREATE TABLE elsewhere.more () INHERITS (memories)"],
    "a foreign key from elsewhere": [
        _ELSEWHERE,
        'CREATE TABLE elsewhere.pins (ns text COLLATE "C", id bigint,'
        " FOREIGN KEY (ns, id) REFERENCES memories (namespace, id))",
    ],
    "an event trigger": [
        _ELSEWHERE,
        "CREATE FUNCTION elsewhere.watch() RETURNS event_trigger LANGUAGE plpgsql AS"
        " 'BEGIN END'",
        "CREATE EVENT TRIGGER watch ON ddl_command_start EXECUTE FUNCTION elsewhere.watch()",
    ],
}  # fmt: skip


def _dump(cluster: Cluster, database: str) -> str:
    """The whole database as pg_dump writes it: schema, data and privileges."""
    pg_dump = _postgres_binary("pg_dump")
    assert pg_dump is not None
    command = [pg_dump, "-h", cluster.socket_dir, "-U", "postgres", "--no-sync", database]
    dump = subprocess.run(command, capture_output=True, text=True, check=True, timeout=60).stdout
    return re.sub(r"(?m)^\\(un)?restrict .*$", "", dump)  # a random key each run


@pytest.mark.slow
def test_a_postgres_database_the_server_did_not_create_is_refused_untouched(
    cluster: Cluster, credentials: str
) -> None:
    """Before it writes anything, the server compares what the schema it uses holds (tables,
    views, sequences, functions, types, operators, indexes, every column and constraint of
    its own tables) and what is attached to its tables from anywhere (triggers, rules,
    policies, row security, inheriting tables, foreign keys), and the database's event
    triggers, with exactly what it creates: another application's database, or the server's
    own with anything added or changed, is refused and left as it was (its dump identical)."""

    def refused(kind: str) -> str | None:
        database = cluster.new_database()
        url = cluster.url(database)
        if kind != "another application":
            tactmem_server.PostgresEngine(url, pool_size=1).close()
        statements = POSTGRES_PLANTED.get(kind, ["CREATE TABLE accounts (id bigint, email text)"])
        outside(["--postgres", url], *[(statement, []) for statement in statements])
        arguments = ["--postgres", url, "--credentials", credentials]
        return _refused_untouched(arguments, lambda: _dump(cluster, database))

    with ThreadPoolExecutor(4) as pool:
        kinds = [*POSTGRES_PLANTED, "another application"]
        failures = [failed for failed in pool.map(refused, kinds) if failed]
    assert not failures, "\n".join(failures)
    import psycopg

    database = cluster.new_database()  # what the server creates is exactly what it accepts
    tactmem_server.PostgresEngine(cluster.url(database), pool_size=1).close()
    with psycopg.connect(cluster.dsn(database)) as connection:
        connection.execute("ANALYZE")  # an operator's statistics are welcome
        found = set(connection.execute(tactmem_server._POSTGRES_CATALOG).fetchall())
    assert found == tactmem_server._POSTGRES_OBJECTS
    server = Server(["--postgres", cluster.url(database)], credentials)
    try:
        assert server.client.put("the server's own database")["key"]["id"] == 1
    finally:
        server.stop()


@pytest.mark.slow
def test_a_trigger_planted_under_a_running_server_loses_nothing(
    backend: list[str], start: Callable[..., Server]
) -> None:
    """A trigger added while the server runs (one that deletes every row the server inserts)
    is found before the next operation writes: every operation is then 500 `internal`,
    logged with its class, nothing acknowledged is lost, and the server serves again once
    the trigger is gone. SQLite checks the whole file whenever its schema changed; PostgreSQL
    checks what runs on its tables (triggers, rules, policies, inheriting tables) in every
    transaction, holding the tables against a change until it commits."""
    server = start()
    client = server.client
    kept = client.put("written before the trigger")
    if backend[0] == "--sqlite":
        plant, remove = [SQLITE_PLANTED["trigger"]], ["DROP TRIGGER lose"]
    else:
        plant, remove = POSTGRES_PLANTED["a trigger"], ["DROP TRIGGER lose ON memories"]
    outside(backend, *[(statement, []) for statement in plant])
    for route, body in (("put", {"content": "never lost in silence"}), ("list", None)):
        assert_error(client.call(f"/v1/memories/{route}", body), 500, "internal")
    outside(backend, *[(statement, []) for statement in remove])
    assert client.export() == [kept]
    assert client.put("written once the trigger is gone")["key"]["id"] == 2
    server.stop()
    failed = [e for e in _events(server) if e.get("status") == 500]
    assert [(e["operation"], e["error_type"]) for e in failed] == [
        ("put", "StorageError"), ("list", "StorageError"),
    ]  # fmt: skip


# ============================================================================ several processes


@pytest.mark.slow
def test_several_servers_keep_bounds_ids_and_versions(start: Callable[..., Server]) -> None:
    """Three server processes on one database, sixteen clients racing puts to the row bound,
    then compare-and-swap replaces and deletes on the same records."""
    clients = [start().client for _ in range(3)]
    acknowledged: dict[int, str] = {}
    refused: list[bytes] = []
    lock = threading.Lock()
    counter = itertools.count()

    def fill(worker: int) -> None:
        client = clients[worker % 3]
        while True:
            content = f"racing note {next(counter)} from worker {worker}"
            status, data = client.call("/v1/memories/put", {"content": content})
            if status != 200:
                refused.append(data)
                return
            record = json.loads(data)["memory"]
            with lock:
                assert record["key"]["id"] not in acknowledged
                acknowledged[record["key"]["id"]] = content

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(fill, range(16)))
    assert refused == [error("record_capacity")] * 16
    assert sorted(acknowledged) == list(range(1, 513))  # no id skipped, none repeated
    exported = clients[0].export(["alice"])
    assert {r["key"]["id"]: r["content"] for r in exported} == acknowledged

    targets = [r["key"] for r in exported[:8]]
    wins: dict[int, list[tuple[int, str]]] = {key["id"]: [] for key in targets}

    def race(worker: int) -> None:
        client = clients[worker % 3]
        for round_number in range(6):
            for key in targets:
                (current,) = client.ok("/v1/memories/read", {"ids": [key["id"]]})["memories"] or [
                    None
                ]
                if current is None:
                    continue
                content = f"replaced {key['id']} by {worker} in round {round_number}"
                body = {"content": content, "replacement": current["key"]}
                status, data = client.call("/v1/memories/put", body)
                assert status in (200, 409), (status, data)
                if status == 200:
                    new = json.loads(data)["memory"]["key"]
                    assert new["version"] == current["key"]["version"] + 1
                    with lock:
                        wins[key["id"]].append((new["version"], content))
                else:
                    assert data == error("conflict")

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(race, range(8)))
    final = {r["key"]["id"]: r for r in clients[1].export(["alice"])}
    for doc_id, won in wins.items():
        versions = sorted(version for version, _ in won)
        assert versions == list(range(2, 2 + len(won)))  # each version won exactly once
        assert final[doc_id]["key"]["version"] == 1 + len(won)
        assert final[doc_id]["content"] == max(won)[1]  # the last acknowledged write is kept

    def delete_race(worker: int) -> int:
        client = clients[worker % 3]
        key = {**final[targets[0]["id"]]["key"]}
        status, data = client.call("/v1/memories/delete", {"key": key})
        assert status == 200 and data == b"{}"
        return status

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(delete_race, range(8))) == [200] * 8
    assert len(clients[2].export(["alice"])) == 511
    assert clients[2].put("the row freed by the delete")["key"]["id"] == 513  # never reused


def test_racing_writers_never_break_the_content_bound(start: Callable[..., Server]) -> None:
    """Three servers, eight clients inserting 1,000-byte records into a namespace 6,144 bytes
    short of its content bound: exactly six fit, whichever server takes them."""
    clients = [start().client for _ in range(3)]
    full = [snapshot_record(n, 1, f"{n:04}" + "f" * 1020) for n in range(1, 251)]
    assert (
        clients[0].ok("/v1/memories/sync", {"memories": full}, namespace="bob")["inserted"] == 250
    )
    counter = itertools.count()
    answers: list[tuple[int, bytes]] = []

    def insert(worker: int) -> None:
        for _ in range(4):
            content = f"{next(counter):04}" + "g" * 996
            answers.append(
                clients[worker % 3].call("/v1/memories/put", {"content": content}, namespace="bob")
            )

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(insert, range(8)))
    assert sorted(status for status, _ in answers) == [200] * 6 + [507] * 26
    assert {data for status, data in answers if status == 507} == {error("content_capacity")}
    stored = clients[1].export(["bob"])
    assert sum(len(r["content"].encode()) for r in stored) == 250 * 1024 + 6 * 1000
    assert [r["key"]["id"] for r in stored] == list(range(1, 257))


@pytest.mark.slow
def test_a_server_killed_mid_write_leaves_nothing_partial(start: Callable[..., Server]) -> None:
    """SIGKILL a server while it applies 512-record snapshots and puts; the survivor sees each
    namespace as one whole snapshot (or one whole put), never a part."""
    victim, survivor = start(), start()
    snapshots = [
        [snapshot_record(n, 1, f"snapshot {letter} record {n}") for n in range(1, 513)]
        for letter in "ab"
    ]
    stop = threading.Event()
    cut: list[int] = []

    def write(worker: int) -> None:
        for round_number in itertools.count():
            if stop.is_set():
                return
            try:
                if worker % 2:
                    victim.client.call(
                        "/v1/memories/sync", {"memories": snapshots[round_number % 2]}
                    )
                else:
                    victim.client.call(
                        "/v1/memories/put",
                        {"content": f"put {worker} {round_number}"},
                        namespace="bob",
                    )
            except (OSError, http.client.HTTPException):
                cut.append(worker)  # a request the kill cut off

    with ThreadPoolExecutor(8) as pool:
        writers = [pool.submit(write, worker) for worker in range(8)]
        time.sleep(1.5)
        victim.stop(signal.SIGKILL)
        stop.set()
        for writer in writers:
            writer.result()
    assert cut, "no request was in flight when the server was killed"
    served = [json.loads(line) for line in victim.lines]
    assert any(e.get("operation") == "sync" and e["status"] == 200 for e in served)
    alice = [r["content"] for r in survivor.client.export(["alice"])]
    assert alice in ([], [r["content"] for r in snapshots[0]], [r["content"] for r in snapshots[1]])
    bob = survivor.client.export(["bob"])
    assert [r["key"]["id"] for r in bob] == list(range(1, len(bob) + 1))
    assert all(r["content"].startswith("put ") for r in bob)
    survivor.client.put("the database still takes writes", namespace="bob")


# ============================================================================ in process


class CountingEngine:
    """A real SQLite engine that records the statements it runs (a spy, not a stand-in)."""

    def __init__(self, path: str) -> None:
        self.engine = tactmem_server.SqliteEngine(path)
        self.bytes_sql, self.lock_sql = self.engine.bytes_sql, self.engine.lock_sql
        self.statements: list[tuple[str, tuple[object, ...]]] = []

    @contextlib.contextmanager
    def transaction(self, deadline: float) -> Iterator[Any]:
        engine = self
        with self.engine.transaction(deadline) as tx:

            class Recording:
                def rows(self, sql: str, params: Any = ()) -> list[tuple[Any, ...]]:
                    engine.statements.append((sql, tuple(params)))
                    return tx.rows(sql, params)

                def run(self, sql: str, params: Any = ()) -> None:
                    engine.statements.append((sql, tuple(params)))
                    tx.run(sql, params)

                def many(self, sql: str, params: Any) -> None:
                    tx.many(sql, params)

                def batch(self, statements: Any) -> list[list[tuple[Any, ...]]]:
                    engine.statements.extend((sql, tuple(params)) for sql, params in statements)
                    return tx.batch(statements)

            yield Recording()

    def check(self, deadline: float) -> None:
        self.engine.check(deadline)

    def close(self) -> None:
        self.engine.close()


def test_token_statistics_are_refreshed_only_for_changed_namespaces(
    tmp_path: pathlib.Path,
) -> None:
    engine = CountingEngine(str(tmp_path / "team.sqlite3"))
    store = tactmem_server.TeamStore(engine)
    far, now, limits = time.monotonic() + 30, tactmem.core.now_ms(), tactmem.Limits()
    for namespace in ("alice", "bob", "carol"):
        for n in range(3):
            store.put(
                namespace,
                tactmem.core.check_put(f"{namespace} deploy note {n}", None, limits, now),
                far,
            )

    def fetched() -> list[object]:
        found = [
            p
            for sql, p in engine.statements
            if sql.startswith("SELECT namespace, id, version, content")
        ]
        engine.statements.clear()
        return [params[0] for params in found]

    terms = tactmem.core.query_terms("deploy note")
    engine.statements.clear()
    first = store.scan(terms, 5, now, far)
    assert fetched() == ["alice", "bob", "carol"] and len(first) == 5
    assert store.scan(terms, 5, now, far) == first
    assert fetched() == []  # nothing changed: nothing fetched again
    store.put("bob", tactmem.core.check_put("bob deploy note again", None, limits, now), far)
    engine.statements.clear()
    store.scan(terms, 5, now, far)
    assert fetched() == ["bob"]
    store.close()


def database_rows(backend: list[str]) -> dict[tuple[str, int], tactmem.Record]:
    """Every row of the server's database, read from outside, by (namespace, id)."""
    kind, target = backend
    sql = f"SELECT {tactmem_server._COLUMNS} FROM memories"
    if kind == "--sqlite":
        with contextlib.closing(sqlite3.connect(target)) as connection:
            rows = connection.execute(sql).fetchall()
    else:
        import psycopg

        with psycopg.connect(target) as postgres:
            rows = postgres.execute(sql).fetchall()
    return {(row[0], row[1]): tactmem.Record.from_row(row[1:]) for row in rows}


@pytest.mark.parametrize("seed", range(40))
def test_the_array_corpus_ranks_as_the_core_does(seed: int) -> None:
    """`_ArrayCorpus`, under random inserts, replaces, deletes and hidden rows with the server's
    ids, one or several in a patch: every rank equals the core's `Corpus.rank` over the same
    rows (ids, order, ties by id, scores to the bit, any limit), and so does every card's
    coverage."""
    rng = random.Random(seed)
    arrays, core = tactmem_server._ArrayCorpus(), tactmem.core.Corpus()
    rows: dict[int, tuple[int, int, object]] = {}
    words = [*_WORDS, "deploys", "x", "y"]
    for _ in range(60):
        gone: list[int] = []
        changed: list[tuple[int, int, object]] = []
        for _ in range(rng.choice([1, 1, 2, 6])):  # one change, or several in one patch
            doc_id = tactmem_server._doc_id(rng.choice(["a", "b", "team-z"]), rng.randrange(1, 12))
            text = " ".join(rng.choices(words, k=rng.randrange(0, 9)))
            if doc_id in gone or doc_id in [row[0] for row in changed]:
                continue
            if doc_id in rows and rng.random() < 0.3:
                gone.append(doc_id)
                del rows[doc_id]
            else:
                version = rows[doc_id][1] + 1 if doc_id in rows else 1
                rows[doc_id] = (doc_id, version, None if rng.random() < 0.1 else text)
                changed.append(rows[doc_id])
        if rng.random() < 0.2:  # a whole namespace again, most rows unchanged
            changed = list(rows.values())
        for corpus in (arrays, core):
            corpus.patch(changed, gone)
        for _ in range(3):
            terms = tactmem.core.query_terms(" ".join(rng.sample([*words, "absent"], 3)))
            limit = rng.randrange(0, len(rows) + 3)
            expected = core.rank(terms, limit)
            assert arrays.rank(terms, limit) == expected
            assert all(type(score) is float for _, score in arrays.rank(terms, limit))
            if expected:
                of, ours = core.coverage(terms), arrays.coverage(terms)
                assert [ours(doc) for doc, _ in expected] == [of(doc) for doc, _ in expected]


def recomputed_scan(
    rows: dict[tuple[str, int], tactmem.Record], query: str, limit: int, now_ms: int
) -> list[dict[str, Any]]:
    """A scan's answer worked out afresh from every row: those a prune keeps and a read may
    return (`_served`), ranked by the core's pure `rank` over one new corpus."""
    served = {
        tactmem_server._doc_id(ns, doc_id): (ns, record)
        for (ns, doc_id), record in rows.items()
        if not tactmem.core.expired(record.use_count, record.probation_until_ms, now_ms)
        and tactmem_server._served(ns, record)
    }
    docs = [(doc_id, record.content) for doc_id, (_, record) in served.items()]
    return [
        {
            "key": tactmem_server.wire_key(served[doc_id][0], served[doc_id][1].key),
            "preview": tactmem.preview(served[doc_id][1].content),
            "score": score,
        }
        for doc_id, score in tactmem.rank(query, docs, limit=limit)
    ]


_WORDS = ("deploy", "release", "main", "branch", "cache", "note", "build", "Build", "数据库")


@pytest.mark.parametrize("seed", [1, 2])
def test_the_incremental_index_answers_as_a_full_recomputation(
    seed: int, backend: list[str], start: Callable[..., Server]
) -> None:
    """Two server processes on one database, each with its own index kept up to date one
    changed namespace at a time, under a random sequence of puts, replaces, deletes, reads
    and rows a foreign writer adds (hidden ones: secret-shaped text, a namespace no
    credential names, impossible times; expired probation, pruned by the next scan): every
    scan answers exactly what a fresh ranking of the database's rows gives (keys, previews,
    scores to the bit, ties by namespace then id), and its telemetry lands on exactly the
    cards it returned."""
    rng = random.Random(seed)
    clients = [start().client for _ in range(2)]
    foreign = itertools.count(10_000, 1_000)  # a put takes the id after the highest
    insert = (
        "INSERT INTO memories (namespace, id, version, content, identity, created_at_ms,"
        " updated_at_ms, use_count, probation_until_ms) VALUES (?, ?, 1, ?, ?, ?, 1, 0, ?)"
    )

    def text() -> str:
        return " ".join(rng.choices(_WORDS, k=rng.randint(1, 6))) + f" {rng.randrange(10**6)}"

    for step in range(60):
        client, ns = rng.choice(clients), rng.choice(["alice", "bob"])
        mine = [key for key in database_rows(backend) if key[0] == ns]
        action = rng.choice(["put", "put", "replace", "delete", "read", "foreign", "scan"])
        if action == "put" or (action in ("replace", "delete", "read") and not mine):
            client.call("/v1/memories/put", {"content": text()}, namespace=ns)
        elif action in ("replace", "delete", "read"):
            record = database_rows(backend)[rng.choice(mine)]
            wire = tactmem_server.wire_key(ns, record.key)
            requests: dict[str, tuple[str, object]] = {
                "replace": ("/v1/memories/put", {"content": text(), "replacement": wire}),
                "delete": ("/v1/memories/delete", {"key": wire}),
                "read": ("/v1/memories/read", {"keys": [wire]}),
            }
            client.call(*requests[action], namespace=ns)
        elif action == "foreign":
            where, content, created, until = rng.choice([
                ("carol", text(), 1, None),  # no credential names it: still team memory
                ("bob", "password = hunter2hunter2 " + text(), 1, None),  # secret-shaped
                ("\u00e9", text(), 1, None),  # a namespace no credential can name
                ("alice", text(), 2, None),  # created after updated
                ("alice", text(), 1, 1),  # probation over, never read: pruned
                ("bob", text(), 1, 2**62),  # on probation
            ])  # fmt: skip
            outside(
                backend,
                ("INSERT INTO memory_namespaces (namespace) VALUES (?) ON CONFLICT DO NOTHING",
                 [where]),
                (insert, [where, next(foreign), content, f"foreign {step}", created, until]),
                ("UPDATE memory_namespaces SET changes = changes + 1 WHERE namespace = ?",
                 [where]),
            )  # fmt: skip
        query = " ".join(rng.choices(_WORDS, k=rng.randint(1, 3)))
        limit = rng.randint(1, 5)
        before, now = database_rows(backend), tactmem.core.now_ms()
        cards = client.ok("/v1/memories/scan", {"query": query, "limit": limit})["candidates"]
        assert cards == recomputed_scan(before, query, limit, now), (step, action)
        after = database_rows(backend)
        scanned = {(c["key"]["namespace"], c["key"]["id"]) for c in cards}
        assert after.keys() == {
            key
            for key, r in before.items()
            if not tactmem.core.expired(r.use_count, r.probation_until_ms, now)
        }
        for key, record in after.items():
            if key in scanned:
                assert record.scan_count == before[key].scan_count + 1
                assert record.last_scanned_at_ms is not None
                assert record.last_scanned_at_ms >= now
            else:
                assert record == before[key]


@pytest.mark.slow
def test_the_server_reconnects_after_postgresql_restarts(
    cluster: Cluster, credentials: str
) -> None:
    server = Server(["--postgres", cluster.url(cluster.new_database())], credentials)
    try:
        server.client.put("written before the restart")
        cluster.restart()
        assert server.client.put("written after the restart")["key"]["id"] == 2
        assert health(server.client)["status"] == "ok"
    finally:
        server.stop(signal.SIGKILL)


def test_the_listener_is_a_tcp_socket_so_connections_get_nodelay() -> None:
    """asyncio sets TCP_NODELAY only on connections accepted from a socket whose protocol is
    IPPROTO_TCP; a socket made with protocol 0 left every response waiting for a delayed ACK."""
    listener = tactmem_server._listen("127.0.0.1", 0)
    try:
        assert listener.proto == socket.IPPROTO_TCP
        assert listener.getsockname()[1] > 0
    finally:
        listener.close()


@pytest.mark.slow
def test_a_websocket_upgrade_stays_plain_http(tmp_path: pathlib.Path, credentials: str) -> None:
    """No WebSocket protocol is loaded (uvicorn's `ws="none"`): an upgrade request is answered
    as any other request, by the bounded HTTP protocol and its read timeouts, never handed to a
    protocol without them (uvicorn's default upgraded it, and the handshake answered 403)."""
    server = Server(["--sqlite", str(tmp_path / "team.sqlite3")], credentials)
    parts = urlsplit(server.url)
    try:
        connection = http.client.HTTPConnection(parts.hostname or "", parts.port or 0, timeout=10)
        upgrade = {"connection": "Upgrade", "upgrade": "websocket", "sec-websocket-version": "13"}
        upgrade["sec-websocket-key"] = "dGhlIHNhbXBsZSBub25jZQ=="
        connection.request("GET", "/v1/memories/scan", headers=upgrade)
        answer = connection.getresponse()
        assert (answer.status, answer.getheader("allow"), answer.read()) == (405, "POST", b"")
        assert server.client.put("the next request is answered")["key"]["id"] == 1
    finally:
        server.stop()


# ============================================================================ pure rules

NAMESPACES = st.text(alphabet="ABCXYZabcxyz019._-", min_size=1, max_size=128)


@given(st.lists(st.tuples(NAMESPACES, st.integers(1, 2**63 - 1)), min_size=2, max_size=20))
def test_doc_ids_order_as_namespace_then_id(pairs: list[tuple[str, int]]) -> None:
    encoded = [tactmem_server._doc_id(namespace, doc_id) for namespace, doc_id in pairs]
    assert [tactmem_server._doc_key(value) for value in encoded] == pairs
    by_pair = sorted(pairs, key=lambda pair: (pair[0].encode(), pair[1]))
    assert [tactmem_server._doc_key(value) for value in sorted(encoded)] == by_pair


def test_read_looks_up_keys_first_then_own_ids_each_once() -> None:
    key = tactmem_server.WireKey
    payload = {
        "ids": [3, 1, 3],
        "keys": [key("bob", 1, 2), key(None, 9, 1), key("alice", 1, 1), key("bob", 1, 5)],
    }
    assert tactmem_server.check_read(payload, "alice") == [
        key("bob", 1, 2), key("alice", 1, 1), key("alice", 3, 0),
    ]  # fmt: skip


def test_sync_report_counts_by_full_record_equality() -> None:
    def record(doc_id: int, content: str, uses: int = 0) -> tactmem.Record:
        return tactmem.Record(tactmem.Key(doc_id, 1), content, 1, 1, None, 0, None, uses, None)

    previous = {1: record(1, "one"), 2: record(2, "two"), 3: record(3, "three")}
    snapshot = [record(1, "one"), record(2, "two", uses=1), record(4, "four")]
    assert tactmem_server.plan_sync(previous, snapshot) == {
        "inserted": 1, "replaced": 1, "unchanged": 1, "deleted": 1,
    }  # fmt: skip


def test_a_guarded_sync_keeps_the_reads_that_landed_since_its_export() -> None:
    """`keep_reads`: a snapshot record at its row's version and content keeps the row's higher
    counts and later times and stays off probation if the row is; any other is as sent."""
    row = tactmem.Record(tactmem.Key(1, 2), "one", 1, 1, 30, 4, 40, 1, None)
    sent = tactmem.Record(tactmem.Key(1, 2), "one", 1, 1, 20, 5, None, 0, 99)
    ((kept, identity),) = tactmem_server.keep_reads({1: row}, [(sent, "one")])
    assert identity == "one" and kept == tactmem.Record(
        tactmem.Key(1, 2), "one", 1, 1, 30, 5, 40, 1, None
    )
    other = [(attrs.evolve(sent, key=tactmem.Key(1, 3), content="two"), "two")]
    assert tactmem_server.keep_reads({1: row}, other) == other
    assert tactmem_server.keep_reads({}, [(sent, "one")]) == [(sent, "one")]


# ============================================================================ the tool at /mcp
# The official MCP client over streamable HTTP against a real server process, on both backends.


def mcp_client(url: str, token: str | None, mode: str = "auto") -> Any:
    """The SDK's client of `url`/mcp, sending `token` as the bearer (none when None)."""
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    headers = {} if token is None else {"authorization": f"Bearer {token}"}
    http = httpx2.AsyncClient(headers=headers, timeout=60)
    return Client(streamable_http_client(f"{url}/mcp", http_client=http), mode=mode)


def run_async(work: Callable[[], Any]) -> Any:
    import anyio

    async def bounded() -> Any:
        with anyio.fail_after(120):
            return await work()

    return anyio.run(bounded)


def mcp_calls(url: str, token: str, calls: list[dict[str, Any]]) -> tuple[Any, list[Any]]:
    """One MCP session: its tool as listed, and each call's result, checked against the tool's
    output schema (structured content, and the same JSON as text)."""
    import jsonschema

    async def session() -> tuple[Any, list[Any]]:
        async with mcp_client(url, token) as client:
            (tool,) = (await client.list_tools()).tools
            results = []
            for arguments in calls:
                result = await client.call_tool("memory", arguments)
                answer = result.structured_content
                jsonschema.validate(answer, tool.output_schema)
                assert json.loads(result.content[0].text) == answer
                assert result.is_error == ("error" in answer)
                results.append(answer)
            return tool, results

    answer: tuple[Any, list[Any]] = run_async(session)
    return answer


@pytest.mark.slow
def test_mcp_surfaces_follow_the_role(start: Callable[..., Server]) -> None:
    server = start()
    writer, _ = mcp_calls(server.url, ALICE, [])
    reader, _ = mcp_calls(server.url, READER, [])
    assert writer.name == reader.name == "memory"
    root = tactmem.tool_definition(flat=True, root=True, team=True)
    child = tactmem.tool_definition(flat=True, root=False, team=True)
    assert (writer.input_schema, writer.output_schema) == (
        root["input_schema"], root["output_schema"],
    )  # fmt: skip
    assert (reader.input_schema, reader.output_schema) == (
        child["input_schema"], child["output_schema"],
    )  # fmt: skip
    assert writer.description == root["description"] != reader.description
    assert reader.input_schema["properties"]["operation"] == {"enum": ["scan", "read"]}

    async def negotiated(mode: str) -> str | None:
        async with mcp_client(server.url, ALICE, mode) as client:
            version: str | None = client.session.protocol_version
            return version

    # A client that tries MCP 2026-07-28 first (no sessions) falls back to the handshake.
    assert run_async(lambda: negotiated("auto")) == run_async(lambda: negotiated("legacy"))


@pytest.mark.slow
def test_the_docs_mcp_servers_entry_reaches_the_team_tool(start: Callable[..., Server]) -> None:
    """docs/server.md's `mcpServers` entry for `/mcp` as a host reads it (the json block test of
    test_tactmem.py leaves it to this one): its URL and its header, with this server's origin and
    a writer's token in place of the example's, open a session of the writer's tool, which
    stores."""
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    docs = (pathlib.Path(__file__).parent.parent / "docs" / "server.md").read_text()
    blocks = re.findall(r"^```json\n(.*?)^```$", docs, flags=re.MULTILINE | re.DOTALL)
    (entry,) = [json.loads(b)["mcpServers"]["team-memory"] for b in blocks if "mcpServers" in b]
    assert (entry["type"], entry["url"]) == ("http", "https://memory.example.com/mcp")
    server = start()
    url = entry["url"].replace("https://memory.example.com", server.url)
    # the host expands ${TEAM_MEMORY_TOKEN} from its environment; here, to a writer's token
    headers = {k: v.replace("${TEAM_MEMORY_TOKEN}", ALICE) for k, v in entry["headers"].items()}
    assert headers == {"Authorization": f"Bearer {ALICE}"}

    async def session() -> Any:
        http = httpx2.AsyncClient(headers=headers, timeout=60)
        async with Client(streamable_http_client(url, http_client=http)) as client:
            await client.call_tool("memory", {"operation": "scan", "query": "docs snippet"})
            put = {"operation": "put", "content": "The docs' MCP entry reaches the team tool."}
            return (await client.call_tool("memory", put)).structured_content

    stored = run_async(session)
    assert stored["memory"]["key"]["namespace"] == "alice"


@pytest.mark.slow
def test_mcp_scan_put_read_delete_round_trip(start: Callable[..., Server]) -> None:
    server = start()
    bob = server.client.put("bob keeps the release checklist in docs/release.md", "bob")
    note = "The release tag is cut from main after the checklist passes."
    _, answers = mcp_calls(server.url, ALICE, [
        {"operation": "put", "content": note},  # no scan yet
        {"operation": "scan", "query": "release checklist"},
        {"operation": "put", "content": note},
        {"operation": "scan", "query": "release tag main"},
        {"operation": "put", "content": "Release tags are cut from main.",
         "replace": {"id": 1, "version": 1}},
        {"operation": "read", "keys": [{"id": 1, "version": 2, "namespace": "alice"},
                                        {"id": 99, "version": 1, "namespace": "alice"}]},
        {"operation": "delete", "id": 1, "version": 1},  # stale
        {"operation": "delete", "id": 1, "version": 2},
        {"operation": "read", "keys": [{"id": 1, "version": 2, "namespace": "alice"}]},
    ])  # fmt: skip
    first_put, scan, put, _, replaced, read, stale, deleted, gone = answers
    assert first_put["error"]["code"] == "scan_required"
    assert [card["key"] for card in scan["candidates"]] == [bob["key"]]  # every namespace
    assert put["memory"]["key"] == {"id": 1, "version": 1, "namespace": "alice"}
    assert put["memory"]["content"] == note
    assert replaced["replaced"] is True
    assert replaced["memory"]["key"] == {"id": 1, "version": 2, "namespace": "alice"}
    assert [r["key"] for r in read["memories"]] == [replaced["memory"]["key"]]
    assert read["memories"][0]["use_count"] == 1
    assert stale["error"]["code"] == "conflict"
    assert deleted == {"operation": "delete", "id": 1}
    assert gone == {"operation": "read", "memories": []}
    assert [key_of(r) for r in server.client.export()] == [("bob", 1, 1)]


@pytest.mark.slow
def test_mcp_reads_another_namespaces_card_by_its_key(start: Callable[..., Server]) -> None:
    server = start()
    alice = server.client.put("alice pins the toolchain in rust-toolchain.toml")

    async def bob_reads() -> list[Any]:
        async with mcp_client(server.url, BOB) as client:
            scan = await client.call_tool("memory", {"operation": "scan", "query": "toolchain"})
            (card,) = scan.structured_content["candidates"]
            answers = [scan.structured_content]
            for arguments in (
                {"operation": "read", "keys": [card["key"]]},  # the card's key, unchanged
                {"operation": "read", "keys": [{**card["key"], "version": 2}]},  # not current
                {"operation": "put", "content": "bob's version", "replace": card["key"]},
                {"operation": "delete", **card["key"]},
            ):
                answers.append((await client.call_tool("memory", arguments)).structured_content)
            return answers

    scan, read, stale, replace, delete = run_async(bob_reads)
    assert scan["candidates"][0]["key"] == alice["key"]
    (record,) = read["memories"]
    assert (record["key"], record["content"]) == (alice["key"], alice["content"])
    assert record["use_count"] == 1
    assert stale["memories"] == []
    assert replace["error"]["code"] == delete["error"]["code"] == "remote_denied"
    exported = server.client.export()  # alice's record is untouched but for its telemetry
    assert [(r["key"], r["content"], r["use_count"]) for r in exported] == [
        (alice["key"], alice["content"], 1),
    ]  # fmt: skip


@pytest.mark.slow
def test_mcp_reader_cannot_change_anything(start: Callable[..., Server]) -> None:
    server = start()
    alice = server.client.put("the staging database is rebuilt every night")
    _, answers = mcp_calls(server.url, READER, [
        {"operation": "scan", "query": "staging database"},
        {"operation": "put", "content": "a reader's note"},
        {"operation": "delete", "id": 1, "version": 1},
        {"operation": "read", "keys": [alice["key"]]},  # a reader reads every namespace
    ])  # fmt: skip
    scan, put, delete, read = answers
    assert [card["key"] for card in scan["candidates"]] == [alice["key"]]
    assert put["error"]["code"] == delete["error"]["code"] == "not_root"
    assert [r["content"] for r in read["memories"]] == [alice["content"]]
    exported = server.client.export()  # nothing stored, nothing deleted (the scan is counted)
    assert [(r["key"], r["content"], r["scan_count"]) for r in exported] == [
        (alice["key"], alice["content"], 1),
    ]  # fmt: skip


@pytest.mark.slow
def test_mcp_scan_gate_is_per_session(start: Callable[..., Server]) -> None:
    server = start()

    async def two_sessions() -> list[Any]:
        async with mcp_client(server.url, ALICE) as first, mcp_client(server.url, ALICE) as other:
            await first.call_tool("memory", {"operation": "scan", "query": "deploy"})
            refused = await other.call_tool("memory", {"operation": "put", "content": "deploy"})
            stored = await first.call_tool("memory", {"operation": "put", "content": "deploy"})
            return [refused.structured_content, stored.structured_content]

    refused, stored = run_async(two_sessions)
    assert refused["error"]["code"] == "scan_required"
    assert stored["memory"]["key"] == {"id": 1, "version": 1, "namespace": "alice"}


def mcp_post(
    client: Client, token: str | None, message: object, session: str | None = None,
    headers: dict[str, str] | None = None, raw: bytes | None = None, timeout: float = 120,
) -> tuple[int, dict[str, str], bytes]:  # fmt: skip
    """One raw JSON-RPC POST to /mcp: the status, the headers and the body."""
    sent = {"content-type": "application/json", "accept": "application/json, text/event-stream"}
    if token is not None:
        sent["authorization"] = f"Bearer {token}"
    if session is not None:
        sent["mcp-session-id"] = session
        sent["mcp-protocol-version"] = "2025-11-25"
    sent.update(headers or {})
    connection = http.client.HTTPConnection(client.host, client.port, timeout=timeout)
    try:
        body = json.dumps(message).encode() if raw is None else raw
        connection.request("POST", "/mcp", body=body, headers=sent)
        response = connection.getresponse()
        received = {name.lower(): value for name, value in response.getheaders()}
        return response.status, received, response.read()
    finally:
        connection.close()


INITIALIZE = {
    "jsonrpc": "2.0", "id": 1, "method": "initialize",
    "params": {"protocolVersion": "2025-11-25", "capabilities": {},
               "clientInfo": {"name": "test", "version": "1"}},
}  # fmt: skip


def mcp_open(client: Client, token: str) -> str:
    """A session opened with `token` by hand: initialize, then initialized; its id."""
    status, headers, _ = mcp_post(client, token, INITIALIZE)
    assert status == 200
    session = headers["mcp-session-id"]
    initialized = {"jsonrpc": "2.0", "method": "notifications/initialized"}
    assert mcp_post(client, token, initialized, session)[0] == 202
    return session


def tool_call(call_id: int, **arguments: object) -> dict[str, Any]:
    params = {"name": "memory", "arguments": arguments}
    return {"jsonrpc": "2.0", "id": call_id, "method": "tools/call", "params": params}


@pytest.mark.slow
def test_mcp_needs_a_known_bearer_token(start: Callable[..., Server]) -> None:
    server = start()
    client = server.client
    for token in (None, "", "unknown-token-000000000000", f"{ALICE}!"):
        status, headers, body = mcp_post(client, token, INITIALIZE)
        assert (status, body) == (401, error("unauthorized")), token
        assert headers["www-authenticate"] == "Bearer"
        assert "mcp-session-id" not in headers  # refused before any MCP work
    basic = mcp_post(client, None, INITIALIZE, headers={"authorization": f"Basic {ALICE}"})
    assert basic[0] == 401
    session = mcp_open(client, ALICE)
    scan = tool_call(2, operation="scan", query="anything")
    assert mcp_post(client, None, scan, session)[:3:2] == (401, error("unauthorized"))

    async def connect() -> None:
        async with mcp_client(server.url, "unknown-token-000000000000") as unknown:
            await unknown.list_tools()

    with pytest.raises(Exception):  # noqa: B017 - the SDK reports a refused handshake its own way
        run_async(connect)
    events = [json.loads(line) for line in server.lines]
    assert {e["event"] for e in events} == {"listening", "mcp"}  # no tool call was ever made
    assert {e["status"] for e in events if e["event"] == "mcp" and e["namespace"] is None} == {401}


@pytest.mark.slow
def test_mcp_session_stays_with_the_token_that_opened_it(start: Callable[..., Server]) -> None:
    server = start()
    client = server.client
    session = mcp_open(client, ALICE)
    status, _, body = mcp_post(client, ALICE, tool_call(2, operation="scan", query="x y"), session)
    assert status == 200 and json.loads(body)["result"]["structuredContent"]["abstained"]
    put = tool_call(3, operation="put", content="written on a borrowed session")
    # Another namespace's token, and even another token of the same namespace, are refused as
    # for an unknown session; nothing is stored and the owner's scan still counts.
    for other in (BOB, ALICE_ROTATED, READER):
        status, _, body = mcp_post(client, other, put, session)
        assert status == 404, other
        assert "result" not in json.loads(body)
    assert client.export() == []
    status, _, body = mcp_post(client, ALICE, put, session)
    assert status == 200
    memory = json.loads(body)["result"]["structuredContent"]["memory"]
    assert memory["key"] == {"id": 1, "version": 1, "namespace": "alice"}
    assert [key_of(r) for r in client.export()] == [("alice", 1, 1)]
    assert server.stop() == -signal.SIGTERM
    events = [json.loads(line) for line in server.lines]  # the SDK's own lines are not logged
    refused = [e for e in events if e["event"] == "mcp" and e["status"] == 404]
    assert [e["namespace"] for e in refused] == ["bob", "alice", "reader"]
    assert session not in "".join(server.lines)


@pytest.mark.slow
def test_mcp_refuses_the_sessionless_protocol_and_streams(start: Callable[..., Server]) -> None:
    server = start()
    client = server.client
    discover = {
        "jsonrpc": "2.0", "id": 1, "method": "server/discover",
        "params": {"_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28"}},
    }  # fmt: skip
    for version in ("2026-07-28", "not-a-version-zebracorn"):
        headers = {"mcp-protocol-version": version}
        status, _, body = mcp_post(client, ALICE, discover, headers=headers)
        answer = json.loads(body)
        assert status == 400
        assert answer["error"]["code"] == -32022
        assert "2026-07-28" not in answer["error"]["data"]["supported"]
        assert b"zebracorn" not in body
    assert client.call("/mcp", method="GET", token=ALICE, namespace=None) == (405, b"")


@pytest.mark.slow
def test_mcp_bounds_and_logs(backend: list[str], start: Callable[..., Server]) -> None:
    server = start()
    client = server.client
    oversized = b"x" * (2 * 1024 * 1024 + 1)
    assert mcp_post(client, ALICE, None, raw=oversized)[0] == 413
    # /mcp's tool calls share the 64 places with /v1: the 65th waits. Opening a session
    # does no store work, so it takes no place and is answered meanwhile.
    session = mcp_open(client, ALICE)
    with ThreadPoolExecutor(65) as pool, store_locked(backend):
        answers = [pool.submit(client.call, "/v1/memories/list", None) for _ in range(64)]
        wait_for(lambda: health(client)["in_flight"] == 64, "64 requests in flight")
        assert mcp_post(client, ALICE, INITIALIZE, timeout=10)[0] == 200
        scan = tool_call(2, operation="scan", query="waits for a place")
        calling = pool.submit(mcp_post, client, ALICE, scan, session)
        wait_for(lambda: health(client)["waiting"] == 1, "the MCP tool call waiting")
        time.sleep(0.3)
        assert not calling.done()
    assert [answer.result()[0] for answer in answers] == [200] * 64
    assert calling.result()[0] == 200
    _, results = mcp_calls(server.url, ALICE, [
        {"operation": "scan", "query": "zebracorn-query-marker"},
        {"operation": "put", "content": "note about zebracorn-marker-in-content"},
        {"operation": "put", "content": "password = hunter2hunter2"},
        {"operation": "zebracorn"},
    ])  # fmt: skip
    assert [r.get("error", {}).get("code") for r in results] == [
        None, None, "scan_required", "invalid_request",
    ]  # fmt: skip
    assert server.stop() == -signal.SIGTERM
    events = [json.loads(line) for line in server.lines]
    assert events[-1] == {"event": "stopped"}
    tools = [(e["operation"], e["error_code"]) for e in events if e["event"] == "tool"]
    assert tools == [
        ("scan", None),  # the call that waited for a place
        ("scan", None),
        ("put", None),
        ("put", "scan_required"),
        (None, "invalid_request"),
    ]
    calls = [e for e in events if e["event"] == "mcp"]
    assert {e["status"] for e in calls} >= {413, 200, 202}
    assert all(e["namespace"] == "alice" and e["role"] == "writer" for e in calls)
    text = "".join(server.lines)
    for leak in ("zebracorn", "hunter2", ALICE, "password", "mcp-session-id"):
        assert leak not in text


@pytest.mark.slow
def test_one_token_cannot_take_every_mcp_session(tmp_path: pathlib.Path, credentials: str) -> None:
    """A token that opens more sessions than its share (64) gets its least recently used ones
    closed to make room (their next request is the 404 of a session gone), and another
    token's agent still opens one and works. Sessions do not depend on the backend."""
    server = Server(["--sqlite", str(tmp_path / "team.sqlite3")], credentials)
    client = server.client
    share = tactmem_server.MCP_SESSIONS_PER_TOKEN
    try:
        sessions = [mcp_open(client, ALICE) for _ in range(share + 2)]
        listing = {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}
        statuses = [mcp_post(client, ALICE, listing, session)[0] for session in sessions]
        assert statuses == [404, 404] + [200] * share
        bob = mcp_open(client, BOB)
        scan = tool_call(3, operation="scan", query="anything at all")
        assert mcp_post(client, BOB, scan, bob)[0] == 200
    finally:
        server.stop()
    reclaimed = [e for e in _events(server) if e["event"] == "mcp_session_closed"]
    assert [(e["namespace"], e["reason"]) for e in reclaimed] == [("alice", "token_share")] * 2
    assert not any(session in "".join(server.lines) for session in sessions)


def test_the_session_book_makes_room_least_recently_used_first() -> None:
    """The bookkeeping behind the bounds, with tiny ones: a token's share, then the process's
    total, each by least recent use; sessions idle past the SDK's timeout are forgotten."""
    book = tactmem_server._SessionBook(per_token=2, total=3, idle_s=100)
    a, b = b"token-a", b"token-b"
    book.opened("a1", a, 0)
    book.opened("a2", a, 1)
    assert book.room(a, 2) == [("a1", "token_share")]
    book.closed("a1")
    book.opened("a3", a, 3)
    book.used("a2", 4)  # now a3 is a's least recently used
    book.opened("b1", b, 5)
    assert book.room(b, 6) == [("a3", "process_total")]
    book.closed("a3")
    book.opened("b2", b, 7)
    assert book.room(b, 8) == [("b1", "token_share")]
    assert book.room(a, 200) == []  # all idle past 100: the SDK closed them, nothing to make
    assert book.owner("b2") is None


# ------------------------------------------------------------------------ NamespaceStore


def team_store(backend: list[str]) -> tactmem_server.TeamStore:
    kind, target = backend
    if kind == "--sqlite":
        return tactmem_server.TeamStore(tactmem_server.SqliteEngine(target))
    return tactmem_server.TeamStore(tactmem_server.PostgresEngine(target, pool_size=2))


def test_namespace_store_is_one_principals_backend(backend: list[str]) -> None:
    store = team_store(backend)
    try:
        principal = tactmem_server.Principal
        alice = tactmem_server.NamespaceStore(store, principal("alice", "writer"))
        bob = tactmem_server.NamespaceStore(store, principal("bob", "writer"))
        reader = tactmem_server.NamespaceStore(store, principal("reader", "reader"))
        backend_type: tactmem.Backend = alice  # the storage boundary, for mypy
        assert backend_type.limits == tactmem.Limits()
        mine = alice.put("alice keeps the deploy runbook in ops/")
        theirs = bob.put("bob rotates the deploy keys on fridays")
        assert isinstance(mine.key, tactmem.RemoteKey) and isinstance(theirs.key, tactmem.RemoteKey)
        assert mine.key == tactmem.RemoteKey(1, 1, "alice")
        scan = reader.scan("deploy")
        assert {card.key for card in scan.candidates} == {mine.key, theirs.key}
        assert all(isinstance(card.key, tactmem.RemoteKey) for card in scan.candidates)
        assert reader.scan("   ").reason == "no_terms"
        assert reader.scan("deploy", limit=0).reason == "no_room"
        assert [r.key for r in alice.read([1, 2, 1])] == [mine.key]  # ids: own namespace
        assert [r.key for r in alice.read_keys([theirs.key, mine.key])] == [theirs.key, mine.key]
        assert alice.read_keys([tactmem.RemoteKey(1, 2, "bob")]) == ()  # exact version only
        assert [r.key for r in reader.list()] == [mine.key, theirs.key]
        refusals: list[Callable[[], object]] = [
            lambda: reader.put("a reader writes nothing"),
            lambda: reader.delete(tactmem.Key(1, 1)),
            lambda: alice.put("not alice's to replace", replace=theirs.key),
            lambda: alice.delete(theirs.key),
        ]
        for refused in refusals:
            with pytest.raises(tactmem.RemoteDenied):
                refused()
        with pytest.raises(tactmem.SecretRejected):
            alice.put("password = hunter2hunter2")
        with pytest.raises(tactmem.InvalidRequest):
            alice.put("nul \0 inside")
        with pytest.raises(tactmem.InvalidRequest):
            alice.scan("deploy", min_coverage=0.5)
        with pytest.raises(tactmem.Conflict):
            alice.delete(tactmem.Key(1, 2))
        replaced = alice.put("alice keeps the runbook in ops/runbook.md", replace=mine.key)
        assert replaced.key == tactmem.RemoteKey(1, 2, "alice")
        alice.delete(replaced.key)
        alice.delete(replaced.key)  # already gone: the protocol's success
        assert [r.key for r in reader.list()] == [theirs.key]
    finally:
        store.close()


def test_a_team_scan_answers_in_score_order_as_protocol_v1_and_its_clients_expect(
    tmp_path: pathlib.Path,
) -> None:
    """Protocol v1 sends a scan's cards by score, high to low, and the original's client and
    tactmem's (`NamespaceStore`, `RemoteStore`, the server's own `/mcp` tool) refuse any other
    order. So the team scan keeps BM25's order even where the first card holds only a function
    word (an order by what a card holds, as issue 28's tenth round tried, would put it last)."""
    store = tactmem_server.TeamStore(tactmem_server.SqliteEngine(str(tmp_path / "team.db")))
    alice = tactmem_server.NamespaceStore(store, tactmem_server.Principal("alice", "writer"))
    try:
        for text in ("the the", "rust" + " common" * 5, "x"):
            alice.put(text)
        cards = alice.scan("the rust").candidates  # through `_remote_cards`, as a client reads
        assert [card.preview for card in cards] == ["the the", "rust" + " common" * 5]
        assert cards[0].score > cards[1].score
    finally:
        store.close()


def test_postgresql_round_trips_a_scan_two_a_read_and_a_put_three(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each round trip is one pipeline (`_PostgresTx._send`, spied on, still sent). A warm scan:
    the opening with the prune's search and the counters, then its cards' telemetry with the
    commit, under timeouts set to what is left of the deadline. A read: the opening with the
    search, its rows (locked after any prune's locks), its telemetry with the commit. A put: the
    opening with the search; the namespace lock with the put's facts; its writes with the
    commit. The guard comes before the first statement of every transaction."""
    engine = tactmem_server.PostgresEngine(cluster.url(cluster.new_database()), pool_size=2)
    store = tactmem_server.TeamStore(engine)
    alice = tactmem_server.NamespaceStore(store, tactmem_server.Principal("alice", "writer"))
    sent: list[list[str]] = []
    send = tactmem_server._PostgresTx._send

    def counted(tx: Any, statements: Any) -> Any:
        sent.append([" ".join(sql.split()[:2]) for sql, _ in statements])
        return send(tx, statements)

    try:
        first = alice.put("alice keeps the deploy runbook in ops/")
        assert alice.scan("deploy").candidates  # the corpus is built: the next scan is warm
        monkeypatch.setattr(tactmem_server._PostgresTx, "_send", counted)
        assert [c.key for c in alice.scan("deploy runbook").candidates] == [first.key]
        timeouts = "SELECT set_config('statement_timeout',"  # and lock_timeout, one statement
        opening = ["BEGIN ISOLATION", timeouts, "LOCK TABLE", "WITH ours"]
        closing = [timeouts, "UPDATE memories", "COMMIT"]
        search = [*opening, "SELECT namespace,"]
        assert sent == [[*search, "SELECT namespace,"], closing]  # with the counters
        sent.clear()
        alice.put("alice keeps the runbook in ops/runbook.md", replace=first.key)
        assert len(sent) == 3 and sent[0] == search
        assert sent[1][0] == "SELECT namespace,"  # the lock, with the facts after it
        assert sent[2][0] == timeouts and sent[2][-1] == "COMMIT"
        assert not [statement for statement in sent[2][1:] if statement.startswith("SELECT")]
        sent.clear()
        assert alice.read([1])
        assert sent == [search, ["SELECT namespace,"], closing]
    finally:
        store.close()


def test_the_postgresql_guard_sees_a_trigger_committed_while_it_waited_for_the_lock(
    cluster: Cluster,
) -> None:
    """On a database whose default isolation is REPEATABLE READ, a trigger created (and not
    yet committed) by another session holds the tables; a transaction waits for them at its
    guard's lock, the trigger commits, and the guard still finds it: the server's
    transactions are READ COMMITTED, so their first snapshot is taken after the lock (with
    the database's default, the timeouts' SELECT took it before, and the trigger would run)."""
    import psycopg

    database = cluster.new_database()
    with psycopg.connect(cluster.dsn(database), autocommit=True) as admin:
        admin.execute(
            f"ALTER DATABASE {database} SET default_transaction_isolation = 'repeatable read'"
        )
    engine = tactmem_server.PostgresEngine(cluster.url(database), pool_size=1)
    outcome: list[object] = []

    def transaction() -> None:
        try:
            with engine.transaction(time.monotonic() + 10) as tx:
                outcome.append(tx.rows("SELECT 1"))
        except tactmem.TactmemError as error:
            outcome.append(error)

    try:
        with engine.transaction(time.monotonic() + 10) as tx:  # the tables, created
            assert tx.rows("SELECT 1") == [(1,)]
        with psycopg.connect(cluster.dsn(database), autocommit=True) as other:
            other.execute("BEGIN")
            for statement in POSTGRES_PLANTED["a trigger"]:
                other.execute(statement)
            waiting = threading.Thread(target=transaction)
            waiting.start()
            lock_wait = (
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE wait_event_type = 'Lock' AND datname = current_database()"
            )
            for _ in range(100):  # until it waits on the guard's LOCK TABLE
                if other.execute(lock_wait).fetchone() == (1,):
                    break
                time.sleep(0.05)
            assert not outcome and other.execute(lock_wait).fetchone() == (1,)
            other.execute("COMMIT")
            waiting.join(10)
        assert len(outcome) == 1 and isinstance(outcome[0], tactmem.StorageError), outcome
        assert "trigger" in str(outcome[0])
    finally:
        engine.close()


@pytest.mark.slow
def test_a_postgresql_write_waiting_past_the_deadline_never_commits(cluster: Cluster) -> None:
    """A write waits for the commit's round trip, which sets the timeouts to what is left of
    the deadline: a delete that waited 1.5 s for its namespace's lock and then waits on its
    row, which another transaction holds for 3 s, fails at its 2 s deadline and deletes
    nothing (with the transaction's first timeouts it waited, and committed, at 3 s)."""
    import psycopg

    database = cluster.new_database()
    store = tactmem_server.TeamStore(tactmem_server.PostgresEngine(cluster.url(database)))
    alice = tactmem_server.NamespaceStore(store, tactmem_server.Principal("alice", "writer"))
    key = alice.put("alice keeps the deploy runbook in ops/").key
    held = threading.Barrier(3)

    def hold(sql: str, seconds: float) -> None:
        with psycopg.connect(cluster.dsn(database)) as connection:
            connection.execute(sql)
            held.wait()
            time.sleep(seconds)

    holders = [
        threading.Thread(target=hold, args=(sql, seconds))
        for sql, seconds in (
            ("SELECT 1 FROM memory_namespaces WHERE namespace = 'alice' FOR UPDATE", 1.5),
            ("SELECT 1 FROM memories WHERE namespace = 'alice' AND id = 1 FOR UPDATE", 3.0),
        )
    ]
    try:
        for holder in holders:
            holder.start()
        held.wait()
        began = time.monotonic()
        with pytest.raises(tactmem.StoreBusy):
            store.delete("alice", tactmem.Key(key.id, key.version), began + 2.0)
        assert time.monotonic() - began < 2.8
        for holder in holders:
            holder.join()
        assert [record.key for record in alice.list()] == [key]
    finally:
        store.close()


def test_sqlite_scans_reads_and_puts_find_rows_by_index(tmp_path: pathlib.Path) -> None:
    """Every statement a warm scan, a read and a put run on SQLite reaches `memories` through
    an index, never by reading the whole table (EXPLAIN QUERY PLAN of each, as traced): a row
    value list (`(namespace, id, version) IN (...)`) once made each scan's telemetry read
    every row of 50 namespaces, which no untimed test saw."""
    engine = tactmem_server.SqliteEngine(str(tmp_path / "team.sqlite3"))
    store = tactmem_server.TeamStore(engine)
    alice = tactmem_server.NamespaceStore(store, tactmem_server.Principal("alice", "writer"))
    ran: list[str] = []
    try:
        keys = [alice.put(f"alice keeps runbook {n} of the deploy in ops/").key for n in range(9)]
        assert alice.scan("deploy runbook").candidates  # the corpus is built
        engine._connection.set_trace_callback(ran.append)
        assert len(alice.scan("deploy runbook").candidates) == 5
        assert alice.read([1, 2])
        alice.put("alice keeps the runbook in ops/runbook.md", replace=keys[0])
        engine._connection.set_trace_callback(None)
        touching = [
            sql for sql in ran if " memories " in f"{sql} " and not sql.startswith("PRAGMA")
        ]
        assert any(sql.startswith("UPDATE memories SET last_scanned_at_ms") for sql in touching)
        for sql in touching:
            plan = engine._connection.execute(f"EXPLAIN QUERY PLAN {sql}").fetchall()
            assert not [row for row in plan if row[3] == "SCAN memories"], (sql, plan)
    finally:
        store.close()


# ============================================================================ safe pushes
# Issue 25: `tactmem push` (the client, in tactmem.py) plans against the namespace's export and
# sends the sync with `IF_CHANGES`, so it never rewrites or deletes a record it has not seen
# (docs/team.md, "The push rule"). Real `tactmem` processes against a real server on each backend,
# some through a relay that acts between the export and the sync.


class Relay:
    """An HTTP relay on 127.0.0.1 in front of a server: each request goes on as it came and
    its answer comes back. `before[route]` runs once just before a request of that route goes
    on, `after[route]` once when its answer is back; `statuses` keeps each route's answers."""

    def __init__(self, target: str) -> None:
        import http.server

        self.before: dict[str, Callable[[], None]] = {}
        self.after: dict[str, Callable[[], None]] = {}
        self.statuses: dict[str, list[int]] = {}
        parts, relay = urlsplit(target), self
        skipped = {"host", "connection", "content-length", "transfer-encoding", "date", "server"}

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def relay(self) -> None:
                route = self.path.removeprefix("/v1/")
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                relay.before.pop(route, lambda: None)()
                onward = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=60)
                sent = {k: v for k, v in self.headers.items() if k.lower() not in skipped}
                onward.request(self.command, self.path, body or None, sent)
                answer = onward.getresponse()
                data = answer.read()
                onward.close()
                relay.statuses.setdefault(route, []).append(answer.status)
                relay.after.pop(route, lambda: None)()
                self.send_response(answer.status)
                for name, value in answer.getheaders():
                    if name.lower() not in skipped:
                        self.send_header(name, value)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = relay

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def relay_to() -> Iterator[Callable[[Server], Relay]]:
    relays: list[Relay] = []

    def made(server: Server) -> Relay:
        relays.append(Relay(server.url))
        return relays[-1]

    yield made
    for relay in relays:
        relay.close()


class Member:
    """A team member's `tactmem`: a config whose `[memory.remote]` names `url`, with the
    workspace root `work` beside `home`, run in one of the two."""

    def __init__(self, directory: pathlib.Path, namespace: str, url: str) -> None:
        self.base = directory / namespace
        for place in ("home", "work"):
            (self.base / place).mkdir(parents=True)
        self.config = self.base / "config.toml"
        self.config.write_text(
            "[memory]\nenabled = true\n\n[memory.remote]\n"
            f'endpoint = "{url}"\nnamespace = "{namespace}"\n'
            f'bearer_token = "{TOKENS[namespace]}"\nworkspace_roots = ["work"]\n'
        )
        self.config.chmod(0o600)

    def command(self, *argv: str) -> list[str]:
        return [sys.executable, "-m", "tactmem", "--config", str(self.config), *argv]

    def __call__(self, *argv: str, where: str = "home", status: int = 0) -> str:
        done = self.run(*argv, where=where)
        assert done.returncode == status, (done.stdout, done.stderr)
        return done.stdout

    def run(self, *argv: str, where: str = "home") -> subprocess.CompletedProcess[str]:
        """`tactmem` as `command` would run it, in this process (`main` in `where`, its
        standard streams captured): for what a command does; a test of the process itself
        (a push killed mid-way) starts `command`."""
        written, errors = io.BytesIO(), io.BytesIO()
        out = io.TextIOWrapper(written, encoding="utf-8")
        err = io.TextIOWrapper(errors, encoding="utf-8")
        given = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
        with (
            contextlib.chdir(self.base / where),
            unittest.mock.patch.multiple(sys, stdin=given, stdout=out, stderr=err),
        ):
            status = tactmem.main(["--config", str(self.config), *argv])
        out.flush()
        err.flush()
        return subprocess.CompletedProcess(
            list(argv), status, written.getvalue().decode(), errors.getvalue().decode()
        )


def team_of(server: Server) -> dict[tuple[str, int, int], str]:
    """Every record the server holds, by namespace, id and version."""
    return {
        (r["key"]["namespace"], r["key"]["id"], r["key"]["version"]): r["content"]
        for r in server.client.export()
    }


STAGING = "In ledgerline, the staging database listens on port 5433."
TABS = "The user prefers tabs in Makefiles, spaces elsewhere."
CHECKLIST = "Bob's deploy checklist lives in docs/deploy.md."


@pytest.mark.slow
def test_push_never_rewrites_a_record_it_has_not_seen(
    start: Callable[..., Server], tmp_path: pathlib.Path
) -> None:
    """The report of issue 25, step by step. Bob stores bob#1 from inside his workspace root;
    from home, `push` replaced it with a local note, still at version 1. Alice pulls
    everything and pushes: that moved her records to new ids, reset their read counts, and
    put bob's records in her namespace too. Now each push keeps what it has not seen, and a
    pull then a push changes nothing on the server."""
    server = start()
    bob = Member(tmp_path, "bob", server.url)
    assert bob("put", STAGING, where="work") == "stored bob#1 v1\n"
    bob("put", TABS)
    bob("put", CHECKLIST)
    before = server.client.export()
    dry = bob("push", "--dry-run")
    team_md = (pathlib.Path(__file__).parent.parent / "docs" / "team.md").read_text()
    assert f"```text\n{dry}```\n" in team_md  # "The push rule" shows this very plan
    assert dry == (
        "Would push to namespace `bob`, planned against what the server holds now (read just"
        " now; nothing was sent):\n"
        "  insert    #1 as bob#2, #2 as bob#3\n  replace   none\n  delete    none\n"
        "  conflict  none\n"
        "  kept      bob#1, not seen by this store (`tactmem pull` fetches, `push --force`"
        " deletes)\n"
        "The namespace would then hold 3 memories (157 content bytes).\n"  # 57 + 53 + 47
    )
    assert server.client.export() == before  # a dry run sends nothing
    assert bob("push").startswith(
        "Pushed 2 memories to namespace `bob`: 2 inserted, 0 replaced, 1 unchanged, 0 deleted.\n"
    )
    bobs = {("bob", 1, 1): STAGING, ("bob", 2, 1): TABS, ("bob", 3, 1): CHECKLIST}
    assert team_of(server) == bobs
    alice = Member(tmp_path, "alice", server.url)
    assert alice("put", "Alice: CI tags the releases.", where="work") == "stored alice#1 v1\n"
    alice("put", "Alice: integration tests need PGHOST=localhost.", where="work")
    alice("read", "1", where="work")
    alice("read", "1", "2", where="work")
    pulled = alice("pull", "--all")
    assert pulled == "Pulled all namespaces: 5 fetched, 5 inserted, 0 skipped.\n"
    before = server.client.export()
    assert [r["use_count"] for r in before[:2]] == [2, 1]
    assert alice("push") == (
        "Pushed 2 memories to namespace `alice`: 0 inserted, 0 replaced, 2 unchanged,"
        " 0 deleted.\n  left out  3 records pulled from other namespaces\n"
    )
    assert server.client.export() == before  # ids, versions, read counts: all as they were
    scan = server.client.ok("/v1/memories/scan", {"query": "staging database", "limit": 5},
                            namespace="reader")  # fmt: skip
    assert [c["key"]["namespace"] for c in scan["candidates"]] == ["bob"]  # bob's, once


@pytest.mark.slow
def test_a_push_racing_a_workspace_root_put_loses_nothing(
    start: Callable[..., Server], relay_to: Callable[[Server], Relay], tmp_path: pathlib.Path
) -> None:
    """Bob's agent stores a record from his workspace root after his push read the namespace
    and before its sync: the server refuses that sync (the namespace changed), the push plans
    again and keeps the new record."""
    server = start()
    relay = relay_to(server)
    bob = Member(tmp_path, "bob", relay.url)
    bob("put", TABS)
    assert bob("push").startswith("Pushed 1 memories to namespace `bob`: 1 inserted")
    bob("put", CHECKLIST)
    relay.before["memories/sync"] = lambda: server.client.put(STAGING, "bob")  # bob#2
    pushed = bob("push")
    assert relay.statuses["memories/sync"] == [200, 409, 200]  # refused once, nothing changed
    assert pushed == (
        "Pushed 2 memories to namespace `bob`: 1 inserted, 0 replaced, 2 unchanged, 0 deleted.\n"
        "  kept      bob#2, not seen by this store (`tactmem pull` fetches, `push --force`"
        " deletes)\n"
    )
    assert team_of(server) == {
        ("bob", 1, 1): TABS,
        ("bob", 2, 1): STAGING,
        ("bob", 3, 1): CHECKLIST,
    }


@pytest.mark.slow
def test_a_push_killed_between_its_sync_and_its_bookkeeping_loses_nothing(
    start: Callable[..., Server], relay_to: Callable[[Server], Relay], tmp_path: pathlib.Path
) -> None:
    """SIGKILL once the sync has landed and before the push wrote down its links: the next push
    finds them (written as pending before the sync) where the namespace is as they say, so a
    record replaced here since becomes the next version of the same team record, not a second
    record beside the first."""
    server = start()
    relay = relay_to(server)
    bob = Member(tmp_path, "bob", relay.url)
    bob("put", TABS)
    bob("put", CHECKLIST)
    push = subprocess.Popen(bob.command("push"), cwd=bob.base / "home", stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)  # fmt: skip
    relay.after["memories/sync"] = lambda: os.kill(push.pid, signal.SIGKILL)
    assert push.wait(120) == -signal.SIGKILL and push.communicate()[0] == b""
    assert relay.statuses["memories/sync"] == [200]  # it landed
    assert team_of(server) == {("bob", 1, 1): TABS, ("bob", 2, 1): CHECKLIST}
    assert bob("put", "--replace", "1@1", TABS + " Always.") == "replaced #1 v2\n"
    assert bob("push").startswith(
        "Pushed 2 memories to namespace `bob`: 0 inserted, 1 replaced, 1 unchanged, 0 deleted.\n"
    )
    assert team_of(server) == {("bob", 1, 2): TABS + " Always.", ("bob", 2, 1): CHECKLIST}
    assert bob("push").startswith(
        "Pushed 2 memories to namespace `bob`: 0 inserted, 0 replaced, 2 unchanged, 0 deleted.\n"
    )


def test_export_says_the_callers_namespace_facts_and_a_sync_can_require_them(
    client: Client, backend: list[str]
) -> None:
    """The extension under `push`: export answers carry the caller's namespace's change
    counter, next id and row count (hidden rows too); a sync naming a counter that moved is
    409 `conflict` with nothing changed; without the header a sync is the original's."""

    def facts(namespace: str) -> tuple[str, ...]:
        connection = http.client.HTTPConnection(client.host, client.port, timeout=60)
        body = json.dumps({"namespaces": [namespace], "cursor": None, "limit": 128})
        connection.request("POST", "/v1/memories/export", body, {
            "authorization": f"Bearer {TOKENS[namespace]}", "x-tact-memory-namespace": namespace,
            "content-type": "application/json",
        })  # fmt: skip
        answer = connection.getresponse()
        answer.read()
        connection.close()
        return tuple(answer.headers[name] for name in tactmem_server.FACT_HEADERS)

    assert facts("alice") == ("0", "1", "0")  # a namespace never written
    client.put("alice keeps the runbook in ops/")
    client.put("bob rotates the keys", namespace="bob")
    outside(backend, ("INSERT INTO memories (namespace, id, version, content, identity,"
                      " created_at_ms, updated_at_ms) VALUES ('alice', 7, 1, '   ', 'x', 1, 1)",
                      []))  # fmt: skip
    changes, next_id, rows = facts("alice")
    assert (next_id, rows) == ("2", "2") and len(client.export(["alice"])) == 1  # one hidden
    snapshot = {"memories": [snapshot_record(1, 1, "alice's only record")]}
    sync = "/v1/memories/sync"
    stale = {tactmem_server.IF_CHANGES: str(int(changes) - 1)}
    assert_error(client.call(sync, snapshot, headers=stale), 409, "conflict")
    for bad in ("1.5", "x", "99999999999999999999", "--1"):
        refused = client.call(sync, snapshot, headers={tactmem_server.IF_CHANGES: bad})
        assert_error(refused, 400, "bad_request")
    assert facts("alice") == (changes, next_id, rows)  # nothing changed
    fresh = {tactmem_server.IF_CHANGES: changes}
    report = client.ok(sync, snapshot, headers=fresh)
    assert (report["replaced"], report["deleted"]) == (1, 1)  # the hidden row is gone too
    assert facts("alice")[1:] == ("2", "1") and facts("alice")[0] != changes
    assert client.ok(sync, snapshot)["unchanged"] == 1  # no header: the original's sync


# Attacks on the push rule (a review of issue 25, part 1): multi-step histories, on the
# backends where the attack matters: SQLite alone where only the client decides, both where the
# server's transactions do, PostgreSQL alone where only its READ COMMITTED transactions are
# attacked. Each names the promise it holds the code to.

WEEK_MS = 7 * 24 * 3600 * 1000
sqlite_only = pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
postgres_only = pytest.mark.parametrize("backend", ["postgres"], indirect=True)


def run(member: Member, *argv: str, where: str = "home") -> subprocess.CompletedProcess[str]:
    """`member(...)`, keeping standard error and the exit status for the test to judge."""
    return member.run(*argv, where=where)


def database(member: Member) -> str:
    return tactmem.memory_db_path(str(member.config))


def push_a_week_later(member: Member, monkeypatch: pytest.MonkeyPatch) -> str:
    """The member's `tactmem push` a little over a probation from now: in this process, with
    the command line's clock moved on (its store then drops what expired there unread, as it
    would by then); what it printed."""
    real, ahead_ns = time.time_ns, (WEEK_MS + 60_000) * 1_000_000
    monkeypatch.setattr(time, "time_ns", lambda: real() + ahead_ns)
    monkeypatch.chdir(member.base / "home")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert tactmem.main(["--config", str(member.config), "push"]) == 0
    return printed.getvalue()


def remove_the_store(member: Member) -> None:
    """The member deletes the local database (as a reset, or before `restore`); the team links
    beside it, `<database>-team`, stay."""
    for suffix in ("", "-wal", "-shm"):
        pathlib.Path(database(member) + suffix).unlink(missing_ok=True)
    assert pathlib.Path(database(member) + "-team").exists()


def replacement(namespace: str, doc_id: int, version: int) -> dict[str, object]:
    return {"id": doc_id, "version": version, "namespace": namespace}


# ---------------------------------------------------------------- safe pushes: probation here


@sqlite_only
def test_a_record_used_on_the_team_is_not_deleted_when_it_expires_unread_here(
    start: Callable[..., Server], tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bob pushes a note from home; his agent in the workspace root reads bob#1 on the server
    (so it is used there, off probation). Nobody reads the home copy, so a week later the home
    store drops it, as every unread record on probation is dropped. That is not a delete by
    bob, yet the next push deletes bob#1 from the team: `_plan_push` takes a missing local
    record for "deleted here" (`_Push.forget`)."""
    server = start()
    bob = Member(tmp_path, "bob", server.url)
    bob("put", TABS)
    bob("push")
    assert TABS in bob("read", "1", where="work")  # used on the team
    assert "kept      bob#1, not seen by this store" in push_a_week_later(bob, monkeypatch)
    assert team_of(server) == {("bob", 1, 1): TABS}


@sqlite_only
@pytest.mark.slow
def test_a_pulled_record_that_expires_unread_here_is_not_deleted_from_the_team(
    start: Callable[..., Server], tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Alice's agent stores and uses alice#1 from her workspace root; at home she pulls
    (fresh local probation, as import gives) and never reads the copy there. A week later the
    copy expires at home, and `pull` then `push` deletes alice#1 from the team."""
    server = start()
    alice = Member(tmp_path, "alice", server.url)
    alice("put", STAGING, where="work")
    alice("read", "1", where="work")
    assert alice("pull", "--namespace", "alice").endswith("1 inserted, 0 skipped.\n")
    push_a_week_later(alice, monkeypatch)
    assert team_of(server) == {("alice", 1, 1): STAGING}


# ---------------------------------------------------------------- safe pushes: races


@pytest.mark.slow
def test_a_read_on_the_server_during_a_push_is_not_undone(
    start: Callable[..., Server], relay_to: Callable[[Server], Relay], tmp_path: pathlib.Path
) -> None:
    """An agent reads bob#1 on the server (use_count 1, off probation) after the push's export
    and before its sync. Reads do not move the change counter, so the guarded sync lands; it
    wrote the export's telemetry back (the read undone, bob#1 on probation again, to be dropped
    at its end though an agent used it) until the server kept such reads (`keep_reads`)."""
    server = start()
    relay = relay_to(server)
    bob = Member(tmp_path, "bob", relay.url)
    bob("put", TABS)
    bob("push")
    bob("put", CHECKLIST)
    read = {"ids": [1], "keys": []}
    relay.before["memories/sync"] = lambda: server.client.ok(
        "/v1/memories/read", read, namespace="bob"
    )
    bob("push")
    assert relay.statuses["memories/sync"] == [200, 200]
    (used,) = [r for r in server.client.export(["bob"]) if r["key"]["id"] == 1]
    assert (used["use_count"], used["probation_until_ms"]) == (1, None)


@postgres_only
def test_an_export_racing_a_replace_on_postgres_never_reverts_it(
    start: Callable[..., Server], relay_to: Callable[[Server], Relay], backend: list[str],
    tmp_path: pathlib.Path,
) -> None:  # fmt: skip
    """On PostgreSQL (READ COMMITTED) the export reads its page and then, in later statements,
    the namespace's facts. A replace of bob#1 that commits between the two is in the counter and
    not in the page: the push planned against bob#1 v1, its guarded sync landed, and bob#1 went
    back to v1: the key bob#1 v2 that the replacing agent holds named nothing. Now the export
    reads the facts before and after its page, and reads again if they differ. (The replace is
    made, as the server's put makes it, by a connection that holds `memory_namespaces` locked
    until it commits, so the export is held exactly between its page and its facts.)"""
    import psycopg

    server = start()
    relay = relay_to(server)
    bob = Member(tmp_path, "bob", relay.url)
    bob("put", TABS)
    bob("push")
    newer = TABS + " Except in Go."
    ready = threading.Event()

    def replace_while_the_export_waits() -> None:
        with psycopg.connect(backend[1]) as outside:
            outside.execute("LOCK TABLE memory_namespaces IN ACCESS EXCLUSIVE MODE")
            ready.set()
            time.sleep(0.8)  # the export has read its page and waits for the facts
            outside.execute(
                "UPDATE memories SET version = 2, content = %s, identity = %s,"
                " updated_at_ms = updated_at_ms + 1 WHERE namespace = 'bob' AND id = 1",
                [newer, tactmem.normalized_identity(newer)],
            )
            outside.execute(
                "UPDATE memory_namespaces SET changes = changes + 1 WHERE namespace = 'bob'"
            )

    writer = threading.Thread(target=replace_while_the_export_waits)

    def hold_the_export() -> None:
        writer.start()
        ready.wait(10)

    relay.before["memories/export"] = hold_the_export
    bob("put", CHECKLIST)
    bob("push")
    writer.join(10)
    assert team_of(server)[("bob", 1, 2)] == newer
    assert ("bob", 1, 1) not in team_of(server)


# ---------------------------------------------------------------- safe pushes: conflicts


@sqlite_only
def test_a_pull_settles_a_record_changed_here_and_on_the_server(
    start: Callable[..., Server], tmp_path: pathlib.Path
) -> None:
    """docs/team.md: a push refused for a conflict; "`tactmem pull` then brings the server's
    version in as a record of its own (linked, so it is not a conflict again)". For a record
    changed here and on the server, the push after the pull was refused again, and stayed refused
    (`_Push.change` never asked whether a record here holds the team's version): now this
    store's version goes to the team as a record of its own."""
    server = start()
    bob = Member(tmp_path, "bob", server.url)
    bob("put", TABS)
    bob("push")
    here, there = TABS + " Always.", TABS + " Except in Go."
    bob("put", "--replace", "1@1", here)
    server.client.put(there, "bob", replacement=replacement("bob", 1, 1))
    refused = run(bob, "push")
    assert refused.returncode == 1 and "bob#1: changed here and on the server" in refused.stderr
    assert bob("pull", "--namespace", "bob").endswith("1 inserted, 0 skipped.\n")
    settled = run(bob, "push")
    assert settled.returncode == 0, settled.stderr
    held = team_of(server)
    assert held[("bob", 1, 2)] == there and sorted(held.values()) == sorted([here, there])


@sqlite_only
@pytest.mark.slow
def test_a_stale_copy_and_the_teams_new_text_held_here_never_block_every_push(
    start: Callable[..., Server], tmp_path: pathlib.Path
) -> None:
    """Two machines of one user share namespace `bob`. The desktop pulls bob#1; the laptop
    replaces it (bob#1 v2); the desktop's agent then stores that same conclusion. The desktop's
    push planned its record as a new team record beside bob#1 v2 (the identity match skipped
    team records any link names, even a stale one) and refused "the same conclusion as bob#1" -
    with `--force` too (`_Push.plan` refuses it whatever `force` says), and a pull cannot help
    (it skips a conclusion the store holds): no push from the desktop could ever succeed."""
    server = start()
    laptop = Member(tmp_path / "laptop", "bob", server.url)
    desktop = Member(tmp_path / "desktop", "bob", server.url)
    newer = TABS + " Always."
    laptop("put", TABS)
    laptop("push")
    desktop("pull", "--namespace", "bob")
    laptop("put", "--replace", "1@1", newer)
    laptop("push")
    desktop("put", newer)
    desktop("pull", "--namespace", "bob")  # skipped: the desktop holds the conclusion
    for argv in (("push",), ("push", "--force")):
        pushed = run(desktop, *argv)
        assert pushed.returncode == 0, (argv, pushed.stderr)
    assert team_of(server) == {("bob", 1, 2): newer}


@sqlite_only
@pytest.mark.slow
def test_push_force_never_gives_a_version_this_store_saw_other_content(
    start: Callable[..., Server], tmp_path: pathlib.Path
) -> None:
    """Bob's pushes took bob#1 to v3. The original's client (whose sync the server must accept
    unguarded) then writes bob#1 back at v1. A `--force` push of bob's next edit replaced the
    team record "at the team's next version": v2, a key that named "Alpha two." when this store
    pushed it. `--force` promises a new version, never a key with other content, so the version
    goes above every one this store saw (`_Push.replace` counted from the team's only)."""
    server = start()
    bob = Member(tmp_path, "bob", server.url)
    bob("put", "Alpha one.")
    bob("push")
    for version, text in ((1, "Alpha two."), (2, "Alpha three.")):
        bob("put", "--replace", f"1@{version}", text)
        bob("push")
    assert team_of(server) == {("bob", 1, 3): "Alpha three."}
    rewritten = {"memories": [snapshot_record(1, 1, "An original client's text.")]}
    server.client.ok("/v1/memories/sync", rewritten, namespace="bob")  # no guard: the original's
    bob("put", "--replace", "1@3", "Alpha four.")
    assert run(bob, "push").returncode == 1  # changed here and on the server
    bob("push", "--force")
    ((key, content),) = team_of(server).items()
    assert content == "Alpha four." and key[2] > 3, key


# ---------------------------------------------------------------- safe pushes: crashes


@sqlite_only
def test_a_push_killed_after_its_sync_then_changed_on_the_server_sends_nothing_twice(
    start: Callable[..., Server], relay_to: Callable[[Server], Relay], tmp_path: pathlib.Path
) -> None:
    """SIGKILL after the sync landed and before the push wrote its links; then bob's agent
    replaces bob#1 in the workspace root. The pending link no longer matches (bob#1 is v2), so
    the next push takes the local record for one never pushed: it sends TABS again, as bob#2,
    beside the replacement that superseded it. Without the crash the same history sends nothing
    (the link says "changed on the server": the team's stands)."""
    server = start()
    relay = relay_to(server)
    bob = Member(tmp_path, "bob", relay.url)
    bob("put", TABS)
    push = subprocess.Popen(bob.command("push"), cwd=bob.base / "home",
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    relay.after["memories/sync"] = lambda: os.kill(push.pid, signal.SIGKILL)
    assert push.wait(120) == -signal.SIGKILL
    push.communicate()
    assert team_of(server) == {("bob", 1, 1): TABS}  # the sync landed
    newer = TABS + " Always."
    server.client.put(newer, "bob", replacement=replacement("bob", 1, 1))
    bob("push")
    assert team_of(server) == {("bob", 1, 2): newer}


@sqlite_only
@pytest.mark.slow
def test_a_refusal_after_a_pass_that_landed_does_not_say_nothing_was_changed(
    start: Callable[..., Server], relay_to: Callable[[Server], Relay], tmp_path: pathlib.Path
) -> None:
    """A push's first pass lands (bob#2 inserted); meanwhile bob replaces #1 here and an agent
    replaces bob#1 there, so the second pass is refused. It said "push refused, nothing was
    changed", but the first pass had changed the namespace."""
    server = start()
    relay = relay_to(server)
    bob = Member(tmp_path, "bob", relay.url)
    bob("put", TABS)
    bob("push")
    bob("put", CHECKLIST)

    def meanwhile() -> None:
        bob("put", "--replace", "1@1", TABS + " Always.")
        server.client.put(TABS + " Except in Go.", "bob", replacement=replacement("bob", 1, 1))

    relay.after["memories/sync"] = meanwhile
    refused = run(bob, "push")
    assert refused.returncode == 1 and "changed here and on the server" in refused.stderr
    assert team_of(server)[("bob", 2, 1)] == CHECKLIST  # the first pass landed
    assert "nothing was changed" not in refused.stderr, refused.stderr


# ---------------------------------------------------------------- safe pushes: links and stores


@sqlite_only
def test_a_store_restored_from_a_backup_deletes_nothing_it_never_held(
    start: Callable[..., Server], tmp_path: pathlib.Path
) -> None:
    """Bob backs up his store, writes one more record and pushes both. His disk fails; he
    restores the backup (restore needs a new, empty store, so the old database is gone; the
    links file beside it stays). The restored store never held bob#2, yet the push deletes it:
    the links say local #2 was pushed as bob#2, and #2 is missing, so "deleted here". The links
    describe a store that no longer exists (local #2 is at or above the restored store's next
    id: this store never handed it out)."""
    server = start()
    bob = Member(tmp_path, "bob", server.url)
    backup = tmp_path / "backup.jsonl"
    bob("put", TABS)
    bob("export", str(backup))
    bob("put", CHECKLIST)
    bob("push")
    remove_the_store(bob)
    bob("restore", str(backup))
    bob("push")
    assert team_of(server) == {("bob", 1, 1): TABS, ("bob", 2, 1): CHECKLIST}


@sqlite_only
@pytest.mark.slow
def test_a_new_store_at_the_same_path_never_replaces_the_old_stores_records(
    start: Callable[..., Server], tmp_path: pathlib.Path
) -> None:
    """The old store pushed TABS as bob#1 (link: local #1 v1). Bob starts over (a new database
    at the same path) and writes a new #1, then replaces it (#1 v2). `_holds` takes any local
    record at a higher version than its link for the linked record "replaced here since", so
    the push replaces bob#1 with the new store's unrelated text - a record this store never
    saw. (And before the new #1 exists, a push from the empty store deletes bob#1.)"""
    server = start()
    bob = Member(tmp_path, "bob", server.url)
    bob("put", TABS)
    bob("push")
    remove_the_store(bob)
    bob("put", CHECKLIST)
    bob("put", "--replace", "1@1", STAGING)
    bob("push")
    # a new team record keeps its local version (#1 v2 becomes bob#2 v2), as a push keeps ids
    assert team_of(server) == {("bob", 1, 1): TABS, ("bob", 2, 2): STAGING}
