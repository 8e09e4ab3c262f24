"""Two checkouts of tactmem side by side, interleaved: before and after a change on a hot path.

    python bench/ab.py BEFORE [AFTER] [--rounds N]

BEFORE and AFTER are directories holding a `tactmem.py` (AFTER defaults to this checkout; a
worktree of the old commit is the usual BEFORE: `git worktree add --detach /tmp/before main`).
Both load the same full-capacity corpus that `bench.py` builds. Rounds alternate which side goes
first. It prints p50s and the after/before ratio of

- a fresh process's import and first scan (the `bench.py` script, run with the side's directory
  as its working directory, so that side's `tactmem.py` is the one imported);
- `Store.put` of a record's content right after deleting it, in one process holding both sides;
- `find_secret` over every record of the corpus.

Nothing here is a target: ratios are for a change's note. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent


def load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def alternate(
    rounds: int, sides: Sequence[str], step: Callable[[str, int], float]
) -> dict[str, float]:
    """The p50 of `step(side, round)` per side, the order of the sides flipping every round."""
    samples: dict[str, list[float]] = {side: [] for side in sides}
    for index in range(rounds):
        for side in sides if index % 2 == 0 else list(reversed(sides)):
            samples[side].append(step(side, index))
    return {side: statistics.median(values) for side, values in samples.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path, nargs="?", default=HERE.parent)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args(argv)
    dirs = {"before": args.before.resolve(), "after": args.after.resolve()}
    for side, directory in dirs.items():
        if not (directory / "tactmem.py").is_file():
            parser.error(f"{side}: no tactmem.py in that directory")
    bench = load("tactmem_bench", HERE / "bench.py")
    rng = random.Random(bench.SEED)
    texts, queries = bench.build_corpus(rng), bench.build_queries(rng)
    modules = {
        side: load(f"tactmem_{side}", directory / "tactmem.py") for side, directory in dirs.items()
    }
    work = Path(
        tempfile.mkdtemp(
            prefix="tactmem-ab-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None
        )
    )
    try:
        report(args.rounds, dirs, modules, bench, texts, queries, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def report(
    rounds: int,
    dirs: dict[str, Path],
    modules: dict[str, ModuleType],
    bench: ModuleType,
    texts: list[str],
    queries: list[str],
    work: Path,
) -> None:
    sides = list(dirs)
    stores = {side: modules[side].Store(work / f"{side}.sqlite3") for side in sides}
    keys = {side: [stores[side].put(text).key for text in texts] for side in sides}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    processes: dict[str, dict[str, list[float]]] = {
        side: {"import": [], "scan": []} for side in sides
    }

    def fresh(side: str, index: int) -> float:
        copy = work / f"{side}-cold.sqlite3"
        shutil.copyfile(work / f"{side}.sqlite3", copy)
        argv = [sys.executable, "-c", bench.COLD_SCAN, str(copy), queries[index % len(queries)]]
        done = subprocess.run(
            argv, cwd=dirs[side], env=env, capture_output=True, text=True, check=True
        )
        imported, scanned = (int(value) / 1e6 for value in done.stdout.split())
        processes[side]["import"].append(imported)
        processes[side]["scan"].append(scanned)
        return scanned

    def put(side: str, index: int) -> float:
        position = index % len(texts)
        store = stores[side]
        store.delete(keys[side][position])
        start = time.perf_counter()
        keys[side][position] = store.put(texts[position]).key
        return (time.perf_counter() - start) * 1e3

    def secrets(side: str, _index: int) -> float:
        find_secret = modules[side].find_secret
        start = time.perf_counter()
        for text in texts:
            find_secret(text)
        return (time.perf_counter() - start) / len(texts) * 1e6

    alternate(2, sides, fresh)  # warm the OS and bytecode caches
    processes = {side: {"import": [], "scan": []} for side in sides}
    alternate(rounds, sides, fresh)
    rows = [
        (
            "import tactmem, fresh process (ms)",
            {s: statistics.median(processes[s]["import"]) for s in sides},
        ),
        (
            "first scan, fresh process (ms)",
            {s: statistics.median(processes[s]["scan"]) for s in sides},
        ),
        ("Store.put after a delete (ms)", alternate(rounds * 20, sides, put)),
        ("find_secret per record (us)", alternate(rounds, sides, secrets)),
    ]
    print(f"before: {dirs['before']}\nafter:  {dirs['after']}\n{rounds} rounds, interleaved\n")
    print(f"{'':40} {'before':>10} {'after':>10} {'after/before':>13}")
    for name, medians in rows:
        ratio = medians["after"] / medians["before"]
        print(f"{name:40} {medians['before']:10.3f} {medians['after']:10.3f} {ratio:12.2f}x")


if __name__ == "__main__":
    sys.exit(main())
