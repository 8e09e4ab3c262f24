"""Two checkouts' team servers side by side, in process: a team's scans warm and after a put.

    python bench/team_ab.py BEFORE [AFTER] [--namespaces N] [--rounds R]

BEFORE and AFTER are checkouts (each with `tactmem.py` and `server/tactmem_server.py`; AFTER
defaults to this one). For each side, one SQLite team database of N namespaces (default 50) of
`bench.py`'s corpus (512 records each, one seed per namespace) is filled once by `sync`. Each
round runs one fresh process per side (the order alternating), which opens a `TeamStore` on its
side's database, builds the corpus (`warm`), scans `bench.py`'s 56 queries once, then times:

- "warm": the 56 queries twice more (p50 ms; "warm CPU" is the process's CPU time per scan);
- "after put": each query right after a replace of one record in the first namespace, which
  changes the corpus, so the scan pays what a change costs (p50 ms); "put" is that replace;
- "after 56 puts": one scan after 56 replaces of other records of that namespace with
  `bench.py`'s text of their size, no scan between (what the first scan after a burst of
  writes pays: each of the 56 leaves the corpus and comes back with new terms).

No HTTP, no authentication: the store's own work, which 8 clients queue behind on one GIL
(`server_bench.py` times the server). Medians over the rounds are printed with after/before.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
FIGURES = ("warm", "warm CPU", "after put", "put", "after 56 puts")


def child(database: str, namespaces: int) -> dict[str, float]:
    """One side's figures (its directories first on `sys.path`, from PYTHONPATH)."""
    import bench
    import tactmem

    tactmem_server: Any = importlib.import_module("tactmem_server")  # the side's, untyped

    store = tactmem_server.TeamStore(tactmem_server.SqliteEngine(database))
    now, later = tactmem.core.now_ms(), time.monotonic() + 3600
    if not os.path.exists(database + ".filled"):
        for n in range(namespaces):
            texts = bench.build_corpus(random.Random(bench.SEED + n))
            records = [
                (
                    tactmem_server.WireKey(None, i, 1),
                    tactmem.Record(tactmem.Key(i, 1), text, 1, 1, None, 0, None, 1, None),
                )
                for i, text in enumerate(texts, 1)
            ]
            store.sync(
                f"ns{n:03d}", tactmem_server.check_sync({"memories": records}, now), now, later
            )
        Path(database + ".filled").touch()
    store.warm(later)
    queries = bench.build_queries(random.Random(bench.SEED))
    terms = [tactmem_server.check_scan({"query": query, "limit": 5})[0] for query in queries]

    def timed(operation: Callable[[], object]) -> float:
        began = time.perf_counter()
        operation()
        return time.perf_counter() - began

    def scan(query: Sequence[str]) -> Callable[[], object]:
        return lambda: store.scan(query, 5, now, time.monotonic() + 60)

    for query in terms:
        store.scan(query, 5, now, later)
    cpu = time.process_time()
    warm = [timed(scan(query)) for query in terms for _ in range(2)]
    warm_cpu = (time.process_time() - cpu) / len(warm)
    versions = {
        memory["key"]["id"]: memory["key"]["version"]
        for memory in store.list(now, later)
        if memory["key"]["namespace"] == "ns000"
    }
    rng, after, puts = random.Random(7), [], []
    for i, query in enumerate(terms, 1):
        text = f"note {i} {rng.random()} about {' '.join(rng.sample(query, min(4, len(query))))}"
        key = tactmem_server.WireKey("ns000", i, versions[i])
        put = tactmem_server.check_put({"content": text, "replacement": key}, "ns000", now)
        puts.append(timed(functools.partial(store.put, "ns000", put, time.monotonic() + 60)))
        after.append(timed(scan(query)))
    writer = bench._Writer(random.Random(bench.SEED + 7))
    for memory in [m for m in store.list(now, later) if m["key"]["namespace"] == "ns000"][56:112]:
        text = bench.alternate_content(writer, memory["content"])  # a burst of puts, one scan
        key = tactmem_server.WireKey("ns000", memory["key"]["id"], memory["key"]["version"])
        put = tactmem_server.check_put({"content": text, "replacement": key}, "ns000", now)
        store.put("ns000", put, later)
    burst = timed(scan(terms[0]))
    store.close()
    return {
        "warm": statistics.median(warm) * 1e3,
        "warm CPU": warm_cpu * 1e3,
        "after put": statistics.median(after) * 1e3,
        "put": statistics.median(puts) * 1e3,
        "after 56 puts": burst * 1e3,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path, nargs="?", default=HERE.parent)
    parser.add_argument("--namespaces", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    arguments = parser.parse_args(argv)
    if arguments.child:
        print(json.dumps(child(arguments.child[0], int(arguments.child[1]))))
        return 0
    sides = {"before": arguments.before.resolve(), "after": arguments.after.resolve()}
    directory = tempfile.mkdtemp(prefix="tactmem-team-ab-")
    found: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
    for round_ in range(arguments.rounds):
        for name in list(sides) if round_ % 2 == 0 else list(sides)[::-1]:
            side = sides[name]
            path = os.pathsep.join([str(side), str(side / "server"), str(side / "bench")])
            command = [sys.executable, str(Path(__file__).resolve()), str(side), "--child"]
            command += [os.path.join(directory, f"{name}.sqlite3"), str(arguments.namespaces)]
            ran = subprocess.run(
                command, env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True
            )
            if ran.returncode:
                print(ran.stderr[-4000:], file=sys.stderr)
                return 1
            found[name].append(json.loads(ran.stdout))
            print(f"round {round_ + 1} {name}: {ran.stdout.strip()}", flush=True)
    medians = {
        name: {f: statistics.median(r[f] for r in rs) for f in FIGURES}
        for name, rs in found.items()
    }
    print(f"{arguments.namespaces} namespaces x 512, medians of {arguments.rounds} rounds (ms):")
    for figure in FIGURES:
        before, after = medians["before"][figure], medians["after"][figure]
        ratio = after / before
        print(f"  {figure:13} before {before:8.2f}  after {after:8.2f}  after/before {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
