"""Team server benchmark: tactmem-server's scan and put latency and throughput.

Run by hand, never as a timed test (SPEC §8):

    python bench/server_bench.py            # 1-200 namespaces of 512 records, both backends
    python bench/server_bench.py --quick    # fewer requests: too few samples to settle a figure
    python bench/server_bench.py --quick --puts   # only puts, their anchor and breakdown

For each backend (an SQLite file; a PostgreSQL cluster this script starts with initdb and pg_ctl)
and for 1, 10, 50 and 200 namespaces filled with `bench.py`'s corpus (512 records, about 255 KiB
each, one seed per namespace), one server process on 127.0.0.1 answers scans (`bench.py`'s
queries) and puts (compare-and-swap replaces of each client's own records, so the bounds never
refuse one), each client on its own keep-alive HTTP connection: at 1 and 50 namespaces with 1, 8
and 32 concurrent clients, at 10 and 200 (the sweep) scans with 8 (200 namespaces always with
`--quick`'s request count). At 8 clients the scans run twice: "scan" follows the puts, so a
scan pays for the first use of each of its terms since the corpus last changed (`Corpus.rank`
works a term's weights out once per change), and "scan again" repeats the same requests with
every weight already worked out (one untimed scan after the syncs indexes every record, so no
"scan" row holds that). It prints p50 and p95 latency and throughput. The anchor is
PostgreSQL's own full-text search over the same records: `ts_rank` top 5 of a GIN-indexed
`tsvector`, the query's terms joined by OR, through psycopg directly (no HTTP, no
authentication, no telemetry write), at 1 and 50 namespaces.

The put anchor is the database's own cost of a write: one transaction of a bare INSERT of a
fresh row and an UPDATE of its namespace's counter, on connections as the server holds them
(PostgreSQL: one per client, `BEGIN` and `COMMIT` through psycopg; SQLite: one connection in WAL
with `synchronous = FULL`, one transaction at a time), at 1, 8 and 32 clients. For each
PostgreSQL put level, `pg_stat_statements` (the cluster preloads it) says what the database ran
per put: each statement's calls and execution time, and their sum beside the put's p50 (the
rest is round trips, waiting for the GIL and Python). `--puts` measures only the puts, their
anchors and that breakdown, at 1 namespace (about a minute).

Then the server is stopped and started again on the same database: the start-up table shows the
time from the process's start to its "listening" line, its first scan (one client, sent at
once) and the p95 of its first ten. Last, the ratios of one run: warm scan p50 at 50 namespaces over
1 (8 clients), the first scan after the restart over a warm one-client scan, and a one-client
scan over HTTP at 1 namespace over an in-process `Store.scan` of the same 512 records.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import http.client
import json
import math
import os
import pwd
import random
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for `bench`

import bench
import tactmem

CLIENTS: Final = (1, 8, 32)
NAMESPACES: Final = (1, 10, 50, 200)
FULL: Final = (1, 50)  # namespace counts measured at every client count, with puts and the anchor
SWEEP_CLIENTS: Final = 8
TOKEN: Final = "bench-token-{}-0000000000000000"


def _postgres_binary(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    path = found[-1] if found else shutil.which(name)
    if path is None:
        raise SystemExit(f"server_bench: {name} not found (apt-get install postgresql)")
    return path


@contextlib.contextmanager
def cluster(base: str) -> Iterator[str]:
    """A throwaway PostgreSQL cluster on a Unix socket in `base`; yields the socket directory."""
    user: dict[str, Any] = {}
    if os.geteuid() == 0:  # PostgreSQL refuses to run as root
        nobody = pwd.getpwnam("nobody")
        os.chown(base, nobody.pw_uid, nobody.pw_gid)
        user = {"user": nobody.pw_uid, "group": nobody.pw_gid}
    data, sockets, log = (os.path.join(base, name) for name in ("data", "sockets", "log"))
    pg_ctl = _postgres_binary("pg_ctl")

    def run(*command: str) -> None:
        subprocess.run(command, **user, cwd=base, check=True, capture_output=True, timeout=120)

    run(
        _postgres_binary("initdb"),
        "-D",
        data,
        "-U",
        "postgres",
        "--auth=trust",
        "-E",
        "UTF8",
        "--no-locale",
    )
    run("mkdir", sockets)
    options = f"-k {sockets} -c listen_addresses='' -c max_connections=200"
    options += " -c shared_preload_libraries=pg_stat_statements"  # the put breakdown's source
    run(pg_ctl, "-D", data, "-l", log, "-o", options, "-w", "start")
    try:
        yield sockets
    finally:
        run(pg_ctl, "-D", data, "-m", "fast", "stop")


def create_database(sockets: str, name: str) -> str:
    import psycopg

    with psycopg.connect(f"host={sockets} user=postgres dbname=postgres", autocommit=True) as db:
        db.execute(f'CREATE DATABASE "{name}" ENCODING UTF8 TEMPLATE template0')
    return f"host={sockets} user=postgres dbname={name}"


class Connection:
    """One client's keep-alive HTTP connection to the server."""

    def __init__(self, url: str, namespace: str) -> None:
        parts = urlsplit(url)
        self.http = http.client.HTTPConnection(parts.hostname or "", parts.port or 80, timeout=120)
        self.headers = {
            "authorization": f"Bearer {TOKEN.format(namespace)}",
            "x-tact-memory-namespace": namespace,
            "content-type": "application/json",
        }

    def post(self, path: str, body: object) -> Any:
        self.http.request("POST", path, json.dumps(body).encode(), self.headers)
        response = self.http.getresponse()
        data = response.read()
        if response.status != 200:
            raise RuntimeError(f"{path}: {response.status} {data!r}")
        return json.loads(data)


