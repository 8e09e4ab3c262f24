"""Abstention and ranking candidates over eval scenarios (issue 28's study). Run by hand.

    python bench/retrieval.py FILE [FILE ...] [--tactmem DIR] [--only NAME --at T [U]]

Replays each scenario file's `put`, `replace`, `delete`, `read` and `advance` steps on a fresh
`Store` (labels as `tactmem eval` keeps them; a refused write is skipped) and, at each `scan`,
ranks the whole corpus and keeps every card's score, coverage and matched terms. Then, for each
abstention candidate of fixtures/eval/retrieval/PREREGISTRATION.md, it applies that file's rule 1
(the largest threshold on the grid whose recall@5, pooled over the files, is at most 0.02 below
the ranking's at 0 and costs no category more than 0.10) and prints the operating point, its
recall@5 and false retrieval, with recall@5 per category at 0. `--tactmem DIR` imports the
`tactmem.py` in DIR instead of this checkout's (a copy with a ranking candidate applied, such
as T1). `--rerank R3` orders the cards each threshold keeps by score x the share of the
subject terms held (the seventh round's R1 to R3; a stable sort, ties in BM25 order), and with
`--window 20` only the first 20 of them (R3 as it was implemented, then reverted). `--gate`
makes a threshold keep all of a scan's cards when any reaches it, else none (the ninth round).
`--only B2 --at 0.28 0.30` scores one candidate at a fixed point and nothing else (the kept-out
set is scored so, once per accepted candidate: rule 4). Public names only; nothing here is a
target.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parent.parent


Card = tuple[int, float, float, frozenset[str], frozenset[str], frozenset[str]]


class Scan(NamedTuple):
    category: str
    note: str
    relevant: frozenset[int]
    subject: list[str]  # the query's terms but its function words (all of them if none is left)
    idf: dict[str, float]
    df: dict[str, int]
    cards: list[Card]  # id, score, coverage, matched terms, subject terms held (stems included),
    # and the stems of every term the card holds


def replay(tactmem: Any, path: str) -> list[Scan]:
    """Every scan of one scenario file, over the whole ranking."""
    core, scans, labels = tactmem.core, [], {}
    now = 1_767_225_600_000
    with tempfile.TemporaryDirectory() as directory:
        store = tactmem.Store(os.path.join(directory, "memory.sqlite3"))
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            step, now = json.loads(line), now + 1
            live = {record.key.id: record for record in store.list(now_ms=now)}
            try:
                if step["step"] == "put":
                    labels[step.get("as")] = store.put(step["content"], now_ms=now).key.id
                elif step["step"] in ("replace", "delete") and labels.get(step["target"]) in live:
                    key = live[labels[step["target"]]].key
                    version = step["version"]
                    wanted = {"current": key.version, "stale": key.version + 7}.get(version)
                    key = tactmem.Key(key.id, version if wanted is None else wanted)
                    if step["step"] == "delete":
                        store.delete(key, now_ms=now)
                        continue
                    new = store.put(step["content"], replace=key, now_ms=now).key.id
                    labels[step["target"]] = labels[step.get("as")] = new
                elif step["step"] == "read":
                    store.read([labels[x] for x in step["ids"] if x in labels], now_ms=now)
                elif step["step"] == "advance":
                    now += int(step.get("ms", 0) + step.get("days", 0) * 86_400_000)
                elif step["step"] == "scan":
                    scans.append(scored(core, store, step, labels, set(live), now))
            except tactmem.TactmemError:
                pass  # a refused write, as the scenario may expect
        store.close()
    return scans


def scored(
    core: Any, store: Any, step: dict[str, Any], labels: dict[Any, int], live: set[int], now: int
) -> Scan:
    store.scan(step["query"], now_ms=now)  # brings the statistics up to date
    corpus, terms = core.store_corpus(store), core.query_terms(step["query"])
    ranked = corpus.rank(terms, len(corpus.counts))
    coverage = corpus.coverage(terms) if ranked else None
    n = len(corpus.counts)
    df = {term: len(corpus.postings.get(term, {})) for term in terms}
    idf = {term: math.log(1 + (n - df[term] + 0.5) / (df[term] + 0.5)) for term in terms}
    subject = [term for term in terms if term not in core.FUNCTION_WORDS] or terms
    relevant = frozenset(labels[x] for x in step["relevant"] if labels.get(x) in live)
    cards = [
        (
            doc,
            score,
            coverage(doc),
            frozenset(t for t in terms if t in corpus.counts[doc]),
            held(core, subject, corpus.counts[doc]),
            frozenset(map(core.stem, corpus.counts[doc])),
        )
        for doc, score in ranked
        if coverage is not None
    ]
    category, note = step.get("category", "uncategorized"), step.get("note", "")
    return Scan(category, note, relevant, subject, idf, df, cards)


def held(core: Any, subject: list[str], counts: dict[str, int]) -> frozenset[str]:
    """The subject terms a card holds as they are or by `core.stem`, as coverage counts them."""
    stems = {core.stem(term) for term in counts}
    return frozenset(t for t in subject if t in counts or core.stem(t) in stems)


Feature = Callable[[Scan, Card], float]


def share(weight: Callable[[Scan, str], float], known_only: bool = False) -> Feature:
    """The weighted share of the subject terms a card holds exactly (no stems)."""

    def feature(scan: Scan, card: Card) -> float:
        terms = [t for t in scan.subject if not known_only or scan.df[t]] or scan.subject
        total = sum(weight(scan, t) for t in terms)
        return sum(weight(scan, t) for t in terms if t in card[3]) / total if total else 0.0

    return feature


def ratio(known_only: bool) -> Feature:
    """A card's score over the sum of its subject terms' idfs."""

    def feature(scan: Scan, card: Card) -> float:
        ideal = sum(scan.idf[t] for t in scan.subject if not known_only or scan.df[t])
        return card[1] / ideal if ideal else 0.0

    return feature


def root_idf(scan: Scan, term: str) -> float:
    return math.sqrt(scan.idf[term])


def plain_idf(scan: Scan, term: str) -> float:
    return scan.idf[term]


def missing(known: float, unknown: float) -> Feature:
    """Coverage (stems included) with the subject terms a card lacks weighed apart: those the
    corpus holds elsewhere by `known`, those no record holds by `unknown` (A0 is 1 and 1)."""

    def feature(scan: Scan, card: Card) -> float:
        have = lack_known = lack_unknown = 0.0
        for term in scan.subject:
            weight = root_idf(scan, term)
            if term in card[4]:
                have += weight
            elif scan.df[term]:
                lack_known += weight
            else:
                lack_unknown += weight
        total = have + known * lack_known + unknown * lack_unknown
        return have / total if total else 0.0

    return feature


def lexicon(stem: Callable[[str], str], path: str) -> Feature:
    """A0 where a card also holds a subject term when it holds (as itself or by `stem`) a word
    of a lexicon group holding a word with the term's stem (one group a line, words by spaces)."""
    related = defaultdict[str, set[str]](set)
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        stems = {stem(word) for word in line.split()}
        for one in stems:
            related[one] |= stems

    def feature(scan: Scan, card: Card) -> float:
        have = total = 0.0
        for term in scan.subject:
            weight = root_idf(scan, term)
            total += weight
            if term in card[4] or not related[stem(term)].isdisjoint(card[5]):
                have += weight
        return have / total if total else 0.0

    return feature


