"""Two checkouts' team servers side by side over HTTP, on one database: warm scans, interleaved.

    python bench/server_ab.py BEFORE [AFTER] [--backend sqlite|postgres] [--namespaces N]
        [--rounds R] [--requests K]

BEFORE and AFTER are checkouts (each with `tactmem.py` and `server/tactmem_server.py`; AFTER
defaults to this one). One database (an SQLite file, or a PostgreSQL cluster started as
`server_bench.py` starts one) is filled once with N namespaces (default 50) of `bench.py`'s
corpus, through BEFORE's server. Each round starts one side's server on it, then the other's
(the order alternating), each from its own checkout: its first scan sent as soon as it says it
listens, ten untimed scans from 8 clients (every weight worked out), then K scans from each of
1 and 8 clients (`server_bench.py`'s clients and queries). Medians over the rounds, with
after/before. Run it on an otherwise idle machine: both sides share its cores with the clients.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for `bench` and `server_bench`

import server_bench

import bench

HERE = Path(__file__).resolve().parent
FIGURES = ("first scan", "1 client p50", "8 clients p50", "8 clients scans/s")


def one_side(
    checkout: str, database: list[str], credentials: str, namespaces: list[str], requests: int
) -> dict[str, float]:
    queries = bench.build_queries(random.Random(bench.SEED))
    process, url, _ = server_bench.start_server(database, credentials, checkout)
    try:
        began = time.perf_counter()
        server_bench.Connection(url, namespaces[0]).post(
            "/v1/memories/scan", {"query": queries[0], "limit": 5}
        )
        first = (time.perf_counter() - began) * 1000
        server_bench._scan_figures(url, namespaces, queries, 8, 10)
        one = server_bench._scan_figures(url, namespaces, queries, 1, requests)
        eight = server_bench._scan_figures(url, namespaces, queries, 8, requests)
    finally:
        server_bench.stop_server(process)
    return dict(zip(FIGURES, (first, one["p50"], eight["p50"], eight["rps"]), strict=True))


def compare(
    checkouts: list[str], database: list[str], count: int, rounds: int, requests: int
) -> None:
    namespaces = [f"ns{n}" for n in range(count)]
    with tempfile.TemporaryDirectory() as directory:
        credentials = os.path.join(directory, "credentials.toml")
        entry = '[[credentials]]\nnamespace = "{0}"\nrole = "writer"\ntoken = "{1}"\n'
        Path(credentials).write_text(
            "".join(entry.format(ns, server_bench.TOKEN.format(ns)) for ns in namespaces)
        )
        os.chmod(credentials, 0o600)
        process, url, _ = server_bench.start_server(database, credentials, checkouts[0])
        try:
            for n, ns in enumerate(namespaces):
                corpus = bench.build_corpus(random.Random(bench.SEED + n))
                server_bench.Connection(url, ns).post(
                    "/v1/memories/sync", {"memories": server_bench.snapshot(corpus)}
                )
        finally:
            server_bench.stop_server(process)
        found: dict[str, list[dict[str, float]]] = {checkout: [] for checkout in checkouts}
        for index in range(rounds):
            for checkout in checkouts if index % 2 == 0 else checkouts[::-1]:
                found[checkout].append(
                    one_side(checkout, database, credentials, namespaces, requests)
                )
            print(f"round {index + 1} of {rounds} done", file=sys.stderr, flush=True)
    print(f"| figure | {' | '.join(checkouts)} | after/before |")
    print("|---|" + "---|" * (len(checkouts) + 1))
    for figure in FIGURES:
        medians = [statistics.median(r[figure] for r in found[c]) for c in checkouts]
        shown = " | ".join(f"{m:.2f}" for m in medians)
        print(f"| {figure} | {shown} | {medians[-1] / medians[0]:.2f} |")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after", nargs="?", default=str(HERE.parent))
    parser.add_argument("--backend", choices=("sqlite", "postgres"), default="postgres")
    parser.add_argument("--namespaces", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--requests", type=int, default=60, help="scans per client, per round")
    options = parser.parse_args(argv)
    checkouts = [os.path.abspath(options.before), os.path.abspath(options.after)]
    base = tempfile.mkdtemp(prefix="tactmem-server-ab-")
    try:
        os.chmod(base, 0o755)
        if options.backend == "sqlite":
            database = ["--sqlite", os.path.join(base, "team.sqlite3")]
            compare(checkouts, database, options.namespaces, options.rounds, options.requests)
        else:
            with server_bench.cluster(base) as sockets:
                database = ["--postgres", server_bench.create_database(sockets, "ab")]
                compare(checkouts, database, options.namespaces, options.rounds, options.requests)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