def start_server(
    arguments: list[str], credentials: str, checkout: str | None = None
) -> tuple[subprocess.Popen[str], str, float]:
    """A server process (from `checkout`'s `tactmem.py` and `server/`, when given), its URL,
    and the seconds from its start to its "listening" line."""
    command = [sys.executable, "-m", "tactmem_server", *arguments, "--credentials", credentials]
    env = None
    if checkout is not None:
        env = dict(os.environ, PYTHONPATH=f"{checkout}{os.pathsep}{checkout}/server")
    began = time.perf_counter()
    process = subprocess.Popen(
        [*command, "--port", "0"], stderr=subprocess.PIPE, text=True, env=env, cwd=checkout
    )
    assert process.stderr is not None
    line = process.stderr.readline()
    listening = time.perf_counter() - began
    threading.Thread(target=process.stderr.read, daemon=True).start()  # keep the pipe drained
    return process, json.loads(line)["url"], listening


def stop_server(process: subprocess.Popen[str]) -> None:
    process.terminate()
    process.wait(60)


def snapshot(contents: Sequence[str]) -> list[dict[str, Any]]:
    return [
        {
            "key": {"id": doc_id, "version": 1},
            "content": content,
            "created_at_ms": 1,
            "updated_at_ms": 1,
            "scan_count": 0,
            "use_count": 1,
        }
        for doc_id, content in enumerate(contents, 1)
    ]


def measure(clients: int, requests: int, work: Callable[[int, int], object]) -> dict[str, float]:
    """Run `work(client, n)` `requests` times on each of `clients` threads at once."""
    latencies: list[float] = []
    lock = threading.Lock()
    barrier = threading.Barrier(clients)

    failures = 0

    def client(index: int) -> None:
        nonlocal failures
        barrier.wait()
        mine, failed = [], 0
        for n in range(requests):
            began = time.perf_counter()
            try:
                work(index, n)
            except RuntimeError:  # an answer other than 200 (a 503 past the store timeout)
                failed += 1
                continue
            mine.append(time.perf_counter() - began)
        with lock:
            latencies.extend(mine)
            failures += failed

    began = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    wall = time.perf_counter() - began
    if len(latencies) < 2:
        return {"p50": math.nan, "p95": math.nan, "rps": 0.0, "failed": failures}
    cuts = statistics.quantiles(latencies, n=20)
    return {
        "p50": statistics.median(latencies) * 1000,
        "p95": cuts[18] * 1000,
        "rps": len(latencies) / wall,
        "failed": failures,
    }


Row = tuple[str, ...]
Figures = dict[str, float]


Statements = list[tuple[str, int, float]]  # text, calls, total execution ms