def by_count(scan: Scan, card: Card) -> float:
    """The share of the subject terms a card holds (stems included), each weighing 1."""
    return len(card[4]) / len(scan.subject)


def lead(scan: Scan) -> float:
    """How far the scan's first score is ahead of its second, as a share of the first."""
    first = scan.cards[0][1]
    second = scan.cards[1][1] if len(scan.cards) > 1 else 0.0
    return (first - second) / first


SHARES = [x / 100 for x in range(0, 51, 2)]
RATIOS = [x / 100 for x in range(0, 301)]
CANDIDATES: dict[str, tuple[Feature, list[float]]] = {
    "A0 coverage": (lambda scan, card: card[2], SHARES),
    "A1 coverage without stems": (share(root_idf), SHARES),
    "A2 coverage over known terms": (share(root_idf, known_only=True), SHARES),
    "A3 coverage by idf": (share(plain_idf), SHARES),
    "A4 score / ideal": (ratio(known_only=False), RATIOS),
    "A5 score / ideal of known terms": (ratio(known_only=True), RATIOS),
    "A6 A0 x sqrt(min(1, A5))": (
        lambda scan, card: card[2] * math.sqrt(min(1.0, ratio(True)(scan, card))),
        SHARES,
    ),
    "A7 known missing terms count double": (missing(known=2.0, unknown=1.0), SHARES),
    "A8 unknown missing terms count half": (missing(known=1.0, unknown=0.5), SHARES),
    "A9 coverage by count": (by_count, SHARES),
}
RERANK: dict[str, Feature] = {  # the seventh round: cards ordered by score x this
    "R1": lambda scan, card: card[2],
    "R2": lambda scan, card: card[2] ** 2,
    "R3": by_count,
}
Order = Callable[[Scan, list[Card]], list[Card]]  # the cards a threshold keeps, in card order