def bench_server(
    backend: str,
    arguments: list[str],
    corpora: list[list[str]],
    queries: list[str],
    rounds: int,
    statements: Callable[[bool], Statements] | None = None,
    *,
    puts_only: bool = False,
) -> tuple[list[Row], dict[tuple[str, int], Figures], dict[int, Statements]]:
    """The rows of one backend at one namespace count, the figures the ratios need, by (what,
    clients): ("scan", n) warm scans, ("put", n), ("first", 1) the first scan after a restart;
    and with `statements` (reset with True, read with False) what the database ran for each
    put level, by clients."""
    namespaces = [f"ns{n}" for n in range(len(corpora))]
    full = len(corpora) in FULL
    figures: dict[tuple[str, int], Figures] = {}
    ran: dict[int, Statements] = {}
    with tempfile.TemporaryDirectory() as directory:
        credentials = Path(directory) / "credentials.toml"
        entry = '[[credentials]]\nnamespace = "{0}"\nrole = "writer"\ntoken = "{1}"\n'
        credentials.write_text("".join(entry.format(ns, TOKEN.format(ns)) for ns in namespaces))
        credentials.chmod(0o600)
        process, url, _ = start_server(arguments, str(credentials))
        rows = []
        try:
            for ns, contents in zip(namespaces, corpora, strict=True):
                Connection(url, ns).post("/v1/memories/sync", {"memories": snapshot(contents)})
            # untimed: the first scan after the syncs indexes every record (the start-up table
            # times that), so no "scan" row below holds it
            Connection(url, namespaces[0]).post("/v1/memories/scan", {"query": "x", "limit": 5})
            for clients in CLIENTS if full else (SWEEP_CLIENTS,):
                if not puts_only:
                    scans = _scan_figures(url, namespaces, queries, clients, rounds)
                    figures["scan", clients] = scans
                    rows.append(_row(backend, len(namespaces), "scan", clients, scans))
                if not puts_only and clients == SWEEP_CLIENTS:
                    again = _scan_figures(url, namespaces, queries, clients, rounds)
                    rows.append(_row(backend, len(namespaces), "scan again", clients, again))
                if full:
                    ready = functools.partial(statements, True) if statements else None
                    puts = _put_figures(url, namespaces, clients, rounds, ready)
                    if statements:
                        ran[clients] = statements(False)
                    figures["put", clients] = puts
                    rows.append(_row(backend, len(namespaces), "put", clients, puts))
        finally:
            stop_server(process)
        if puts_only:
            return rows, figures, ran
        process, url, listening = start_server(arguments, str(credentials))
        try:
            first = _first_scans(url, namespaces[0], queries)
        finally:
            stop_server(process)
    figures["first", 1] = {**first, "listening": listening * 1000}
    return rows, figures, ran


def _first_scans(url: str, namespace: str, queries: list[str]) -> Figures:
    """A freshly started server's first ten scans from one client: the first, and the p95."""
    connection = Connection(url, namespace)
    latencies = []
    for query in queries[:10]:
        began = time.perf_counter()
        try:
            connection.post("/v1/memories/scan", {"query": query, "limit": 5})
        except RuntimeError:  # a 503: counted at what it took
            connection = Connection(url, namespace)
        latencies.append((time.perf_counter() - began) * 1000)
    return {"first": latencies[0], "p95": statistics.quantiles(latencies, n=20)[18]}


def _scan_figures(
    url: str, namespaces: list[str], queries: list[str], clients: int, rounds: int
) -> Figures:
    connections = [Connection(url, namespaces[i % len(namespaces)]) for i in range(clients)]

    def scan(client: int, n: int) -> None:
        query = queries[(client * 7 + n) % len(queries)]
        connections[client].post("/v1/memories/scan", {"query": query, "limit": 5})

    return measure(clients, rounds, scan)