def reranked(weight: Feature, window: int | None) -> Order:
    """The seventh round's order: the first `window` cards (all of them with None) by score
    times `weight`, a stable sort (ties stay in BM25 order)."""
    return lambda scan, cards: sorted(cards[:window], key=lambda c: -c[1] * weight(scan, c))


def bm25_order(scan: Scan, cards: list[Card]) -> list[Card]:
    return cards  # the ranking's own order, as the store gives it


ORDER: Order = bm25_order  # unless --rerank
GATE = False  # --gate: a threshold keeps a scan's cards (all of them) or none, not card by card
Keep = Callable[[Scan, int, Card], bool]  # is the card at this rank kept?
Rule = Callable[[float, float], Keep]  # a two-parameter rule at (t, u)
A5 = ratio(known_only=True)
RULES: dict[str, tuple[Rule, list[float], list[float]]] = {
    "B1 A0 >= t and lead >= u": (
        lambda t, u: lambda scan, rank, card: card[2] >= t and lead(scan) >= u,
        SHARES,
        [x / 100 for x in range(0, 51, 2)],
    ),
    "B2 A0 >= t, or first with lead >= u": (
        lambda t, u: lambda scan, rank, card: card[2] >= t or (rank == 0 and lead(scan) >= u),
        SHARES,
        [x / 100 for x in range(5, 101, 5)],
    ),
    "B3 A0 >= t and A5 >= u": (
        lambda t, u: lambda scan, rank, card: card[2] >= t and A5(scan, card) >= u,
        SHARES,
        [x / 100 for x in range(0, 101, 5)],
    ),
}


Figures = tuple[float, float, dict[str, float]]


def floor(feature: Feature, value: float) -> Keep:
    """Keep the cards whose feature reaches `value`."""
    return lambda scan, rank, card: feature(scan, card) >= value


def kept(scan: Scan, keep: Keep) -> list[Card]:
    """The cards `keep` keeps (walking the whole ranking, as `min_coverage` does), in `ORDER`."""
    passing = [card for rank, card in enumerate(scan.cards) if keep(scan, rank, card)]
    if GATE and passing:  # the ninth round: a scan keeps all its cards, or none
        passing = list(scan.cards)
    return ORDER(scan, passing)