def _put_figures(
    url: str,
    namespaces: list[str],
    clients: int,
    rounds: int,
    ready: Callable[[], object] | None = None,
) -> Figures:
    """Each client replaces its own records (ids client+1, client+1+32, ...) of its namespace,
    with fresh text no larger than the old, reading the versions it replaces first (then
    `ready` is called, before the first put)."""
    connections = [Connection(url, namespaces[i % len(namespaces)]) for i in range(clients)]
    writers = [bench._Writer(random.Random(bench.SEED + 7 + i)) for i in range(clients)]
    keys: dict[int, list[tuple[dict[str, Any], str]]] = {}
    for client in range(clients):
        ids = list(range(client // len(namespaces) + 1, 513, 32))
        found = connections[client].post("/v1/memories/read", {"ids": ids})["memories"]
        keys[client] = [(record["key"], record["content"]) for record in found]
    if ready:
        ready()

    def put(client: int, n: int) -> None:
        mine = keys[client]
        key, old = mine[n % len(mine)]
        content = bench.alternate_content(writers[client], old)
        body = {"content": content, "replacement": key}
        record = connections[client].post("/v1/memories/put", body)["memory"]
        mine[n % len(mine)] = (record["key"], content)

    return measure(clients, rounds, put)


def _row(
    backend: str, namespaces: int, operation: str, clients: int, f: dict[str, float]
) -> tuple[str, ...]:
    return (
        backend,
        str(namespaces),
        operation,
        str(clients),
        f"{f['p50']:.2f}",
        f"{f['p95']:.2f}",
        f"{f['rps']:.0f}" + (f" ({f['failed']:.0f} failed)" if f["failed"] else ""),
    )


def bench_anchor(
    dsn: str, corpora: list[list[str]], queries: list[str], rounds: int
) -> list[tuple[str, ...]]:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as db:
        db.execute(
            "CREATE TABLE docs (namespace TEXT, id BIGINT, content TEXT, tsv tsvector"
            " GENERATED ALWAYS AS (to_tsvector('simple', content)) STORED)"
        )
        with db.cursor() as cursor:
            cursor.executemany(
                "INSERT INTO docs (namespace, id, content) VALUES (%s, %s, %s)",
                [
                    (f"ns{n}", i, text)
                    for n, texts in enumerate(corpora)
                    for i, text in enumerate(texts, 1)
                ],
            )
        db.execute("CREATE INDEX docs_tsv ON docs USING GIN (tsv)")
        db.execute("ANALYZE docs")
    terms = [" or ".join(sorted(set(tactmem.tokenize(query)))) or "x" for query in queries]
    rows = []
    for clients in CLIENTS:
        connections = [psycopg.connect(dsn, autocommit=True) for _ in range(clients)]

        def search(client: int, n: int, connections: list[Any] = connections) -> None:
            connections[client].execute(
                "SELECT namespace, id FROM docs, websearch_to_tsquery('simple', %s) AS q"
                " WHERE tsv @@ q ORDER BY ts_rank(tsv, q) DESC, namespace, id LIMIT 5",
                (terms[(client * 7 + n) % len(terms)],),
            ).fetchall()

        rows.append(
            _row("ts_rank", len(corpora), "scan", clients, measure(clients, rounds, search))
        )
        for connection in connections:
            connection.close()
    return rows


_ANCHOR_SCHEMA: Final = (
    "CREATE TABLE memory_namespaces (namespace TEXT PRIMARY KEY, changes BIGINT)",
    "CREATE TABLE memories (namespace TEXT REFERENCES memory_namespaces, id BIGINT,"
    " version BIGINT, content TEXT, identity TEXT, created_at_ms BIGINT, updated_at_ms BIGINT,"
    " scan_count BIGINT, use_count BIGINT, PRIMARY KEY (namespace, id),"
    " UNIQUE (namespace, identity))",
)
_ANCHOR_PUT: Final = (
    "INSERT INTO memories (namespace, id, version, content, identity, created_at_ms,"
    " updated_at_ms, scan_count, use_count) VALUES (?, ?, 1, ?, ?, 1, 1, 0, 1)",
    "UPDATE memory_namespaces SET changes = changes + 1 WHERE namespace = ?",
)


def bench_put_anchor(
    backend: str, where: str, texts: list[str], namespaces: int, rounds: int
) -> dict[int, Figures]:
    """The floor of a put: one transaction of a bare INSERT of a fresh row and an UPDATE of its
    namespace's counter, by client count, on connections as the server holds them: PostgreSQL
    (`where` a DSN) through psycopg, a connection per client (`BEGIN`, the two, `COMMIT`);
    SQLite (`where` a file) one connection in WAL with `synchronous = FULL`, one transaction at
    a time (`BEGIN IMMEDIATE` under a lock)."""
    if backend == "postgres":
        import psycopg

        def connect() -> Any:
            return psycopg.connect(where, autocommit=True)

        mark, begin = "%s", "BEGIN"
        lock: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
    else:
        shared = sqlite3.connect(where, isolation_level=None, check_same_thread=False)
        shared.execute("PRAGMA journal_mode = WAL")
        shared.execute("PRAGMA synchronous = FULL")

        def connect() -> Any:
            return shared

        mark, begin, lock = "?", "BEGIN IMMEDIATE", threading.Lock()  # the engine's lock
    insert, update = (sql.replace("?", mark) for sql in _ANCHOR_PUT)
    setup = connect()
    for statement in _ANCHOR_SCHEMA:
        setup.execute(statement)
    for n in range(namespaces):
        setup.execute(f"INSERT INTO memory_namespaces VALUES ({mark}, 0)", (f"ns{n}",))
    figures = {}
    for clients in CLIENTS:
        connections = [connect() for _ in range(clients)]

        def put(
            client: int, n: int, connections: list[Any] = connections, level: int = clients
        ) -> None:
            namespace, doc_id = f"ns{client % namespaces}", (level * 100 + client) * 10**6 + n
            text = f"{doc_id} {texts[(client * 7 + n) % len(texts)]}"  # a fresh identity
            connection = connections[client]
            with lock:
                connection.execute(begin)
                connection.execute(insert, (namespace, doc_id, text, text))
                connection.execute(update, (namespace,))
                connection.execute("COMMIT")

        figures[clients] = measure(clients, rounds, put)
        for connection in connections if backend == "postgres" else ():
            connection.close()
    setup.close()
    return figures


def _statements(sockets: str, database: str, reset: bool) -> Statements:
    """What PostgreSQL ran for `database` since the last reset (`pg_stat_statements`): each
    statement's text, calls and total execution time in ms, longest first."""
    import psycopg

    with psycopg.connect(f"host={sockets} user=postgres dbname=postgres", autocommit=True) as db:
        db.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        if reset:
            db.execute("SELECT pg_stat_statements_reset()")
            return []
        return db.execute(
            "SELECT query, calls, total_exec_time FROM pg_stat_statements s"
            " JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = %s"
            " ORDER BY total_exec_time DESC",
            (database,),
        ).fetchall()


def bench_store(contents: list[str], queries: list[str], rounds: int) -> Figures:
    """In-process `Store.scan` of the same records, one caller: the floor of a one-client scan."""
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "memory.sqlite3"
        bench.fill(path, contents)
        with tactmem.Store(path) as store:
            store.scan(queries[0])  # the first scan tokenizes the corpus: a warm figure
            return measure(1, rounds, lambda _, n: store.scan(queries[n % len(queries)]))


def ratios(figures: dict[tuple[str, int], dict[tuple[str, int], Figures]], store: Figures) -> None:
    """The issue's ratios, from this run's figures."""
    print()
    for backend in ("sqlite", "postgres"):
        warm = {
            count: figures[backend, count]["scan", SWEEP_CLIENTS]["p50"] for count in NAMESPACES
        }
        for count in NAMESPACES[1:]:
            print(
                f"{backend}: warm scan p50, {SWEEP_CLIENTS} clients, {count} namespaces / 1:"
                f" {warm[count] / warm[1]:.2f} (target at 50: <= 2)"
            )
        for count in FULL:
            first = figures[backend, count]["first", 1]["first"]
            one = figures[backend, count]["scan", 1]["p50"]
            print(
                f"{backend}: first scan after a restart / warm one-client scan p50, {count}"
                f" namespaces: {first / one:.2f} (target <= 10)"
            )
        http = figures[backend, 1]["scan", 1]["p50"]
        print(
            f"{backend}: one-client HTTP scan p50 / in-process Store.scan p50 ({store['p50']:.2f}"
            f" ms), 1 namespace: {http / store['p50']:.2f} (target <= 3)"
        )


def put_ratios(
    figures: dict[tuple[str, int], dict[tuple[str, int], Figures]],
    anchors: dict[tuple[str, int], dict[int, Figures]],
) -> None:
    """A put over the bare INSERT+UPDATE transaction on the same backend, at each client count."""
    print()
    for (backend, count), by_clients in sorted(anchors.items()):
        for clients, anchor in sorted(by_clients.items()):
            put = figures[backend, count]["put", clients]["p50"]
            target = " (target <= 2)" if (backend, clients) == ("postgres", SWEEP_CLIENTS) else ""
            print(
                f"{backend}: put p50 / bare INSERT+UPDATE p50, {count} namespace(s), {clients}"
                f" clients: {put / anchor['p50']:.2f}{target}"
            )


def breakdown(
    ran: dict[tuple[int, int], Statements],
    figures: dict[tuple[str, int], dict[tuple[str, int], Figures]],
    rounds: int,
) -> None:
    """Where a PostgreSQL put's time goes: for each put level, the statements the database ran
    (`pg_stat_statements`), per put: calls and execution time, and what the database's own
    execution adds up to beside the put's p50 (the rest is round trips, waiting and Python)."""
    for (count, clients), statements in sorted(ran.items()):
        puts = clients * rounds
        p50 = figures["postgres", count]["put", clients]["p50"]
        total = sum(ms for _, _, ms in statements) / puts
        trips = sum(calls for _, calls, _ in statements) / puts
        print(
            f"\npostgres put, {count} namespace(s), {clients} clients: p50 {p50:.2f} ms; the"
            f" database executed {total:.2f} ms in {trips:.1f} statements per put"
        )
        print("| statement | calls per put | ms per put |\n|---|---|---|")
        for text, calls, ms in statements[:8]:
            shown = " ".join(text.split())[:90].replace("|", "\\|")
            print(f"| `{shown}` | {calls / puts:.2f} | {ms / puts:.3f} |")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests per client")
    parser.add_argument(
        "--puts", action="store_true", help="only puts, their anchor and breakdown, 1 namespace"
    )
    arguments = parser.parse_args(argv)
    rounds = 8 if arguments.quick else 40
    queries = bench.build_queries(random.Random(bench.SEED))
    rows: list[tuple[str, ...]] = []
    figures: dict[tuple[str, int], dict[tuple[str, int], Figures]] = {}
    ran: dict[tuple[int, int], Statements] = {}
    anchors: dict[tuple[str, int], dict[int, Figures]] = {}
    base = tempfile.mkdtemp(prefix="tactmem-server-bench-")
    try:
        os.chmod(base, 0o755)
        store = (
            {}
            if arguments.puts
            else bench_store(bench.build_corpus(random.Random(bench.SEED)), queries, rounds)
        )
        with cluster(base) as sockets:
            for count in FULL[:1] if arguments.puts else NAMESPACES:
                corpora = [bench.build_corpus(random.Random(bench.SEED + n)) for n in range(count)]
                some = 8 if count == NAMESPACES[-1] else rounds  # the largest: --quick's count
                sqlite = ["--sqlite", os.path.join(base, f"team-{count}.sqlite3")]
                database = f"team_{count}"
                postgres = ["--postgres", create_database(sockets, database)]
                for backend, where in (("sqlite", sqlite), ("postgres", postgres)):
                    statements = None
                    if backend == "postgres":
                        statements = functools.partial(_statements, sockets, database)
                    found, figures[backend, count], puts = bench_server(
                        backend, where, corpora, queries, some, statements, puts_only=arguments.puts
                    )
                    rows += found
                    ran.update({(count, clients): done for clients, done in puts.items()})
                    for row in found:  # as it goes: a long run shows where it is
                        print("| " + " | ".join(row) + " |", file=sys.stderr, flush=True)
                if count in FULL:
                    if not arguments.puts:
                        anchor = create_database(sockets, f"anchor_{count}")
                        rows += bench_anchor(anchor, corpora, queries, rounds)
                    for backend, floor in (
                        ("sqlite", os.path.join(base, f"anchor-{count}.sqlite3")),
                        ("postgres", create_database(sockets, f"put_anchor_{count}")),
                    ):
                        anchors[backend, count] = bench_put_anchor(
                            backend, floor, corpora[0], count, rounds
                        )
                        rows += [
                            _row(f"{backend} INSERT+UPDATE", count, "put", clients, measured)
                            for clients, measured in anchors[backend, count].items()
                        ]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    header = ("backend", "namespaces", "operation", "clients", "p50 ms", "p95 ms", "req/s")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in sorted(rows, key=lambda r: (int(r[1]), r[2], int(r[3]), r[0])):
        print("| " + " | ".join(row) + " |")
    if not arguments.puts:
        print(
            "\n| backend | namespaces | start to listening ms | first scan ms | p95 of first 10 |"
        )
        print("|---|---|---|---|---|")
        for (backend, count), measured in sorted(figures.items(), key=lambda item: item[0][::-1]):
            start = measured["first", 1]
            print(
                f"| {backend} | {count} | {start['listening']:.0f} | {start['first']:.2f}"
                f" | {start['p95']:.2f} |"
            )
        ratios(figures, store)
    put_ratios(figures, anchors)
    breakdown(ran, figures, rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