def figures(scans: Sequence[Scan], keep: Keep) -> Figures:
    """Recall@5, false retrieval and recall@5 per category, keeping the cards `keep` keeps
    (walking the whole ranking, as `min_coverage` does)."""
    recall, false, per = [], [], defaultdict[str, list[float]](list)
    for scan in scans:
        wanted = 5 if scan.relevant else 1  # a scan without an answer needs one card to fail
        top = [card[0] for card in kept(scan, keep)[:wanted]]
        if scan.relevant:
            found = len(scan.relevant.intersection(top)) / len(scan.relevant)
            recall.append(found)
            per[scan.category].append(found)
        else:
            false.append(1.0 if top else 0.0)
    mean = {name: sum(values) / len(values) for name, values in per.items()}
    return sum(recall) / len(recall), sum(false) / max(1, len(false)), mean


def reciprocal(scans: Sequence[Scan], keep: Keep) -> tuple[float, dict[str, float]]:
    """MRR over the scans with an answer, overall and per category, as `tactmem eval` takes
    it: one over the rank of the first relevant card of the five kept (0 with none)."""
    found = defaultdict[str, list[float]](list)
    for scan in scans:
        if scan.relevant:
            top = [card[0] for card in kept(scan, keep)[:5]]
            first = next((n for n, doc in enumerate(top, 1) if doc in scan.relevant), None)
            found[scan.category].append(0.0 if first is None else 1 / first)
    every = [value for values in found.values() for value in values]
    mean = {name: sum(values) / len(values) for name, values in sorted(found.items())}
    return sum(every) / max(1, len(every)), mean


def kinds(scans: Sequence[Scan]) -> dict[str, float]:
    """Paraphrase recall@5 at 0 per kind (the note's `kind:`; `unlabelled` without one)."""
    found = defaultdict[str, list[float]](list)
    for scan in scans:
        if scan.category == "paraphrase" and scan.relevant:
            kind = scan.note.removeprefix("kind: ").split()[0] if "kind:" in scan.note else ""
            top = {card[0] for card in ORDER(scan, scan.cards)[:5]}
            found[kind or "unlabelled"].append(len(scan.relevant & top) / len(scan.relevant))
    return {kind: sum(values) / len(values) for kind, values in sorted(found.items())}


def confusion(scans: Sequence[Scan]) -> tuple[int, int]:
    """Cross-workspace confusion at 0: the `workspace` scans whose first card is not a relevant
    record, and how many `workspace` scans there are."""
    named = [scan for scan in scans if scan.category == "workspace" and scan.relevant]
    wrong = [
        not (top := ORDER(scan, scan.cards)) or top[0][0] not in scan.relevant for scan in named
    ]
    return sum(wrong), len(named)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--tactmem", default=str(ROOT), help="the directory of tactmem.py")
    parser.add_argument("--only", help="one candidate (its code, such as B2), scored at --at")
    parser.add_argument("--at", nargs="+", type=float, default=[], help="its t (and u)")
    parser.add_argument(
        "--ranking", action="store_true", help="the ranking's figures and A0's point only"
    )
    parser.add_argument("--lexicon", help="A10's lexicon (bench/candidates/lexicon.txt)")
    parser.add_argument("--rerank", choices=sorted(RERANK), help="a seventh-round order (R1)")
    parser.add_argument(
        "--window", type=int, default=0, help="--rerank orders only the first N kept cards"
    )
    parser.add_argument(
        "--gate", action="store_true", help="a threshold keeps all of a scan's cards or none"
    )
    arguments = parser.parse_args(argv)
    if bool(arguments.only) != bool(arguments.at):
        parser.error("--only and --at go together")
    if arguments.window and not arguments.rerank:
        parser.error("--window goes with --rerank")
    global ORDER, GATE  # what --rerank, --window and --gate make of `figures` and the rest
    GATE = arguments.gate
    sys.path.insert(0, arguments.tactmem)
    import tactmem

    if arguments.lexicon:
        CANDIDATES["A10 coverage with a lexicon"] = (
            lexicon(tactmem.core.stem, arguments.lexicon),
            SHARES,
        )
    scans = [scan for path in arguments.files for scan in replay(tactmem, path)]
    if arguments.rerank:
        ORDER = reranked(RERANK[arguments.rerank], arguments.window or None)
    base, _, per = figures(scans, floor(CANDIDATES["A0 coverage"][0], 0.0))
    print(f"{len(scans)} scans from {tactmem.__file__}; recall@5 at 0: {base:.3f}")
    print("  " + ", ".join(f"{name} {value:.3f}" for name, value in sorted(per.items())))
    print("  paraphrase by kind: " + ", ".join(f"{k} {v:.3f}" for k, v in kinds(scans).items()))
    overall, by_category = reciprocal(scans, floor(CANDIDATES["A0 coverage"][0], 0.0))
    print(f"  MRR at 0 {overall:.3f}: " + ", ".join(f"{k} {v:.3f}" for k, v in by_category.items()))
    wrong, named = confusion(scans)
    print(f"  cross-workspace confusion: {wrong}/{named} = {wrong / max(1, named):.3f}")
    if arguments.only:
        return fixed(scans, arguments.only, arguments.at, per)
    for name, (feature, grid) in CANDIDATES.items():
        if arguments.ranking and not name.startswith("A0 "):
            continue
        point = max(
            (t for t in grid if ok(figures(scans, floor(feature, t)), base, per)), default=0.0
        )
        recall, false, _ = figures(scans, floor(feature, point))
        print(f"{name:38} t={point:.2f} recall@5 {recall:.3f} false retrieval {false:.3f}")
    for name, (rule, grid, second) in {} if arguments.ranking else RULES.items():
        t, u = operating_point(scans, rule, grid, second, base, per)
        recall, false, _ = figures(scans, rule(t, u))
        print(f"{name:38} t={t:.2f} u={u:.2f} recall@5 {recall:.3f} false retrieval {false:.3f}")
    return 0


def fixed(scans: Sequence[Scan], code: str, at: list[float], per: dict[str, float]) -> int:
    """One candidate at a fixed point: recall@5, false retrieval, and each category's recall@5
    against the ranking's at 0 (`per`)."""
    if len(at) == 1 and (one := [c for n, (c, _) in CANDIDATES.items() if n.split()[0] == code]):
        keep = floor(one[0], at[0])
    elif len(at) == 2 and (two := [r for n, (r, *_) in RULES.items() if n.split()[0] == code]):
        keep = two[0](at[0], at[1])
    else:
        raise SystemExit(f"no candidate {code} with {len(at)} parameters")
    recall, false, mean = figures(scans, keep)
    print(f"{code} at {' '.join(map(str, at))}: recall@5 {recall:.3f} false retrieval {false:.3f}")
    print("  " + ", ".join(f"{k} {per[k]:.3f} -> {v:.3f}" for k, v in sorted(mean.items())))
    overall, by_category = reciprocal(scans, keep)
    print(f"  MRR {overall:.3f}: " + ", ".join(f"{k} {v:.3f}" for k, v in by_category.items()))
    return 0


def operating_point(
    scans: Sequence[Scan],
    rule: Rule,
    grid: list[float],
    second: list[float],
    base: float,
    per: dict[str, float],
) -> tuple[float, float]:
    """Rule 1 for two parameters: of the grid points meeting rule 1's conditions, the one with
    the lowest false retrieval; ties to the higher recall@5, then the larger t, then u."""
    best: tuple[float, float, float, float] | None = None
    for t in grid:
        for u in second:
            recall, false, _ = found = figures(scans, rule(t, u))
            if ok(found, base, per) and (best is None or (-false, recall, t, u) > best):
                best = (-false, recall, t, u)
    return (0.0, 0.0) if best is None else (best[2], best[3])


def ok(found: Figures, base: float, per: dict[str, float]) -> bool:
    """Rule 1: at most 0.02 recall@5 lost overall and 0.10 in any category."""
    recall, _, mean = found
    return base - recall <= 0.02 and all(per[name] - mean[name] <= 0.10 for name in mean)


if __name__ == "__main__":
    sys.exit(main())
