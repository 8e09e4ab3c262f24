"""Property tests for tactmem: the pure core, `Store` against a pure model, and fuzzing.

The pure functions (`preview`, `tokenize`, `rank`, `normalized_identity`, `find_secret`, the
bound arithmetic, the browser screen) are checked for the guarantees the reference and SPEC make
about every input. The stateful machine drives a real `Store` (SQLite in a fresh temporary
directory) under tiny limits, so the bounds, probation and version conflicts are hit all the time,
and checks every outcome and the rows on disk against a model of the reference semantics
(reference §5-8). The last section fuzzes the agent surface and the command line (hostile
sequences of `MemoryTool.call`, any argument list to `main`) on stores kept on tmpfs if it can.

Citations name documents outside this repository: "reference §N" is section N of
`../shared/spec/tact-reference.md` (the Tact reference notes) and "SPEC §N" is section N of
`../shared/SPEC.md`; neither file is in this repository. Where the documents state the rule a
property checks, read it there: docs/behaviour.md ("How it behaves" and its "Decisions") for
tokenizing, ranking, previews, secrets, bounds and storage, docs/reliability.md for the fuzzing
and the model check.

Profiles: `ci` (derandomized, no deadline) is loaded when the CI environment variable is set;
`dev` is a ten times longer local run: `HYPOTHESIS_PROFILE=dev pytest test_properties.py`, and
`quick`, a tenth of the examples, is the quick loop's (`HYPOTHESIS_PROFILE=quick`,
docs/development.md); `--hypothesis-profile=dev` cannot work: the profiles are registered here,
not in a conftest.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import itertools
import json
import math
import os
import re
import shutil
import sqlite3
import stat
import sys
import tempfile
import unicodedata
import unittest.mock
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import jsonschema
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import tactmem
from tactmem import (
    Candidate,
    Conflict,
    ContentCapacity,
    ContentTooLarge,
    Duplicate,
    EmptyContent,
    Key,
    Limits,
    MemoryTool,
    NotFound,
    QueryTooLarge,
    Record,
    RecordCapacity,
    ScanResult,
    SecretRejected,
    Store,
    TactmemError,
    find_secret,
    normalized_identity,
    preview,
    rank,
    tokenize,
)

# Recent Hypothesis versions (6.155 here) register and load a built-in `ci` profile by themselves
# when they detect CI; older ones do not. Register ours explicitly either way, so the settings are
# the same on every version, and load it whenever CI is set (as `.ci/run` does with CI=true).
settings.register_profile(
    "ci",
    derandomize=True,  # the same examples on every run: a red CI is reproducible
    deadline=None,  # CI machines are slow and noisy; timing is the benchmark's job
    print_blob=True,  # a failure prints a blob that `@reproduce_failure` replays
    database=None,  # a fresh clone has no example database to save or replay
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=1000, deadline=None)
# The quick loop's profile (docs/development.md): a tenth of the examples, for everyday work.
settings.register_profile("quick", max_examples=10, deadline=None)
if "CI" in os.environ:
    settings.load_profile("ci")
elif "HYPOTHESIS_PROFILE" in os.environ:
    settings.load_profile(os.environ["HYPOTHESIS_PROFILE"])

# Unicode White_Space (PropList.txt), which the spec uses for trimming and identity. Python's
# str.split() and str.strip() also treat U+001C..U+001F as whitespace; the reference does not.
WHITE_SPACE = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008"
    "\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)
_WHITE_SPACE_RUN = re.compile(f"[{re.escape(WHITE_SPACE)}]+")


# ============================================================ strategies


# Plenty of multi-byte characters (2, 3 and 4 UTF-8 bytes) so byte budgets split code points.
_multibyte_text = st.text(alphabet=st.sampled_from("aZ é ß 日本 😀\u0301"), max_size=80)

any_text = st.one_of(st.text(), _multibyte_text)

# ASCII with word characters, separators and case changes concentrated.
_ascii_text = st.one_of(
    st.text(alphabet=st.characters(max_codepoint=127)),
    st.text(alphabet=st.sampled_from("aBcXyZ019_ -./'@:\n"), max_size=40),
)

_RANK_WORDS = (
    "rust", "Rust", "sqlite", "SQLite", "httpServer", "http", "server", "parse_request",
    "common", "rare", "数据库", "数据库连接", "café", "x", "the",
)  # fmt: skip

_rank_text = st.one_of(
    st.lists(st.sampled_from(_RANK_WORDS), max_size=6).map(" ".join),
    st.text(max_size=20),
)

_rank_docs = st.lists(
    st.tuples(st.integers(min_value=1, max_value=60), _rank_text),
    max_size=9,
    unique_by=lambda doc: doc[0],
)


def rejected_fixtures() -> tuple[str, ...]:
    """The maintained secret fixtures (fixtures/secrets/rejected.txt): one case per line,
    `#` comments and blank lines skipped, `\\n` and `\\t` standing for newline and tab."""
    path = Path(__file__).parent / "fixtures" / "secrets" / "rejected.txt"
    cases = tuple(
        line.replace("\\n", "\n").replace("\\t", "\t")
        for line in path.read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    )
    assert len(cases) >= 50, f"{path} should hold the maintained fixture set"
    return cases


# Content that some secret rule must reject: reference §4 shapes, SPEC §2.3 additions, and every
# case of the maintained fixture set.
SECRETS = (
    "password=w",
    "private_key: w",
    "DATABASE_PASSWORD=w",
    "clientSecret=w",
    "token=abcdefghijklmnop",
    "sk-1234567890123456",
    "GITHUB_PAT_1234567890123456",
    "Authorization: Basic abc",
    "Bearer abcdefghijk1234",
    "https://user:pw@host/path",
    "eyJhbGciOiJI.eyJzdWIiOiIx.c2lnbmF0dXJl",
    "-----BEGIN OPENSSH PRIVATE KEY-----",
    "sk-ant-abcdefghijkl1234",
    "glpat-abcdefghij1234567890",
    *rejected_fixtures(),
)


# ============================================================ tokenizing


def _camel_pieces(piece: str) -> list[str]:
    """Reference §1.2b: split before an upper-case char after a lower-case char or a digit."""
    parts: list[str] = []
    start = 0
    for index in range(1, len(piece)):
        previous = piece[index - 1]
        if piece[index].isupper() and (previous.islower() or previous in "0123456789"):
            parts.append(piece[start:index])
            start = index
    parts.append(piece[start:])
    return parts


def reference_ascii_tokens(text: str) -> list[str]:
    """The reference tokenizer (§1), written out for ASCII text, where it is unambiguous."""
    tokens: list[str] = []
    for run in re.findall(r"[A-Za-z0-9_]+", text):
        whole = run.lower()
        tokens.append(whole)
        emitted = {whole}  # components de-duplicate per run only
        for piece in run.split("_"):
            if not piece:
                continue
            for component in _camel_pieces(piece):
                lowered = component.lower()
                if lowered not in emitted:
                    emitted.add(lowered)
                    tokens.append(lowered)
    return tokens


WORD_CHAR = re.compile(f"[{tactmem._WORD_CLASS}]")  # one word character, as the tokenizer has them


def compounds_char_by_char(text: str) -> list[str]:
    """SPEC §2.2's compounds (issue 28's T2), one character at a time: maximal chains of two or
    more runs of word characters, each joined to the next by exactly one `-`, `.` or `/`."""
    chains: list[str] = []
    start = end = -1  # the chain being read: text[start:end]
    runs = 0
    index = 0
    while index < len(text):
        if not WORD_CHAR.match(text[index]):
            index += 1
            continue
        run_start = index
        while index < len(text) and WORD_CHAR.match(text[index]):
            index += 1
        if runs and run_start == end + 1 and text[end] in "-./":
            runs, end = runs + 1, index
        else:
            if runs >= 2:
                chains.append(text[start:end].lower())
            runs, start, end = 1, run_start, index
    if runs >= 2:
        chains.append(text[start:end].lower())
    return chains


@given(text=any_text)
def test_tokenize_is_deterministic_and_yields_no_empty_or_spaced_token(text: str) -> None:
    """Same text, same tokens; no token is empty or holds whitespace."""
    tokens = tokenize(text)
    assert tokens == tokenize(text)
    for token in tokens:
        assert token
        assert not any(char.isspace() for char in token)


@given(first=any_text, second=any_text)
def test_tokenize_works_run_by_run(first: str, second: str) -> None:
    """Tokens come from each whitespace-separated run alone (de-dup is per run, not per text):
    the reference tokens of both parts in order, then the compounds of both."""
    parts = [tokenize(first), tokenize(second)]
    chains = [compounds_char_by_char(first), compounds_char_by_char(second)]
    reference = [
        tokens[: len(tokens) - len(found)] for tokens, found in zip(parts, chains, strict=True)
    ]
    assert tokenize(first + " " + second) == [*reference[0], *reference[1], *chains[0], *chains[1]]


def _runs_char_by_char(text: str) -> list[str]:
    """SPEC §2.2's word runs, one character at a time: word characters, with a combining mark
    (Mn, Mc) continuing a run but never starting one."""
    runs: list[str] = []
    current = ""
    for char in text:
        if WORD_CHAR.match(char) or (current and unicodedata.category(char) in ("Mn", "Mc")):
            current += char
        elif current:
            runs.append(current)
            current = ""
    return [*runs, current] if current else runs


_run_text = st.one_of(
    any_text,
    _ascii_text,
    # Devanagari vowel signs (Mn, Mc), a lone acute, CJK and its punctuation, circled letters,
    # the compounds' joiners, and letters whose lowercase is context- or fold-sensitive.
    st.text(
        alphabet=st.sampled_from("ak_9 .-/:\t\u0915\u093f\u0937\u0301数据\uff1a。\u24b6\u3000éßΣ"),
        max_size=30,
    ),
)


@given(text=_run_text)
@example(text="कि")
@example(text="\u0301a\u0301 b")
@example(text="数据库\uff1aSQLite。")
def test_word_runs_take_their_fast_paths_only_where_they_agree(text: str) -> None:
    """ASCII text is split by `translate` and `split`, text without a stray combining mark by
    one regex; both give exactly the runs of the character-by-character rule."""
    assert tactmem._word_runs(text) == _runs_char_by_char(text)


@given(text=_ascii_text)
@example(text="src/core/httpServer.rs parse_request")
@example(text="HTTPServer parseHTTP2Request v2Api")
@example(text="__init__ _ a_b_ XMLHttpRequest")
@example(text="getHTTPResponseCode iOS12App a1B2c3 camelCase camelCase")
@example(text="foo.bar@baz 3.14 x86_64 Don't read-only")
def test_tokenize_matches_the_reference_on_ascii(text: str) -> None:
    """On ASCII text tokenize() is exactly the reference tokenizer (SPEC §2.2: the CJK and
    combining-mark additions cannot fire), so every such token is lowercase [a-z0-9_]; then
    come the compounds, each lowercase runs joined by `-`, `.` or `/`."""
    reference = reference_ascii_tokens(text)
    tokens = tokenize(text)
    assert tokens == reference + compounds_char_by_char(text)
    assert all(re.fullmatch(r"[a-z0-9_]+", token) for token in reference)
    compounds = tokens[len(reference) :]
    assert all(re.fullmatch(r"[a-z0-9_]+(?:[-./][a-z0-9_]+)+", token) for token in compounds)


@given(text=_run_text)
@example(text="a.b..c-d x--y /p/q/ 3.14.")
@example(text="config/brambleway.yaml, windrose-sdk.")
@example(text="a-b c-d a-b")  # each occurrence counts, as a word's does
@example(text="Straße-X x-y\u0301z")  # lowercase, not casefold; a mark ends a compound
def test_compounds_are_the_chains_of_runs_joined_by_one_separator(text: str) -> None:
    """Whatever the script: tokenize() ends with exactly the chains the character-by-character
    reading finds, and nothing before them is a chain."""
    chains = compounds_char_by_char(text)
    tokens = tokenize(text)
    assert tokens[len(tokens) - len(chains) :] == chains
    assert not any(set(token) & set("-./") for token in tokens[: len(tokens) - len(chains)])


@given(text=_ascii_text)
@example(text="A1B")
@example(text="camelCase")
def test_tokenize_case_insensitivity_that_actually_holds(text: str) -> None:
    """What case-insensitivity the tokenizer really guarantees (ASCII, to avoid Unicode case
    mappings such as ß -> SS that change the text itself):

    * tokenize(s) == tokenize(s.swapcase()) is NOT a guarantee: camel-case splitting reads the
      case (`camelCase` -> camel, case; `CAMELcASE` -> camelc, ase), and so does the rule that
      an upper-case letter after a digit starts a component (`A1B` -> a1, b; `a1b` stays whole).
    * Every word's whole run, lowercased, is a token whatever its case, so a query word matches
      a document word in any casing (the property search relies on).
    * Text with one case and no digits cannot split on case, so both cases tokenize alike.
    """
    for variant in (text, text.lower(), text.upper(), text.swapcase()):
        tokens = set(tokenize(variant))
        for run in re.findall(r"[A-Za-z0-9_]+", text):
            assert run.lower() in tokens
    without_digits = re.sub("[0-9]", "", text)
    assert tokenize(without_digits.lower()) == tokenize(without_digits.upper())


# ============================================================ secrets and identity


_words = st.text(
    alphabet=st.characters(exclude_categories=("Cs", "Zs", "Zl", "Zp", "Cc")), min_size=1
)

_separators = st.text(alphabet=st.sampled_from(WHITE_SPACE), min_size=1, max_size=4)


@given(text=any_text)
def test_normalized_identity_is_idempotent(text: str) -> None:
    """Normalizing twice changes nothing."""
    once = normalized_identity(text)
    assert normalized_identity(once) == once


@given(text=st.one_of(any_text, st.text(alphabet=st.sampled_from("ab \x1c\x1f\u3000"))))
@example(text="Remember  SQLite")
@example(text="a\x1cb")
def test_normalized_identity_is_lowercased_white_space_words(text: str) -> None:
    """Split on Unicode White_Space, lowercase each word, join with one space (reference §5)."""
    words = [word.lower() for word in _WHITE_SPACE_RUN.split(text) if word]
    assert normalized_identity(text) == " ".join(words)


@given(words=st.lists(_words, min_size=1, max_size=5), data=st.data())
def test_normalized_identity_ignores_whitespace_runs(words: list[str], data: st.DataObject) -> None:
    """Any run of White_Space between, before or after the words is one space or nothing."""
    separators = data.draw(st.lists(_separators, min_size=len(words) + 1, max_size=len(words) + 1))
    spaced = separators[0] + "".join(
        word + sep for word, sep in zip(words, separators[1:], strict=True)
    )
    assert normalized_identity(spaced) == normalized_identity(" ".join(words))


@given(text=any_text)
@example(text="Remember SQLite")
def test_normalized_identity_ignores_case(text: str) -> None:
    """Lower- and upper-case spellings of the same ASCII text are one identity; for any text,
    lowercasing it first changes nothing. (Full Unicode upper-casing can change the text itself,
    e.g. ß -> SS, so `identity(s.upper()) == identity(s)` is only promised for ASCII.)"""
    assert normalized_identity(text.lower()) == normalized_identity(text)
    ascii_text = text.encode("ascii", "ignore").decode("ascii")
    identity = normalized_identity(ascii_text)
    assert normalized_identity(ascii_text.upper()) == identity
    assert normalized_identity(ascii_text.swapcase()) == identity


@given(
    secret=st.sampled_from(SECRETS),
    before=st.text(max_size=30),
    after=st.text(max_size=30),
)
def test_context_never_hides_a_secret(secret: str, before: str, after: str) -> None:
    """A secret-shaped case is found whatever text surrounds it on other lines, and the
    result names a rule without echoing the secret."""
    rule = find_secret(before + "\n" + secret + "\n" + after)
    assert rule is not None
    assert secret not in rule


@given(text=any_text)
def test_find_secret_names_a_rule_never_the_match(text: str) -> None:
    """find_secret() returns None or a rule name (a snake_case identifier), so it can never
    carry the matched text."""
    rule = find_secret(text)
    assert rule is None or re.fullmatch(r"[a-z][a-z0-9_]*", rule)


SECRET_PIECES = st.sampled_from(
    [
        "sk-", "SK_", "ghp_", "GITHUB_PAT_", "xoxb-", "AKIA", "Bearer ", "authorization:", "://",
        "user:pw@", "eyJ", "password", "Secret", "tOkEn", "api-key", "private_key", "-----BEGIN ",
        " PRIVATE KEY-----", "AIza", "glpat-", "npm_", "pypi-AgE", "hf_", "xapp-", "SG.",
        "hooks.slack.com/services/T1/B2/x", "rk_live_", "pk_live_", "aws_secret_access_key=",
        "AccountKey=", "\u212a", "\u0130", "=", ":", " ", "\n", "1234567890", "AbCdEfGhIj",
    ]
)  # fmt: skip


@settings(max_examples=500, deadline=None)
@given(pieces=st.lists(SECRET_PIECES | st.text(max_size=12), max_size=12))
@pytest.mark.slow
def test_secret_prefilters_never_change_the_verdict(pieces: list[str]) -> None:
    """The literal pre-filters only skip work: every rule, run unfiltered, agrees."""
    content = "".join(pieces)
    assert find_secret(content) == unfiltered(content)


def credential_url_word_by_word(text: str) -> bool:
    """Rule 4 (reference §4) as written first: split on whitespace, look after each word's
    first `://`."""
    for word in re.split(f"[{tactmem._WS}]+", text):
        scheme_end = word.find("://")
        if scheme_end >= 0:
            authority = re.split("[/?#]", word[scheme_end + 3 :], maxsplit=1)[0]
            user, colon, password = authority.rpartition("@")[0].partition(":")
            if colon and user and password:
                return True
    return False


@settings(max_examples=500, deadline=None)
@given(pieces=st.lists(SECRET_PIECES | st.sampled_from(["a://b", "/", "@", "#"]), max_size=12))
@pytest.mark.slow
def test_credential_url_search_agrees_with_the_word_split(pieces: list[str]) -> None:
    content = "".join(pieces)
    assert tactmem._credential_url(content) == credential_url_word_by_word(content)


LINE_PIECES = st.sampled_from(
    [
        "\n", "\r", " ", "\t", "\u2028", "\x85", "\u3000", "Authorization", ":", "=", "x",
        "-----BEGIN ", "RSA ", "PRIVATE KEY-----", "-----begin ", "private key-----", "\r\n",
    ]
)  # fmt: skip


@settings(max_examples=500, deadline=None)
@given(pieces=st.lists(LINE_PIECES, max_size=12))
def test_line_rules_find_what_margins_across_lines_would(pieces: list[str]) -> None:
    """Rules 1 and 2 keep `\n` out of their white-space margins (so blank lines cost linear
    time) and still find exactly the texts the reference's margins find."""
    content = "".join(pieces)
    ws, flags = tactmem._WS, tactmem._AI | re.MULTILINE
    across = {
        tactmem._PEM_PRIVATE_KEY: f"^[{ws}]*-----begin .*private key-----[{ws}]*$",
        tactmem._AUTHORIZATION_HEADER: f"^[{ws}]*authorization[:=]",
    }
    for compiled, pattern in across.items():
        assert bool(compiled.search(content)) == bool(re.search(pattern, content, flags))


@settings(max_examples=300, deadline=None)
@given(texts=st.lists(st.lists(SECRET_PIECES | st.text(max_size=8), max_size=6).map("".join)))
@pytest.mark.slow
def test_secret_rows_of_a_corpus_are_its_secret_texts(texts: list[str]) -> None:
    """Looking for literals among the corpus's terms first finds every text `find_secret`
    names, and no other."""
    expected = {index for index, text in enumerate(texts) if find_secret(text) is not None}
    assert tactmem._secret_rows(texts, set().union(*map(tactmem.tokenize, texts))) == expected


def every_literal() -> Iterator[tuple[str, bool, str, tuple[int, ...]]]:
    """Every literal of the trees that admits a rule (anchors admit none)."""
    for table in (*tactmem._LITERALS, *tactmem._TOKEN_LITERALS):
        for root, children in table:
            yield from (row for row in (root, *children) if row[3])


def unfiltered(text: str) -> str | None:
    """`find_secret` without any shortcut: every rule's check, in order."""
    return next((name for name, _, _, check in tactmem._SECRET_RULES if check(text)), None)


LITERAL_PIECES = st.sampled_from(sorted({row[0] for row in every_literal()}))


@settings(max_examples=1000, deadline=None)
@given(
    pieces=st.lists(
        LITERAL_PIECES
        | st.sampled_from([*tactmem._ANCHORS, " ", "\n", "=", ": ", '"', "/", "@", "A1b2C3d4"])
        | st.text(max_size=6)
        | st.from_regex(r"[A-Za-z0-9_-]{8,40}", fullmatch=True),
        max_size=14,
    )
)
@pytest.mark.slow
def test_literal_trees_never_change_the_verdict(pieces: list[str]) -> None:
    """Texts built from every rule's literals, anchors and token runs: the literal trees, the
    token gate and the lowercase-instead-of-IGNORECASE patterns skip work, never a verdict,
    and the corpus pass agrees."""
    content = "".join(pieces)
    assert find_secret(content) == unfiltered(content)
    texts = [content, content.upper(), content.lower()]
    expected = {index for index, text in enumerate(texts) if find_secret(text) is not None}
    assert tactmem._secret_rows(texts, set().union(*map(tactmem.tokenize, texts))) == expected


SHAPES = [
    (shape, shape in tactmem._TOKEN_SHAPES)
    for shape in (*tactmem._CREDENTIAL_SHAPES, *tactmem._TOKEN_SHAPES)
]


@pytest.mark.parametrize(("shape", "token"), SHAPES, ids=[shape[0] for shape, _ in SHAPES])
@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
@pytest.mark.slow
def test_every_shape_match_passes_its_prefilters(
    shape: tuple[str, tuple[str, ...], bool, str, int, str | None], token: bool, data: st.DataObject
) -> None:
    """Texts generated from each shape's own pattern: where the shape holds, one of its
    literals is in the text, and a token shape's text holds a `_TOKEN_RUN`; each literal's
    word run is among the text's terms; the corpus pass agrees with `find_secret`."""
    name, literals, lowered, source, flags, check = shape
    text = data.draw(st.from_regex(re.compile(source, flags)))
    if data.draw(st.booleans()):  # other spellings of the same letters
        text = "".join(data.draw(st.sampled_from([c.lower(), c.upper()])) for c in text)
    holds = bool(tactmem._needing(name, tactmem._provider_shape(source, flags, check))(text))
    case_blind = [  # what IGNORECASE over the text itself finds
        match
        for match in re.compile(source, flags).finditer(text)
        if check is None or tactmem._SHAPE_CHECKS[check](match, text)
    ]
    assert holds == bool(case_blind)
    if holds:
        event("the shape's check holds")
        assert any(
            literal in (tactmem._ascii_lower(text) if lowered else text) for literal in literals
        )
        if token:
            assert tactmem._TOKEN_RUN.search(text)
    terms = tactmem.tokenize(text)
    vocabulary = "\n".join(terms)
    folded = tactmem._ascii_lower(text)
    for literal, lower, run, _ in every_literal():
        if literal in (folded if lower else text):
            assert run in vocabulary
    assert find_secret(text) == unfiltered(text)
    texts = ["In ledgerline, releases are tagged by CI.", text]
    expected = {index for index, each in enumerate(texts) if find_secret(each) is not None}
    assert tactmem._secret_rows(texts, set(terms) | set(tactmem.tokenize(texts[0]))) == expected


@given(text=st.text(st.characters(exclude_categories=())))
def test_ascii_lower_lowers_ascii_letters_only(text: str) -> None:
    lowered = tactmem._ascii_lower(text)
    assert len(lowered) == len(text)
    for before, after in zip(text, lowered, strict=True):
        assert after == (before.lower() if "A" <= before <= "Z" else before)


# ============================================================ ranking


@given(text=any_text, max_bytes=st.integers(min_value=0, max_value=100))
@example(text="a" * 63 + "é-tail", max_bytes=64)
@example(text="x" * 62 + "日本", max_bytes=64)
@example(text="😀", max_bytes=3)
@pytest.mark.slow
def test_preview_is_the_longest_utf8_prefix_within_the_budget(text: str, max_bytes: int) -> None:
    """preview() is valid UTF-8, fits the byte budget, is a prefix, and cannot be longer."""
    result = preview(text, max_bytes)
    size = len(result.encode("utf-8"))  # strict: raises if a lone surrogate came back
    assert size <= max_bytes
    assert text.startswith(result)
    if len(text.encode("utf-8")) <= max_bytes:
        assert result == text
    else:
        # The next character would break the budget, so no longer prefix fits.
        assert len(text[: len(result) + 1].encode("utf-8")) > max_bytes


@given(text=any_text)
def test_preview_defaults_to_64_bytes(text: str) -> None:
    """Without a budget, preview() uses the reference's 64 bytes."""
    assert preview(text) == preview(text, 64)


def reference_bm25(query: str, docs: Sequence[tuple[int, str]]) -> dict[int, float]:
    """BM25 of reference §2 (k1 1.2, b 0.75, plus-one idf) over tactmem's own tokenize()."""
    terms = sorted(set(tokenize(query)))
    doc_tokens = {doc_id: tokenize(text) for doc_id, text in docs}
    if not docs or not terms:
        return {}
    average = sum(len(tokens) for tokens in doc_tokens.values()) / len(docs)
    scores: dict[int, float] = {}
    for doc_id, tokens in doc_tokens.items():
        score = 0.0
        for term in terms:
            tf = tokens.count(term)
            if tf == 0:
                continue
            df = sum(term in other for other in doc_tokens.values())
            idf = math.log(1 + (len(docs) - df + 0.5) / (df + 0.5))
            ratio = len(tokens) / average if average else 0.0
            score += ((idf * tf) * 2.2) / (tf + 1.2 * ((1 - 0.75) + 0.75 * ratio))
        if score > 0.0:
            scores[doc_id] = score
    return scores


@given(query=_rank_text, docs=_rank_docs, limit=st.integers(min_value=0, max_value=12))
def test_rank_orders_matching_docs_best_first(
    query: str, docs: list[tuple[int, str]], limit: int
) -> None:
    """At most `limit` results; each shares a query term, scores > 0, best first, ties by id."""
    ranked = rank(query, docs, limit=limit)
    assert len(ranked) <= limit
    query_terms = set(tokenize(query))
    texts = dict(docs)
    assert len({doc_id for doc_id, _ in ranked}) == len(ranked)
    for doc_id, score in ranked:
        assert query_terms & set(tokenize(texts[doc_id]))
        assert score > 0.0
    for (first_id, first_score), (second_id, second_score) in itertools.pairwise(ranked):
        assert first_score > second_score or (first_score == second_score and first_id < second_id)


@given(query=_rank_text, docs=_rank_docs, data=st.data())
def test_rank_ignores_document_order(
    query: str, docs: list[tuple[int, str]], data: st.DataObject
) -> None:
    """Shuffling the documents changes nothing, not even a float's last bit."""
    shuffled = data.draw(st.permutations(docs), label="shuffled")
    assert rank(query, shuffled, limit=len(docs)) == rank(query, docs, limit=len(docs))


@given(query=_rank_text, docs=_rank_docs, limit=st.integers(min_value=0, max_value=12))
def test_rank_is_complete_bm25_and_truncates_to_a_prefix(
    query: str, docs: list[tuple[int, str]], limit: int
) -> None:
    """With room for all, rank() returns every doc sharing a term with the reference's BM25
    score; a smaller limit returns a prefix of that list."""
    everything = rank(query, docs, limit=len(docs))
    expected = reference_bm25(query, docs)
    assert {doc_id for doc_id, _ in everything} == set(expected)
    for doc_id, score in everything:
        assert math.isclose(score, expected[doc_id], rel_tol=1e-12)
    assert rank(query, docs, limit=limit) == everything[:limit]


@given(query=_rank_text, docs=_rank_docs)
def test_rank_treats_the_query_as_a_set_of_terms(query: str, docs: list[tuple[int, str]]) -> None:
    """Repeating the query (or any term in it) changes no score."""
    assert rank(query + " " + query, docs, limit=len(docs)) == rank(query, docs, limit=len(docs))


# Rows as another writer may leave them: secret-shaped text, or no text at all.
_ODD_ROW = st.sampled_from(["token = abc123", "use sk-abcdefghijklmnop here", b"rust", 7, None])


@given(
    steps=st.lists(
        st.tuples(
            st.dictionaries(st.integers(min_value=1, max_value=6), _rank_text | _ODD_ROW),
            _rank_text,
        ),
        min_size=1,
        max_size=8,
    ),
    cached_terms=st.sampled_from([1, 3, 8192]),
)
@pytest.mark.slow
def test_a_corpus_kept_up_to_date_ranks_like_a_fresh_one(
    steps: list[tuple[dict[int, object], str]], cached_terms: int
) -> None:
    """Postings and weights kept across updates (rows added, rewritten under the same version,
    removed, turned secret-shaped or non-text and back), and dropped when too many terms were
    asked about, never drift: after every update a rank equals, bit for bit, a fresh corpus's
    over the visible rows as they now are."""
    corpus = tactmem._Corpus()
    with unittest.mock.patch.object(tactmem, "_CACHED_TERMS", cached_terms):
        for docs, query in steps:
            corpus.update([(doc_id, 1, content) for doc_id, content in docs.items()])
            visible = {
                doc_id: text
                for doc_id, text in docs.items()
                if isinstance(text, str) and find_secret(text) is None
            }
            for words in (query, "rust sqlite", "token sk"):  # queried terms keep postings
                fresh = rank(words, visible.items(), limit=len(docs))
                assert corpus.rank(tactmem._query_terms(words), len(docs)) == fresh
            assert corpus.contents == visible


def full_bm25(terms: Sequence[str], docs: Iterable[tuple[int, str]], limit: int) -> list[Any]:
    """BM25 recomputed over every document, the straightforward way: each visible text scored
    (0.0 where it shares no term), each score summed from 0.0 in the given term order, all of
    them sorted by score then id, cut to `limit`, and the zero scores dropped."""
    counts = {doc_id: Counter(tokenize(text)) for doc_id, text in docs if find_secret(text) is None}
    if limit <= 0 or not counts or not terms:
        return []
    lengths = {doc_id: sum(count.values()) for doc_id, count in counts.items()}
    average = sum(lengths.values()) / len(counts)
    scores = {}
    for doc_id, count in counts.items():
        norm = 1.2 * ((1 - 0.75) + 0.75 * (lengths[doc_id] / average if average else 0.0))
        score = 0.0
        for term in terms:
            df = sum(term in other for other in counts.values())
            idf = math.log(1 + (len(counts) - df + 0.5) / (df + 0.5))
            if count[term]:
                score += idf * count[term] * (1.2 + 1) / (count[term] + norm)
        scores[doc_id] = score
    ordered = sorted(scores, key=lambda doc_id: (-scores[doc_id], doc_id))[:limit]
    return [(doc_id, scores[doc_id]) for doc_id in ordered if scores[doc_id]]


@given(
    steps=st.lists(
        st.tuples(
            st.dictionaries(st.integers(min_value=1, max_value=9), _rank_text | _ODD_ROW),
            st.lists(_rank_text, min_size=1, max_size=3),
            st.integers(min_value=0, max_value=12),
        ),
        min_size=1,
        max_size=6,
    )
)
@example(steps=[({1: "rust", 2: "rust", 3: "sqlite"}, ["rust sqlite"], 2)])  # a tie, cut by id
@example(steps=[({1: "rare x", 2: "x", 3: "x", 4: "x x"}, ["rare x"], 1)])  # x only looked up
@example(steps=[({1: "aa dd", 2: "bb dd", 3: "dd bb", 4: "cc"}, ["aa bb cc dd"], 1)])  # won on dd
def test_rank_equals_a_full_recomputation_to_the_bit(
    steps: list[tuple[dict[int, object], list[str], int]],
) -> None:
    """A corpus's rank, which looks only at the postings of the query's terms, answers as
    `full_bm25` does over every visible row: the same documents, the same floats to the bit,
    the same order and tie-breaks by id, and the same cut at any limit, after every update."""
    corpus = tactmem._Corpus()
    for docs, queries, limit in steps:
        corpus.update([(doc_id, 1, content) for doc_id, content in docs.items()])
        visible = [(doc_id, text) for doc_id, text in docs.items() if isinstance(text, str)]
        for query in queries:
            terms = tactmem._query_terms(query)
            for room in (limit, len(docs)):
                assert corpus.rank(terms, room) == full_bm25(terms, visible, room)


_PRUNED_WORDS = ("rust", "sqlite", "http", "common", "x", "the")
_PRUNED_DOC = st.lists(st.sampled_from(_PRUNED_WORDS), max_size=5)


@given(
    docs=st.dictionaries(
        st.integers(min_value=1, max_value=60),
        st.one_of(_PRUNED_DOC.map(" ".join), st.sampled_from(["rust sqlite", "x x"]), _ODD_ROW),
    ),
    words=st.lists(st.sampled_from((*_PRUNED_WORDS, "nowhere", "absent")), min_size=1, max_size=8),
    limit=st.integers(min_value=1, max_value=5),
)
@example(docs={n: "rust" for n in range(1, 9)} | {9: "sqlite", 10: "x"}, words=["x"], limit=1)
@example(
    docs={1: "rust rust", 2: "x rust", 3: "x", 4: "sqlite x", 5: "x x x", 6: "the"},
    words=["rust", "x", "x", "nowhere"],
    limit=2,
)  # a repeated term, one no document holds, and ties
def test_a_pruned_rank_equals_a_naive_full_one(
    docs: dict[int, object], words: list[str], limit: int
) -> None:
    """With pruning on for every rank (no postings or share floor), a rank at limits 1 to 5
    answers as `full_bm25` does over every visible row: the same documents, the same floats
    to the bit, ties by id, zero scores left out; terms may repeat or be held by no
    document, rows may be hidden or not text, and many scores are equal."""
    corpus = tactmem._Corpus()
    corpus.update([(doc_id, 1, content) for doc_id, content in docs.items()])
    visible = [(doc_id, text) for doc_id, text in docs.items() if isinstance(text, str)]
    terms = sorted(token for word in words for token in tokenize(word))
    with (
        unittest.mock.patch.object(tactmem, "_PRUNE_POSTINGS", 0),
        unittest.mock.patch.object(tactmem, "_PRUNE_SHARE", 0),
    ):
        assert corpus.rank(terms, limit) == full_bm25(terms, visible, limit)


# ============================================================ store rules


_small_limits = st.builds(
    Limits,
    records=st.integers(min_value=1, max_value=8),
    total_content_bytes=st.integers(min_value=1, max_value=200),
)

_amounts = st.integers(min_value=0, max_value=300)


@given(limits=_small_limits, rows=_amounts, content_bytes=_amounts, new_bytes=_amounts)
def test_check_insert_admits_exactly_the_states_within_the_limits(
    limits: Limits, rows: int, content_bytes: int, new_bytes: int
) -> None:
    """An insert passes iff one more row and its bytes still fit; the row bound is checked
    first (reference §5 order)."""
    fits_rows = rows + 1 <= limits.records
    fits_bytes = content_bytes + new_bytes <= limits.total_content_bytes
    try:
        tactmem._check_insert(rows, content_bytes, new_bytes, limits)
    except RecordCapacity as error:
        assert not fits_rows
        assert str(error) == f"memory record capacity of {limits.records} was reached"
    except ContentCapacity as error:
        assert fits_rows and not fits_bytes
        assert str(error) == (
            f"memory content capacity of {limits.total_content_bytes} bytes was reached"
        )
    else:
        assert fits_rows and fits_bytes


@given(limits=_small_limits, content_bytes=_amounts, old_bytes=_amounts, new_bytes=_amounts)
def test_check_replace_admits_exactly_the_states_within_the_limits(
    limits: Limits, content_bytes: int, old_bytes: int, new_bytes: int
) -> None:
    """A replace passes iff the total with the old bytes swapped for the new still fits;
    it never checks the row count."""
    fits = content_bytes - old_bytes + new_bytes <= limits.total_content_bytes
    try:
        tactmem._check_replace(content_bytes, old_bytes, new_bytes, limits)
    except ContentCapacity:
        assert not fits
    else:
        assert fits


_FOREIGN_DEADLINES = st.one_of(
    st.none(),
    st.integers(0, 30),
    st.floats(0, 30, allow_nan=False),
    st.sampled_from(["soon", "12", b"7"]),
)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(st.tuples(_FOREIGN_DEADLINES, st.integers(0, 2)), max_size=8),
    now=st.integers(0, 30),
)
def test_a_prune_removes_exactly_the_rows_expired_names(
    rows: list[tuple[object, int]], now: int
) -> None:
    """The SQL only pre-filters (a passed deadline is necessary, and never holds for NULL,
    text or a blob); the core's `_expired` decides, over whatever another writer stored."""
    with fast_tmp() as directory:
        path = Path(directory) / "m.sqlite3"
        Store(path).list(now_ms=0)
        connection = raw(path)
        for index, (until, uses) in enumerate(rows):
            connection.execute(
                "INSERT INTO memories (content, normalized_identity, created_at_ms, updated_at_ms,"
                " use_count, probation_until_ms) VALUES (?, ?, 0, 0, ?, ?)",
                (f"row {index}", f"row {index}", uses, until),
            )
        stored = connection.execute("SELECT id, use_count, probation_until_ms FROM memories")
        expected = [
            doc_id
            for doc_id, uses, until in stored.fetchall()
            if not (type(until) in (int, float) and tactmem._expired(uses, until, now))
        ]
        Store(path).list(now_ms=now)
        assert [doc_id for (doc_id,) in connection.execute("SELECT id FROM memories")] == expected
        connection.close()


# ============================================================ the storage boundary


# A small vocabulary with few distinct terms (case variants tokenize alike): duplicates (by case
# and spacing) are common, and most rows share a term, so scans often hit more rows than allowed.
_STORE_WORDS = (
    "rust", "Rust", "RUST", "sqlite", "SQLite", "parse_request", "httpServer", "数据库",
    "数据库连接", "café", "x",
)  # fmt: skip


@st.composite
def word_contents(draw: st.DrawFn) -> str:
    """A few vocabulary words with varied whitespace: duplicates by case and spacing, scan
    hits and the record bound are frequent."""
    words = draw(st.lists(st.sampled_from(_STORE_WORDS), min_size=1, max_size=5))
    text = words[0]
    for word in words[1:]:
        text += draw(_STORE_SEPARATORS) + word
    if draw(st.booleans()):
        text = draw(_STORE_SEPARATORS) + text + draw(_STORE_SEPARATORS)
    return text


@st.composite
def edge_contents(draw: st.DrawFn) -> str:
    """Blank, secret-shaped, or large: 30 to 50 bytes (the bound is 48), so a few of them
    exhaust the 120-byte content budget."""
    kind = draw(st.sampled_from(["blank", "secret", "large", "large", "large"]), label="kind")
    if kind == "blank":
        return draw(st.sampled_from(["", " ", "\n\t", "\u3000", "\xa0 \xa0"]))
    if kind == "secret":
        return draw(st.sampled_from(_STORE_SECRETS))
    word = draw(st.sampled_from(["rust", "sqlite", "数据库", "é"]))
    target = draw(st.integers(min_value=30, max_value=50), label="bytes")
    return word + " " + "y" * max(0, target - utf8_size(word) - 1)


_store_queries = st.one_of(
    st.lists(st.sampled_from(_STORE_WORDS), min_size=1, max_size=2).map(" ".join),
    st.lists(st.sampled_from(_STORE_WORDS), min_size=1, max_size=2).map(" ".join),
    st.lists(st.sampled_from(_STORE_WORDS), min_size=1, max_size=2).map(" ".join),
    # no terms, no overlap, a hidden secret's value, most rows, and 33 to 35 bytes (bound: 32)
    st.sampled_from(
        ["", "no-overlap", "w", "rust sqlite 数据库 x", "sqlite " * 5, "é" * 17, "z" * 32]
    ),
)


# `Backend` is the whole contract between the hosts and a store. `DictBackend` keeps its rows in
# a dict and takes every rule from the core, as a second backend must; the tool over it must
# answer exactly as the tool over a SQLite `Store`.


@attrs.define
class DictBackend:
    """An in-memory `Backend`: each operation computes new rows and keeps them only when it
    succeeds, so it is all-or-nothing like a transaction."""

    limits: Limits
    rows: dict[int, tuple[Record, str]] = attrs.Factory(dict)  # id -> (record, identity)
    next_id: int = 1
    corpus: Any = attrs.Factory(tactmem._Corpus)

    def pruned(self, now_ms: int) -> dict[int, tuple[Record, str]]:
        return {
            doc_id: (record, identity)
            for doc_id, (record, identity) in self.rows.items()
            if not tactmem._expired(record.use_count, record.probation_until_ms, now_ms)
        }

    def scan(
        self, query: str, *, limit: int = 5, min_coverage: float = 0.0, now_ms: int | None = None
    ) -> ScanResult:
        terms, now = tactmem._scan_terms(query, self.limits), tactmem._now_ms(now_ms)
        floor = tactmem._check_min_coverage(min_coverage)
        rows = self.pruned(now)
        self.corpus.update([(i, r.key.version, r.content) for i, (r, _) in rows.items()])
        plan = tactmem._plan_scan(self.corpus, terms, limit, self.limits, floor)
        for doc_id in plan.scanned:
            record, identity = rows[doc_id]
            scanned = attrs.evolve(record, last_scanned_at_ms=now, scan_count=record.scan_count + 1)
            rows[doc_id] = (scanned, identity)
        self.rows = rows
        return plan.result

    def read(self, ids: Iterable[int], *, now_ms: int | None = None) -> tuple[Record, ...]:
        wanted, now = tactmem._read_ids(ids, self.limits), tactmem._now_ms(now_ms)
        rows = self.pruned(now)
        records = tactmem._plan_read(wanted, (rows[i][0] for i in wanted if i in rows), now)
        rows.update((record.key.id, (record, rows[record.key.id][1])) for record in records)
        self.rows = rows
        return records

    def put(self, content: str, *, replace: Key | None = None, now_ms: int | None = None) -> Record:
        put = tactmem._check_put(content, replace, self.limits, tactmem._now_ms(now_ms))
        rows = self.pruned(put.now_ms)
        target = rows.get(replace.id) if replace is not None else None
        state = tactmem._PutState(
            rows=len(rows),
            content_bytes=sum(utf8_size(record.content) for record, _ in rows.values()),
            next_id=self.next_id,
            duplicate_of=next((i for i, (_, same) in rows.items() if same == put.identity), None),
            target_version=None if target is None else target[0].key.version,
            target_bytes=0 if target is None else utf8_size(target[0].content),
            target_created_at_ms=0 if target is None else target[0].created_at_ms,
        )
        plan = tactmem._plan_put(put, state, self.limits)
        rows[plan.record.key.id] = (plan.record, put.identity)
        self.rows, self.next_id = rows, max(self.next_id, plan.record.key.id + 1)
        return plan.record

    def delete(self, key: Key, *, now_ms: int | None = None) -> None:
        current = self.rows.get(key.id)  # delete never prunes
        tactmem._check_version(key, None if current is None else current[0].key.version)
        del self.rows[key.id]

    def list(self, *, now_ms: int | None = None) -> tuple[Record, ...]:
        self.rows = self.pruned(tactmem._now_ms(now_ms))
        return tuple(
            record for _, (record, _) in sorted(self.rows.items()) if tactmem._shown(record)
        )


# The backends to hold to `Store`'s answers: add yours (a class or factory taking `Limits`).
BACKENDS: list[Callable[[Limits], tactmem.Backend]] = [DictBackend]

_CALLS = st.one_of(
    st.builds(lambda query, limit: {"operation": "scan", "query": query, "limit": limit},
              _store_queries.filter(str.strip), st.sampled_from([1, 2, 2, 3])),
    st.builds(lambda ids: {"operation": "read", "ids": ids},
              st.lists(st.integers(1, 7), max_size=4)),
    st.builds(lambda content: {"operation": "put", "content": content},  # often: bounds bind
              word_contents() | word_contents() | edge_contents()),
    st.builds(lambda content: {"operation": "put", "content": content}, word_contents()),
    st.builds(lambda content, doc_id, version: {"operation": "put", "content": content,
                                                "replace": {"id": doc_id, "version": version}},
              word_contents(), st.integers(1, 7), st.integers(1, 3)),
    st.builds(lambda doc_id, version: {"operation": "delete", "id": doc_id, "version": version},
              st.integers(1, 7), st.integers(1, 3)),
)  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(
    steps=st.lists(
        st.tuples(_CALLS, st.sampled_from([0, 0, 0, 1, 4, 10, 11])), min_size=1, max_size=40
    )
)
@example(steps=[({"operation": "put", "content": f"rust {w}"}, 0) for w in "abcde"])  # full
@example(
    steps=[
        ({"operation": "put", "content": "rust one"}, 0),
        ({"operation": "read", "ids": [1]}, 1),
        ({"operation": "put", "content": "rust two", "replace": {"id": 1, "version": 1}}, 1),
        ({"operation": "delete", "id": 1, "version": 1}, 1),
        ({"operation": "delete", "id": 1, "version": 2}, 1),
        ({"operation": "put", "content": "rust three"}, 11),
    ]
)
@pytest.mark.parametrize("second_backend", BACKENDS)
def test_the_tool_answers_alike_over_any_backend(
    second_backend: Callable[[Limits], tactmem.Backend], steps: list[tuple[dict[str, Any], int]]
) -> None:
    """The same calls through `MemoryTool` over a SQLite `Store` and over a second backend get
    the same answers, and leave the same records (tiny limits: every bound and probation is
    hit). So the tool needs nothing of a store but `Backend`, and the core's rules are all a
    second backend has to reuse."""
    with fast_tmp() as directory, Store(Path(directory) / "m.sqlite3", limits=TINY) as store:
        tools = [MemoryTool(store, root=True), MemoryTool(second_backend(TINY), root=True)]
        now = START_MS
        for call, elapsed_ms in steps:
            now += elapsed_ms
            gate = [{"operation": "scan", "query": "rust"}] if call["operation"] == "put" else []
            for request in [*gate, call]:  # a put follows a scan, as an agent's would
                sqlite_answer, dict_answer = (tool.call(request, now_ms=now) for tool in tools)
                assert sqlite_answer == dict_answer, request
            event("answer: " + sqlite_answer.get("error", {}).get("code", call["operation"]))
        assert store.list(now_ms=now) == tools[1].store.list(now_ms=now)
        _, effects = tactmem._browse_step(tactmem._Browser(), ("key", "ctrl-r"))
        sqlite_load, dict_load = (
            tactmem._carry_out(effects[0], b) for b in (store, tools[1].store)
        )
        assert sqlite_load is not None and dict_load is not None  # the browser loads alike, too
        assert sqlite_load[0] == "loaded" and sqlite_load[:2] == dict_load[:2]


# ============================================================ opening and checking the database


MEMORY_COLUMNS = (
    "content", "normalized_identity", "created_at_ms", "updated_at_ms", "last_scanned_at_ms",
    "scan_count", "last_used_at_ms", "use_count", "probation_until_ms", "version",
)  # fmt: skip

SQL_VALUES = st.one_of(
    st.none(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=40),
    st.binary(max_size=40),
    st.sampled_from([b"\xc3\x28", b"\xed\xa0\x80"]).map(lambda b: ("not utf-8", b)),
)

# Objects another program could plant; any one of them makes the file one to refuse untouched.
PLANTS = (
    "CREATE TRIGGER planted AFTER UPDATE ON memories BEGIN INSERT INTO memories (content,"
    " normalized_identity, created_at_ms, updated_at_ms) SELECT 'p' || random(), 'p' || random(),"
    " 0, 0 FROM memories; END",
    "CREATE TRIGGER planted AFTER INSERT ON memories BEGIN DELETE FROM memories; END",
    "CREATE TRIGGER planted BEFORE UPDATE ON memory_metadata BEGIN SELECT 1; END",
    "CREATE VIEW planted AS SELECT * FROM memories",
    "CREATE INDEX planted ON memories (content)",
    "ALTER TABLE memories ADD COLUMN planted TEXT",
    "CREATE TABLE planted (x)",
    # a schema row whose name is not UTF-8, written past SQLite's own checks
    "PRAGMA writable_schema = ON; INSERT INTO sqlite_schema VALUES ('table', CAST(x'ff41' AS TEXT),"
    " CAST(x'ff41' AS TEXT), 0, 'CREATE TABLE x (y)')",
)


@st.composite
def hostile_files(draw: st.DrawFn) -> tuple[list[tuple[int, str, Any]], Any, str | None, int]:
    """Row damage `(id, column, value)`, a damaged allocator, a planted object, user_version."""
    damage = draw(
        st.lists(st.tuples(st.integers(1, 4), st.sampled_from(MEMORY_COLUMNS), SQL_VALUES),
                 max_size=6)
    )  # fmt: skip
    allocator = draw(st.one_of(st.just(None), SQL_VALUES))
    plant = draw(st.one_of(st.just(None), st.just(None), st.sampled_from(PLANTS)))
    version = draw(st.sampled_from([1, 1, 1, 0, 2]))
    return damage, allocator, plant, version


def damage_file(path: Path, file: tuple[list[tuple[int, str, Any]], Any, str | None, int]) -> None:
    damage, allocator, plant, version = file
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as connection:
        connection.execute("PRAGMA ignore_check_constraints = ON")  # version 0, counts below 0
        # a ("not utf-8", bytes) value is bytes SQLite will hold as TEXT that is not UTF-8
        changes = [(f"memories SET {column}", value, doc_id) for doc_id, column, value in damage]
        if allocator is not None:
            changes.append(("memory_metadata SET next_id", allocator, 1))
        for change, value, doc_id in changes:
            cast = "CAST(? AS TEXT)" if isinstance(value, tuple) else "?"
            with contextlib.suppress(sqlite3.IntegrityError):  # NOT NULL, CHECK, UNIQUE
                connection.execute(
                    f"UPDATE {change} = {cast} WHERE id = ?",
                    (value[1] if isinstance(value, tuple) else value, doc_id),
                )
        if plant is not None:
            connection.executescript(plant)
        connection.execute(f"PRAGMA user_version = {version}")


HOSTILE_CALLS = st.lists(
    st.one_of(
        st.fixed_dictionaries(
            {"operation": st.just("scan"), "query": st.sampled_from(["rust", "sqlite x"])}
        ),
        st.fixed_dictionaries(
            {"operation": st.just("read"), "ids": st.lists(st.integers(1, 6), max_size=5)}
        ),
        st.fixed_dictionaries(
            {"operation": st.just("put"), "content": st.sampled_from(["fresh one", "rust"])}
        ),
        st.fixed_dictionaries({
            "operation": st.just("put"), "content": st.sampled_from(["mended", "rust again"]),
            "replace": st.fixed_dictionaries(
                {"id": st.integers(1, 5), "version": st.integers(1, 2)}
            ),
        }),
        st.fixed_dictionaries(
            {"operation": st.just("delete"), "id": st.integers(1, 5), "version": st.integers(1, 2)}
        ),
    ),
    min_size=1,
    max_size=8,
)  # fmt: skip


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(file=hostile_files(), calls=HOSTILE_CALLS)
def test_hostile_files_are_refused_untouched_or_served_safely(
    file: tuple[list[tuple[int, str, Any]], Any, str | None, int], calls: list[dict[str, Any]]
) -> None:
    """A store file damaged the ways another program could (wrong-typed values in any column,
    a broken allocator, a planted trigger, view, index, column or table, another user_version):
    `Store` and the tool never raise anything but a `TactmemError`, every answer is valid
    output, a planted object or an unsupported version leaves the file byte for byte as it was,
    and otherwise the store keeps its bounds and SQLite finds the file sound."""
    _, _, plant, version = file
    limits = Limits(records=6, total_content_bytes=2000)
    with fast_tmp() as directory:
        path = Path(directory) / "memory.sqlite3"
        with Store(path, limits=limits) as store:
            for text in ("rust sqlite one", "rust sqlite two", "sqlite three", "rust four"):
                store.put(text)
        damage_file(path, file)
        before = path.read_bytes()
        damaged: list[Any] = []  # what SQLite finds wrong now (broken CHECKs, say)
        with (
            contextlib.closing(sqlite3.connect(path)) as connection,
            contextlib.suppress(sqlite3.Error, UnicodeDecodeError),  # a file SQLite cannot read
        ):
            damaged = connection.execute("PRAGMA integrity_check").fetchall()
        refused = plant is not None or version == 2
        with Store(path, limits=limits) as store:
            tool = MemoryTool(store, root=True)
            for request in [{"operation": "scan", "query": "rust"}, *calls]:
                answer = tool.call(request)
                OUTPUT_SCHEMA.validate(answer)
                json.dumps(answer)
                if refused:
                    refusals = ("storage_error", "unsupported_schema", "scan_required")
                    assert answer["error"]["code"] in refusals
                event("answer: " + answer.get("error", {}).get("code", answer.get("operation", "")))
            for operation in (store.list, functools.partial(tactmem._stats, store)):
                if refused:
                    with pytest.raises((tactmem.StorageError, tactmem.UnsupportedSchema)):
                        operation()
                else:
                    json.dumps(tactmem._to_json(operation()))
            if not refused:
                assert all(map(tactmem._shown, store.list()))
                event(f"rows hidden: {tactmem._stats(store)['hidden_records'] > 0}")
        if refused:
            assert path.read_bytes() == before
            return
        with contextlib.closing(sqlite3.connect(path)) as connection:
            # never worse than the damage: what was broken may still be, nothing more
            after = connection.execute("PRAGMA integrity_check").fetchall()
            assert after == [("ok",)] or set(after) <= set(damaged)
            (rows,) = connection.execute("SELECT COUNT(*) FROM memories").fetchone()
        assert rows <= limits.records


# ============================================================ the SQLite store


TINY = Limits(
    content_bytes=48,
    records=4,
    total_content_bytes=120,
    scan_results=2,
    query_bytes=32,
    probation_ms=10,
)

START_MS = 1000

_STORE_SEPARATORS = st.sampled_from([" ", " ", " ", "  ", "\n", "\t", "\xa0", "\u3000"])

_STORE_SECRETS = (
    "password=w",
    "token=abcdefghijklmnop",
    "sk-1234567890123456",
    "rust Bearer abcdefghijk1234",
    "https://user:pw@host/x",
)


agents = st.sampled_from([0, 1])  # which of the two stores on the file does the operation


@attrs.frozen
class Fails:
    """The model's prediction that an operation raises this error (and changes nothing)."""

    error: type[TactmemError]


def expected_message(error: type[TactmemError], limits: Limits) -> str:
    """The reference's wording (§5) for each error the store can raise here."""
    messages: dict[type[TactmemError], str] = {
        EmptyContent: "memory content is empty",
        ContentTooLarge: f"memory content exceeds the {limits.content_bytes}-byte limit",
        QueryTooLarge: f"memory query exceeds the {limits.query_bytes}-byte limit",
        RecordCapacity: f"memory record capacity of {limits.records} was reached",
        ContentCapacity: (
            f"memory content capacity of {limits.total_content_bytes} bytes was reached"
        ),
        SecretRejected: "memory content was rejected as a likely secret",
        Duplicate: "an equivalent memory already exists",
        NotFound: "memory was not found",
        Conflict: "memory changed since it was read",
    }
    return messages[error]


def coverage_of(query: str, content: str, docs: Sequence[str]) -> float:
    """docs/evaluation.md's coverage, computed from its definition: the query's distinct terms less
    function words (all if none is left), each weighing sqrt(idf) over the visible docs; the
    share of that weight whose terms occur in `content` as they are or by stem."""
    terms = sorted(set(tokenize(query)))
    subject = [term for term in terms if term not in tactmem._FUNCTION_WORDS] or terms
    held = set(tokenize(content))
    stems = {tactmem._stem(term) for term in held}
    counted = [set(tokenize(doc)) for doc in docs]
    weights = []
    for term in subject:
        df = sum(term in doc for doc in counted)
        weights.append(math.sqrt(math.log(1 + (len(docs) - df + 0.5) / (df + 0.5))))
    hit = sum(
        w for t, w in zip(subject, weights, strict=True) if t in held or tactmem._stem(t) in stems
    )
    return hit / sum(weights)


def utf8_size(text: str) -> int:
    return len(text.encode("utf-8"))


@attrs.define
class Model:
    """The reference semantics (§5-8) over a dict of rows. Every method returns the predicted
    outcome and changes the model only when the operation succeeds, as the store must.

    `rows` mirrors the table exactly, expired probation rows included until an operation that
    prunes runs. The model trusts tactmem's pure functions (rank, preview, find_secret,
    normalized_identity): they have their own properties above.
    """

    limits: Limits
    now: int = START_MS
    rows: dict[int, Record] = attrs.Factory(dict)
    # The highest id ever allocated. A new row gets last_id + 1 (the allocator of SPEC §2.1 and
    # reference §6: max(next_id, max(id) + 1)), so ids are never reused, even after deletes.
    last_id: int = 0

    def pruned(self) -> dict[int, Record]:
        """The rows left after §7's prune at `now`: the core's one predicate decides."""
        return {
            doc_id: row
            for doc_id, row in self.rows.items()
            if not tactmem._expired(row.use_count, row.probation_until_ms, self.now)
        }

    @staticmethod
    def visible(row: Record) -> bool:
        return find_secret(row.content) is None

    def put(self, content: str, replace: Key | None) -> Record | Fails:
        if not content.strip(WHITE_SPACE):
            return Fails(EmptyContent)
        if utf8_size(content) > self.limits.content_bytes:
            return Fails(ContentTooLarge)
        if find_secret(content) is not None:
            return Fails(SecretRejected)
        rows = self.pruned()
        identity = normalized_identity(content)
        total = sum(utf8_size(row.content) for row in rows.values())
        probation = self.now + self.limits.probation_ms
        if replace is None:
            if any(normalized_identity(row.content) == identity for row in rows.values()):
                return Fails(Duplicate)
            if len(rows) >= self.limits.records:
                return Fails(RecordCapacity)
            if total + utf8_size(content) > self.limits.total_content_bytes:
                return Fails(ContentCapacity)
            self.last_id += 1
            key = Key(self.last_id, 1)
            created = self.now
        else:
            old = rows.get(replace.id)
            if old is None:
                return Fails(NotFound)
            if old.key.version != replace.version:
                return Fails(Conflict)
            if any(
                normalized_identity(row.content) == identity
                for doc_id, row in rows.items()
                if doc_id != replace.id
            ):
                return Fails(Duplicate)
            if total - utf8_size(old.content) + utf8_size(content) > (
                self.limits.total_content_bytes
            ):
                return Fails(ContentCapacity)
            key = Key(replace.id, replace.version + 1)
            created = old.created_at_ms
        record = Record(
            key=key,
            content=content,
            created_at_ms=created,
            updated_at_ms=self.now,
            last_scanned_at_ms=None,
            scan_count=0,
            last_used_at_ms=None,
            use_count=0,
            probation_until_ms=probation,
        )
        rows[key.id] = record
        self.rows = rows
        return record

    def delete(self, key: Key) -> Fails | None:
        row = self.rows.get(key.id)  # delete never prunes
        if row is None:
            return Fails(NotFound)
        if row.key.version != key.version:
            return Fails(Conflict)
        del self.rows[key.id]
        return None

    def scan(self, query: str, limit: int, min_coverage: float = 0.0) -> ScanResult | Fails:
        if utf8_size(query) > self.limits.query_bytes:
            return Fails(QueryTooLarge)
        rows = self.pruned()
        docs = [(doc_id, row.content) for doc_id, row in rows.items() if self.visible(row)]
        everything = rank(query, docs, limit=len(docs))
        covered = [
            (doc_id, score, coverage_of(query, rows[doc_id].content, [text for _, text in docs]))
            for doc_id, score in everything
        ]
        ranked = [card for card in covered if card[2] >= min_coverage]
        ranked = ranked[: min(limit, self.limits.scan_results)]
        candidates = tuple(
            Candidate(rows[doc_id].key, preview(rows[doc_id].content), score, coverage)
            for doc_id, score, coverage in ranked
        )
        reason: tactmem._Abstention | None = (
            None if candidates
            else "no_terms" if not tokenize(query)
            else "low_coverage" if everything
            else "no_overlap"
        )  # fmt: skip
        for doc_id, _, _ in ranked:
            rows[doc_id] = attrs.evolve(
                rows[doc_id], scan_count=rows[doc_id].scan_count + 1, last_scanned_at_ms=self.now
            )
        self.rows = rows
        return ScanResult(abstained=not candidates, candidates=candidates, reason=reason)

    def read(self, ids: Sequence[int]) -> tuple[Record, ...]:
        rows = self.pruned()
        found: list[Record] = []
        for doc_id in dict.fromkeys(ids):
            row = rows.get(doc_id)
            if row is not None and self.visible(row):
                row = attrs.evolve(
                    row,
                    use_count=row.use_count + 1,
                    last_used_at_ms=self.now,
                    probation_until_ms=None,
                )
                rows[doc_id] = row
                found.append(row)
        self.rows = rows
        return tuple(found)

    def list(self) -> tuple[Record, ...]:
        self.rows = self.pruned()
        return tuple(row for _, row in sorted(self.rows.items()) if self.visible(row))


def outcome(call: Callable[[], object]) -> object:
    """The call's result, or the TactmemError it raised."""
    try:
        return call()
    except TactmemError as error:
        return error


def assert_agree(actual: object, expected: object, limits: Limits) -> None:
    """The store did what the model predicted: the same value, or the same error class with
    the reference's message and a stable snake-case code."""
    if isinstance(expected, Fails):
        assert isinstance(actual, TactmemError), (
            f"expected {expected.error.__name__}, got {actual!r}"
        )
        assert type(actual) is expected.error, f"expected {expected.error.__name__}: {actual!r}"
        assert str(actual) == expected_message(expected.error, limits)
        assert re.fullmatch(r"[a-z][a-z_]*", actual.code)
    else:
        assert not isinstance(actual, TactmemError), f"expected {expected!r}, raised {actual!r}"
        assert actual == expected


CHECKED_BEFORE_THE_DATABASE = (EmptyContent, ContentTooLarge, SecretRejected, QueryTooLarge)

RECORD_COLUMNS = (
    "id, version, content, created_at_ms, updated_at_ms, last_scanned_at_ms, scan_count,"
    " last_used_at_ms, use_count, probation_until_ms"
)


class StoreMatchesModel(RuleBasedStateMachine):
    """Two Stores on one file (two agent processes, each with its own connection and caches)
    against one Model: every operation through either must agree with the model."""

    def __init__(self) -> None:
        super().__init__()
        self.directory = tempfile.mkdtemp(prefix="tactmem-properties-")
        self.path = os.path.join(self.directory, "memory", "v1.sqlite3")
        self.stores = [Store(self.path, limits=TINY), Store(self.path, limits=TINY)]
        self.model = Model(TINY)
        assert not os.path.exists(self.path), "Store() must not touch disk"

    def teardown(self) -> None:
        for store in self.stores:
            store.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    # -------------------------------------------------------------------- helpers

    def key(self, pick: int, version_offset: int) -> Key:
        """A key to a live row (picks 0-7, when there is one), else to any id ever allocated or
        one never allocated; its version is shifted by `version_offset` (an id that is gone
        counts as version 1)."""
        live = sorted(self.model.rows)
        if live and pick < 8:
            doc_id = live[pick % len(live)]
        else:
            ids = [*range(1, self.model.last_id + 1), self.model.last_id + 7]
            doc_id = ids[pick % len(ids)]
        row = self.model.rows.get(doc_id)
        version = row.key.version if row is not None else 1
        return Key(doc_id, max(1, version + version_offset))

    def check(self, call: Callable[[], object], expected: object) -> None:
        """Run one store operation and compare it with the model's prediction. Input that
        fails validation fails before the database is touched: a fresh store makes no file."""
        existed = os.path.exists(self.path)
        assert_agree(outcome(call), expected, TINY)
        if isinstance(expected, Fails) and expected.error in CHECKED_BEFORE_THE_DATABASE:
            assert existed or not os.path.exists(self.path), (
                f"{expected.error.__name__} must be raised before the database is opened"
            )

    # -------------------------------------------------------------------- rules

    @initialize(contents=st.lists(word_contents(), max_size=4))
    def seed(self, contents: list[str]) -> None:
        """First, input that fails validation on the fresh stores: it must fail before the
        database is touched, so no file appears. Then a few rows, so every rule has something
        to hit."""
        for content in ("\u3000\n", "y" * (TINY.content_bytes + 1), "password=w"):
            self.put_edge_case(content, agent=0)
        self.scan("z" * (TINY.query_bytes + 1), limit=1, agent=1, floor=0.0)
        assert not os.path.exists(self.path)
        for content in contents:
            self.put(content, agent=0)

    @rule(content=word_contents(), agent=agents)
    def put(self, content: str, agent: int) -> None:
        """Insert vocabulary content: the model's record (next id, version 1) or error."""
        expected = self.model.put(content, None)
        store = self.stores[agent]
        self.check(lambda: store.put(content, now_ms=self.model.now), expected)

    @rule(content=edge_contents(), agent=agents)
    def put_edge_case(self, content: str, agent: int) -> None:
        """Insert blank, secret-shaped or large content."""
        expected = self.model.put(content, None)
        store = self.stores[agent]
        self.check(lambda: store.put(content, now_ms=self.model.now), expected)

    @rule(
        content=st.one_of(word_contents(), word_contents(), edge_contents()),
        pick=st.integers(min_value=0, max_value=9),
        version_offset=st.sampled_from([0, 0, 0, -1, 1]),
        agent=agents,
    )
    def replace(self, content: str, pick: int, version_offset: int, agent: int) -> None:
        """Replace with the current version (or a stale or missing key)."""
        key = self.key(pick, version_offset)
        expected = self.model.put(content, key)
        store = self.stores[agent]
        self.check(lambda: store.put(content, replace=key, now_ms=self.model.now), expected)

    @rule(
        pick=st.integers(min_value=0, max_value=9),
        source=st.integers(min_value=0, max_value=9),
        version_offset=st.sampled_from([0, 0, 0, -1]),
        agent=agents,
    )
    def replace_with_a_respelling(
        self, pick: int, source: int, version_offset: int, agent: int
    ) -> None:
        """Replace a row with a live row's content re-cased and re-spaced: the row's own
        identity may be kept (the version still goes up), another row's is Duplicate."""
        key = self.key(pick, version_offset)
        original = self.model.rows.get(self.key(source, 0).id)
        if original is None:
            return
        content = "\t" + "  ".join(original.content.split(" ")).upper() + "\n"
        expected = self.model.put(content, key)
        store = self.stores[agent]
        self.check(lambda: store.put(content, replace=key, now_ms=self.model.now), expected)

    @rule(
        pick=st.integers(min_value=0, max_value=9),
        version_offset=st.sampled_from([0, 0, -1, 1]),
        agent=agents,
    )
    def delete(self, pick: int, version_offset: int, agent: int) -> None:
        """Delete with the current version, a stale one, or a missing id; never prunes."""
        key = self.key(pick, version_offset)
        expected = self.model.delete(key)
        store = self.stores[agent]
        self.check(lambda: store.delete(key, now_ms=self.model.now), expected)

    @rule(
        query=_store_queries,
        limit=st.integers(min_value=1, max_value=TINY.scan_results + 2),
        agent=agents,
        floor=st.sampled_from([0.0, 0.0, 0.3, 0.6, 1.0]),
    )
    def scan(self, query: str, limit: int, agent: int, floor: float) -> None:
        """Scan: the same candidates, scores, coverage and previews, only those covering at
        least `floor` of the query, best first; telemetry on those only."""
        expected = self.model.scan(query, limit, floor)
        store = self.stores[agent]
        self.check(
            lambda: store.scan(query, limit=limit, min_coverage=floor, now_ms=self.model.now),
            expected,
        )

    @rule(picks=st.lists(st.integers(min_value=0, max_value=9), max_size=5), agent=agents)
    def read(self, picks: list[int], agent: int) -> None:
        """Read ids (live, deleted, never allocated, repeated): de-duplicated, in order."""
        ids = [self.key(pick, 0).id for pick in picks]
        expected = self.model.read(ids)
        store = self.stores[agent]
        self.check(lambda: store.read(ids, now_ms=self.model.now), expected)

    @rule(agent=agents)
    def list_records(self, agent: int) -> None:
        """List: visible rows by id, pruned, no telemetry."""
        expected = self.model.list()
        store = self.stores[agent]
        self.check(lambda: store.list(now_ms=self.model.now), expected)

    @rule(
        delta_ms=st.one_of(
            st.integers(min_value=0, max_value=3),
            st.integers(min_value=0, max_value=3),
            st.integers(min_value=0, max_value=3),
            st.integers(min_value=TINY.probation_ms, max_value=10_000),
        )
    )
    def advance_time(self, delta_ms: int) -> None:
        """Time moves forward, sometimes past every probation deadline."""
        self.model.now += delta_ms

    @rule(offset_ms=st.sampled_from([0, 0, -1]))
    def advance_to_a_deadline(self, offset_ms: int) -> None:
        """Jump to the earliest pending probation deadline (or just before it): the deadline
        is inclusive, so an unread row is pruned at exactly `probation_until_ms`."""
        deadlines = [
            row.probation_until_ms
            for row in self.model.rows.values()
            if row.probation_until_ms is not None and row.probation_until_ms > self.model.now
        ]
        if deadlines:
            self.model.now = max(self.model.now, min(deadlines) + offset_ms)

    @rule(cut=st.integers(min_value=0, max_value=4000), junk=st.binary(max_size=40))
    def damage_the_side_cache(self, cut: int, junk: bytes) -> None:
        """A torn or scribbled side cache (issue 16) changes no answer: it is a cache."""
        cache = Path(self.path + "-cache")
        if cache.is_file():
            data = cache.read_bytes()
            cache.write_bytes(data[:cut] + junk + data[cut + len(junk) :])
            event("side cache damaged")

    @rule(agent=agents, as_context_manager=st.booleans())
    def close_and_reopen(self, agent: int, as_context_manager: bool) -> None:
        """A new Store on the same path sees the same data."""
        if as_context_manager:
            with self.stores[agent]:
                pass
        else:
            self.stores[agent].close()
        self.stores[agent] = Store(self.path, limits=TINY)

    @rule(
        content=st.sampled_from(
            (*_STORE_SECRETS, "rust password=w", "SQLite token=abcdefghijklmno")
        ),
        graduated=st.booleans(),
    )
    def insert_legacy_secret_row(self, content: str, graduated: bool) -> None:
        """A secret-shaped row written by an older build (raw SQL, reference test 13): hidden
        from scan, read and list, yet counted by every bound, deletable and replaceable."""
        rows = self.model.rows
        total = sum(utf8_size(row.content) for row in rows.values())
        identity = normalized_identity(content)
        if (
            not os.path.exists(self.path)
            or len(rows) >= TINY.records
            or total + utf8_size(content) > TINY.total_content_bytes
            or any(normalized_identity(row.content) == identity for row in rows.values())
        ):
            return  # the raw row would break a bound the store relies on; skip it
        record = Record(
            key=Key(self.model.last_id + 1, 1),
            content=content,
            created_at_ms=self.model.now,
            updated_at_ms=self.model.now,
            last_scanned_at_ms=None,
            scan_count=0,
            last_used_at_ms=None,
            use_count=0,
            probation_until_ms=None if graduated else self.model.now + TINY.probation_ms,
        )
        connection = sqlite3.connect(self.path, timeout=5, isolation_level=None)
        try:
            connection.execute(
                "INSERT INTO memories (id, version, content, normalized_identity, created_at_ms,"
                " updated_at_ms, scan_count, use_count, probation_until_ms)"
                " VALUES (?, 1, ?, ?, ?, ?, 0, 0, ?)",
                (
                    record.key.id,
                    content,
                    identity,
                    record.created_at_ms,
                    record.updated_at_ms,
                    record.probation_until_ms,
                ),
            )
        finally:
            connection.close()
        self.model.last_id += 1
        self.model.rows[record.key.id] = record

    @rule(agent=agents)
    def export_and_restore(self, agent: int) -> None:
        """Export (which changes nothing: the invariant reads the file), then restore it into
        a new store with the same limits: it holds every visible live record exactly, and
        the allocator, and exports the same bytes; merged into another new store, the same
        contents get fresh keys."""
        now = self.model.now
        backup = tactmem.export(self.stores[agent], now_ms=now)
        live = [row for _, row in sorted(self.model.pruned().items()) if self.model.visible(row)]
        assert (backup.records, backup.next_id) == (len(live), self.model.last_id + 1)
        event(f"exported {len(live)} of {len(self.model.rows)} rows")
        with fast_tmp() as directory:
            restored = Store(os.path.join(directory, "restored.sqlite3"), limits=TINY)
            merged = Store(os.path.join(directory, "merged.sqlite3"), limits=TINY)
            with restored, merged:
                assert tactmem.restore(restored, backup.data) == len(live)
                assert restored.list(now_ms=now) == tuple(live)
                assert tactmem.export(restored, now_ms=now).data == backup.data
                with raw(Path(restored.path)) as connection:
                    allocator = connection.execute("SELECT next_id FROM memory_metadata")
                    assert allocator.fetchone() == (self.model.last_id + 1,)
                assert tactmem.merge(merged, backup.data, now_ms=now) == tactmem.Merged(
                    len(live), 0
                )
                fresh = merged.list(now_ms=now)
                assert [record.content for record in fresh] == [row.content for row in live]
                assert [record.key for record in fresh] == [
                    Key(i, 1) for i in range(1, len(live) + 1)
                ]

    # -------------------------------------------------------------------- invariants

    @invariant()
    def disk_matches_model_within_bounds(self) -> None:
        """The table is exactly the model's rows (so failures changed nothing and telemetry
        is exact), every bound holds, the file is intact, private and not in WAL mode.
        Read through a separate read-only connection, so nothing is pruned or touched."""
        if not os.path.exists(self.path):
            assert self.model.rows == {}
            return
        connection = sqlite3.connect(Path(self.path).as_uri() + "?mode=ro", uri=True, timeout=5)
        try:
            stored = [
                Record(Key(row[0], row[1]), *row[2:])
                for row in connection.execute(f"SELECT {RECORD_COLUMNS} FROM memories ORDER BY id")
            ]
            (content_bytes,) = connection.execute(
                "SELECT COALESCE(SUM(length(CAST(content AS BLOB))), 0) FROM memories"
            ).fetchone()
            (integrity,) = connection.execute("PRAGMA integrity_check").fetchone()
            (user_version,) = connection.execute("PRAGMA user_version").fetchone()
            (journal_mode,) = connection.execute("PRAGMA journal_mode").fetchone()
        finally:
            connection.close()
        assert stored == [row for _, row in sorted(self.model.rows.items())]
        unread = [r.probation_until_ms for r in stored if r.use_count == 0]
        for store in self.stores:  # totals a store would trust (no other commit since) are exact
            known = store._totals
            if known is None or store._connection is None:
                continue
            (data_version,) = store._connection.execute("PRAGMA data_version").fetchone()
            if data_version == store._seen_version:
                assert (known.rows, known.content_bytes) == (len(stored), content_bytes)
                ends = [until for until in unread if until is not None]
                assert not ends or (known.expires is not None and known.expires <= min(ends))
        assert len(stored) <= TINY.records
        assert content_bytes <= TINY.total_content_bytes
        assert os.path.getsize(self.path) <= TINY.database_bytes
        assert integrity == "ok"
        assert user_version == 1
        assert journal_mode == "delete"
        assert not os.path.exists(self.path + "-wal")
        assert not os.path.exists(self.path + "-journal")  # no transaction is left open
        assert stat.S_IMODE(os.stat(self.path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(self.path)).st_mode) == 0o700


# max_examples comes from the profile: 100 by default and in CI (about 10 s on 2 cores).
StoreMatchesModel.TestCase.settings = settings(
    stateful_step_count=50,
    deadline=None,  # every step is a real SQLite transaction with a sync to disk
    suppress_health_check=[HealthCheck.too_slow],
)

TestStoreMatchesModel = StoreMatchesModel.TestCase


# ============================================================ the browser (pure)


def _cells(text: str) -> int:
    return sum(tactmem._cell_width(char) for char in text)


_hostile_text = st.lists(
    st.one_of(
        st.text(max_size=40),
        st.sampled_from(
            [
                "\x1b[31m",
                "\u202e",
                "\u200d",
                "\t",
                "\n",
                "\r",
                "数据库",
                "👨‍👩‍👧",
                "e\u0301",
                "x" * 200,
            ]
        ),
    ),
    max_size=12,
).map("".join)


_NAMESPACES = st.sampled_from(["alice", "bob", "n" * 128])  # the longest a server may send


@st.composite
def browser_states(draw: st.DrawFn) -> tactmem._Browser:
    """A browser of local memory, or of team memory (`team`): records of several namespaces
    whose ids collide, shown read-only; after any keys, a team browser has deleted nothing."""
    contents = draw(st.lists(_hostile_text.filter(str.strip), max_size=6))
    team = draw(st.sampled_from(["", "alice"]))

    def key(doc_id: int) -> Key:  # team ids collide across namespaces
        return tactmem.RemoteKey(1 + doc_id % 2, 1, draw(_NAMESPACES)) if team else Key(doc_id, 1)

    records = tuple(
        Record(key(doc_id), content, 0, 0, None, 0, None, draw(st.integers(0, 3)), None)
        for doc_id, content in enumerate(contents, start=1)
    )
    records = tuple({tactmem._where(record): record for record in records}.values())
    state = tactmem._Browser(enabled=draw(st.sampled_from([None, True, False])), team=team)
    state, _ = tactmem._browse_step(state, ("loaded", records, draw(st.integers(0, 10**13))))
    keys: st.SearchStrategy[tactmem._Event] = st.one_of(
        st.sampled_from(
            ["up", "down", "pgup", "pgdn", "enter", "tab", "esc", "backspace", "delete"]
        ).map(lambda name: ("key", name)),
        st.characters(codec="utf-8").map(lambda char: ("char", char)),
        _hostile_text.map(lambda text: ("paste", text)),
    )
    for key_event in draw(st.lists(keys, max_size=8)):
        state, effects = tactmem._browse_step(state, key_event)
        assert not (team and any(effect[0] == "delete" for effect in effects))
        current = state.current()
        assert current is None or tactmem._where(current) == state.selected
    return state


@settings(max_examples=300)
@given(state=browser_states(), width=st.integers(0, 120), height=st.integers(0, 40))
def test_browser_screen_never_leaves_the_window(
    state: tactmem._Browser, width: int, height: int
) -> None:
    """Whatever the content, state and window size, every line fits and no line is extra;
    no control character reaches the terminal."""
    lines = tactmem._browse_screen(state, width, height)
    assert len(lines) <= height
    for _, text in lines:
        assert _cells(text) <= width
        assert not any(unicodedata.category(char) in ("Cc", "Cf", "Cs") for char in text), repr(
            text
        )


# ============================================================ team memory: push plans (pure)


# `_plan_push` (docs/team.md, "The push rule") over random local stores, team namespaces and links,
# some of them stale, some of another namespace: whatever the links say, a push never gives a
# key other content, never moves a version back, never reuses an id, and without `--force`
# never changes a team record that no link of this store saw as it is.

_TEXTS = [f"conclusion {word}" for word in ("alpha", "beta", "gamma", "delta", "CONCLUSION alpha")]

_PLACES = st.integers(1, 6)

_VERSIONS = st.integers(1, 3)


def _records(team: bool) -> st.SearchStrategy[list[Record]]:
    def record(doc_id: int, version: int, text: str, reads: int) -> Record:
        key = tactmem.RemoteKey(doc_id, version, "alice") if team else Key(doc_id, version)
        probation = None if reads else 1_000
        return Record(key, text, 5, 5, None, reads, None, reads, probation)

    one = st.builds(record, _PLACES, _VERSIONS, st.sampled_from(_TEXTS), st.integers(0, 2))
    return st.lists(
        one, max_size=6, unique_by=(lambda r: r.key.id, lambda r: normalized_identity(r.content))
    )


_links = st.lists(
    st.builds(
        tactmem._Link, _PLACES, _VERSIONS, st.sampled_from(_TEXTS).map(tactmem._digest),
        st.sampled_from([5, 5, 6]), st.sampled_from([None, 1_000, 3_000]),
        st.sampled_from(["alice", "alice", "bob"]), _PLACES, _VERSIONS,
        st.sampled_from(_TEXTS).map(tactmem._digest),
    ),
    max_size=6,
)  # fmt: skip

_NOW = st.sampled_from([500, 2_000])  # before or after the probation of records and links


def _link(local: tuple[int, int, str], team: tuple[int, int, str]) -> Any:
    """A link of local record (id, version, text) created at 5, unread, to an alice record."""
    mine, digest = tactmem._digest(local[2]), tactmem._digest(team[2])
    return tactmem._Link(local[0], local[1], mine, 5, 1_000, "alice", team[0], team[1], digest)


@given(
    _records(False), _records(True), _links, _links, st.none() | st.integers(7, 9), st.booleans(),
    _NOW,
)  # fmt: skip
@pytest.mark.slow
def test_a_push_never_rewrites_a_key_nor_touches_what_it_has_not_seen(
    local: list[Record], remote: list[Record], links: list[Any], pending: list[Any],
    next_id: int | None, force: bool, now_ms: int,
) -> None:  # fmt: skip
    plan = tactmem._plan_push(
        local, remote, links, pending, "alice", next_id=next_id, force=force, now_ms=now_ms
    )
    event(f"conflicts: {bool(plan.conflicts)}")
    if plan.conflicts:
        return  # refused: nothing is sent
    there = {r.key.id: r for r in remote}
    sent = {r.key.id: r for r in plan.snapshot}
    assert len(sent) == len(plan.snapshot)
    for team_id, record in sent.items():
        old = there.get(team_id)
        if old is None:
            assert next_id is None or team_id >= next_id  # an id the namespace never used
        else:
            assert record.key.version >= old.key.version
            if record.key.version == old.key.version:
                assert record.content == old.content
    seen = {
        (link.remote_id, link.remote_version, link.remote_digest)
        for link in [*links, *pending]
        if link.namespace == "alice"
    }
    for team_id, old in there.items():
        if force or (team_id, old.key.version, tactmem._digest(old.content)) in seen:
            continue
        assert team_id in sent and sent[team_id].key.version == old.key.version
        assert sent[team_id].content == old.content
    if force and not links and not pending:
        wanted = {normalized_identity(r.content) for r in local}
        assert wanted == {normalized_identity(r.content) for r in plan.snapshot}


def _seen(doc_id: int, version: int, text: str, *, team: bool = False) -> Record:
    key = tactmem.RemoteKey(doc_id, version, "alice") if team else Key(doc_id, version)
    return Record(key, text, 5, 5, None, 0, None, 0, 1_000)


@given(
    _records(False), _records(True), _links, _links, st.none() | st.integers(7, 9), st.booleans(),
    _NOW,
)  # fmt: skip
@example(  # a pending insert of alice#1 may have landed: no server allocator to say it did not
    [_seen(1, 1, _TEXTS[0])], [], [], [_link((1, 1, _TEXTS[0]), (1, 1, _TEXTS[1]))], None, False,
    500,
)  # fmt: skip
@example(  # this store saw alice#3 v3; the team's went back to v1; --force wrote v2
    [_seen(1, 2, _TEXTS[1])], [_seen(3, 1, _TEXTS[2], team=True)],
    [_link((1, 1, _TEXTS[0]), (3, 3, _TEXTS[0]))], [], None, True, 500,
)  # fmt: skip
def test_a_push_writes_each_team_id_above_every_version_this_store_saw(
    local: list[Record], remote: list[Record], links: list[Any], pending: list[Any],
    next_id: int | None, force: bool, now_ms: int,
) -> None:  # fmt: skip
    """A link says this store saw a team record at that version, so every version up to it has
    named some content. A record the push writes (new, or other than the team holds now) goes
    above all of them unless it is what this store saw at that very key, even where the team's
    version went back since (the original's client may sync any versions), with `--force`
    too."""
    plan = tactmem._plan_push(
        local, remote, links, pending, "alice", next_id=next_id, force=force, now_ms=now_ms
    )
    if plan.conflicts:
        return
    there = {r.key.id: r for r in remote}
    highest: dict[int, int] = {}
    named: set[tuple[int, int, str]] = set()
    for link in [*links, *pending]:
        if link.namespace == "alice":
            highest[link.remote_id] = max(highest.get(link.remote_id, 0), link.remote_version)
            named.add((link.remote_id, link.remote_version, link.remote_digest))
    for record in plan.snapshot:
        old = there.get(record.key.id)
        if old is not None and old.key == record.key and old.content == record.content:
            continue  # as the team holds it
        if (record.key.id, record.key.version, tactmem._digest(record.content)) in named:
            continue  # what this store saw at that very key
        assert record.key.version > highest.get(record.key.id, 0), record.key


# ============================================================ command line (I/O)


# Hostile sequences of tool calls to `MemoryTool.call`, and any argument list to `main`, each on a
# real store. Their subject is parsing and validation, not durability, so the stores live on
# tmpfs where there is one (`fast_tmp`): a disk's fsync only slows them down.

OUTPUT_SCHEMA = jsonschema.Draft202012Validator(tactmem.tool_definition()["output_schema"])


def fast_tmp() -> tempfile.TemporaryDirectory[str]:
    """A temporary directory on tmpfs (`/dev/shm`) when that is a writable directory, else in
    the default place, so these tests still run anywhere."""
    shm = "/dev/shm"
    on_tmpfs = os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK)
    return tempfile.TemporaryDirectory(dir=shm if on_tmpfs else None)


def raw(path: Path) -> sqlite3.Connection:
    """A plain SQLite connection beside the store, for looking under the hood."""
    return sqlite3.connect(path, isolation_level=None)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
    | st.text(st.characters(codec=None), max_size=40),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)  # fmt: skip

NASTY_TEXT = st.lists(
    st.text(max_size=30)
    | st.sampled_from(["\ud800", "\udfff", "\x00", "\u202e", "数据库", "password = w", " " * 40]),
    max_size=8,
).map("".join)

IDS = st.integers(1, 6) | st.integers(-(2**70), 2**70) | st.sampled_from([0, 2**63 - 1, 2**63])

KEYS = st.fixed_dictionaries({"id": IDS, "version": st.integers(1, 3) | IDS})

PLAIN_TEXT = st.text(st.characters(codec="utf-8"), min_size=1, max_size=60)

WELL_FORMED = st.one_of(  # exactly the fields each operation takes, with fuzzed values
    st.fixed_dictionaries(
        {"operation": st.just("scan"), "query": PLAIN_TEXT | NASTY_TEXT},
        optional={"limit": st.integers(1, 5) | IDS},
    ),
    st.fixed_dictionaries({"operation": st.just("read"), "ids": st.lists(IDS, max_size=8)}),
    st.fixed_dictionaries(
        {
            "operation": st.just("put"),
            "content": PLAIN_TEXT | PLAIN_TEXT | NASTY_TEXT | st.text(min_size=1000, max_size=1100),
        },
        optional={"replace": KEYS},
    ),
    st.builds(lambda key: {"operation": "delete", **key}, KEYS),
)

TOOL_REQUESTS = st.one_of(
    WELL_FORMED,
    WELL_FORMED,
    WELL_FORMED.map(json.dumps),  # as JSON text, surrogates escaped
    JSON_VALUES,
    st.fixed_dictionaries(
        {"operation": st.sampled_from(["scan", "read", "put", "delete", "Scan", ""])},
        optional={
            "query": JSON_VALUES, "limit": JSON_VALUES, "ids": JSON_VALUES,
            "content": NASTY_TEXT | JSON_VALUES, "replace": JSON_VALUES, "id": JSON_VALUES,
            "version": JSON_VALUES, "is_root": st.booleans(),
        },
    ),
    st.text(st.characters(codec=None), max_size=200),
    st.integers(1, 5000).map(lambda depth: "[" * depth * 20),
    st.integers(1, 5000).map(lambda depth: '{"operation": "scan", "query": ' * depth),
    st.integers(2**63, 2**200).map(lambda big: f'{{"operation": "read", "ids": [{big}]}}'),
)  # fmt: skip


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(requests=st.lists(TOOL_REQUESTS, min_size=1, max_size=8), root=st.booleans())
@pytest.mark.slow
def test_hostile_tool_calls_never_raise(requests: list[Any], root: bool) -> None:
    """Nothing raises, every answer is valid output, and the store's invariants hold after.
    Most requests are well formed, so put, read, replace, delete and the bounds are reached."""
    with fast_tmp() as directory:
        path = Path(directory) / "memory.sqlite3"
        limits = Limits(records=4, total_content_bytes=1200)
        with Store(path, limits=limits) as store:
            tool = MemoryTool(store, root=root)
            tool.call({"operation": "put", "content": "seed one"}, now_ms=0)  # needs a scan
            for request in requests:
                tool.call({"operation": "scan", "query": "seed"}, now_ms=1)  # open the put gate
                if root:
                    tool.call({"operation": "put", "content": f"seed {len(requests)}"}, now_ms=1)
                    tool.call({"operation": "scan", "query": "seed"}, now_ms=1)
                answer = tool.call(request, now_ms=1)
                assert isinstance(answer, dict)
                OUTPUT_SCHEMA.validate(answer)
                json.dumps(answer)  # a well-formed JSON answer
                event("answer: " + answer.get("error", {}).get("code", answer.get("operation", "")))
        with raw(path) as connection:
            assert connection.execute("PRAGMA integrity_check").fetchone() == ("ok",)
            rows, size = connection.execute(
                "SELECT COUNT(*), COALESCE(SUM(length(CAST(content AS BLOB))), 0) FROM memories"
            ).fetchone()
        assert rows <= 4 and size <= 1200


TEAM_KEYS = st.fixed_dictionaries(
    {"id": IDS, "version": IDS},
    optional={
        "namespace": _NAMESPACES | st.just("zorblax secret") | NASTY_TEXT | JSON_VALUES,
        "extra": JSON_VALUES,
    },
)

CARD_KEYS = st.fixed_dictionaries(
    {"id": st.integers(1, 6), "version": st.integers(1, 3), "namespace": _NAMESPACES}
)

TEAM_REQUESTS = st.one_of(
    TOOL_REQUESTS,
    st.fixed_dictionaries({"operation": st.just("read"), "keys": st.lists(CARD_KEYS, max_size=4)}),
    st.fixed_dictionaries(
        {"operation": st.just("read"), "keys": st.lists(TEAM_KEYS, max_size=4) | JSON_VALUES}
    ),
    st.fixed_dictionaries(
        {"operation": st.just("put"), "content": PLAIN_TEXT, "replace": TEAM_KEYS}
    ),
    st.builds(lambda key: {"operation": "delete", **key}, TEAM_KEYS),
)


@settings(max_examples=400, deadline=None)
@given(request=TEAM_REQUESTS)
def test_team_tool_requests_are_checked_or_refused_never_raise(request: Any) -> None:
    """Team memory's shapes (`read {keys}`, keys that may name a namespace) parse to keys
    of that namespace or are refused as `invalid_request`, naming no value they were given."""
    try:
        parsed = tactmem._parse_request(request, Limits(), team=True)
    except tactmem.InvalidRequest as error:
        assert "zorblax" not in str(error) and len(str(error)) < 200
        event("refused")
        return
    if parsed.operation == "read":
        assert not parsed.ids and all(
            tactmem._REMOTE_NAMESPACE.fullmatch(k.namespace) for k in parsed.keys
        )
    event(f"parsed {parsed.operation}")


@pytest.mark.slow
def test_hostile_tool_strategy_reaches_every_operation() -> None:
    """The strategy above is not vacuous: its well-formed share succeeds at every operation."""
    seen: Counter[str] = Counter()

    @settings(max_examples=300, deadline=None, database=None, derandomize=True)
    @given(request=WELL_FORMED)
    def collect(request: dict[str, Any]) -> None:
        with (
            fast_tmp() as directory,
            Store(
                Path(directory) / "m.sqlite3", limits=Limits(records=4, total_content_bytes=1200)
            ) as store,
        ):
            tool = MemoryTool(store, root=True)
            tool.call({"operation": "scan", "query": "x"}, now_ms=0)
            tool.call({"operation": "put", "content": "existing record"}, now_ms=0)
            tool.call({"operation": "scan", "query": "x"}, now_ms=0)
            answer = tool.call(request, now_ms=1)
            seen[answer.get("error", {}).get("code", answer.get("operation", ""))] += 1

    collect()
    assert {"scan", "read", "put", "delete", "invalid_request"} <= set(seen), seen


ARGV_WORDS = st.sampled_from(
    [
        "scan", "read", "put", "delete", "list", "stats", "tool", "demo", "--json", "--limit",
        "--replace", "--sort", "--child", "--help", "--version", "--db", "--config", "-", "1",
        "0", "1@1", "2@9", "-1", "99999999999999999999", "newest", "x", "", " ", "\udcff",
        "password = hunter22", "@", "1@", "--", "-h", "export", "import", "restore", "--dry-run",
    ]
)  # fmt: skip

COMMANDS = st.one_of(
    st.tuples(NASTY_TEXT, st.sampled_from([[], ["--limit", "2"], ["--limit", "9"]]))
    .map(lambda parts: ["scan", parts[0], *parts[1]]),
    st.lists(st.sampled_from(["1", "2", "3", "0", "x", "99999999999999999999"]), min_size=1)
    .map(lambda ids: ["read", *ids]),
    st.tuples(NASTY_TEXT, st.sampled_from([[], ["--replace", "1@1"], ["--replace", "2@5"]]))
    .map(lambda parts: ["put", parts[0], *parts[1]]),
    st.sampled_from([["delete", "1@1"], ["delete", "2@1"], ["delete", "1@"], ["list"],
                     ["list", "--sort", "least"], ["stats"], ["tool"], ["tool", "--child"],
                     ["export"], ["export", "out.jsonl"], ["import", "-"], ["restore", "-"],
                     ["import", "--dry-run", "out.jsonl"], ["restore", "out.jsonl"]]),
)  # fmt: skip


def parsed(parser: argparse.ArgumentParser, argv: list[str]) -> object:
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            return vars(parser.parse_args(argv))
    except (SystemExit, tactmem._UsageError) as stop:
        return type(stop).__name__, str(stop), out.getvalue()


@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    argv=st.lists(ARGV_WORDS | st.sampled_from(["--d", "--db=x", "--js", "eval"]), max_size=6)
    | COMMANDS.map(lambda command: ["--db", "db", *command])
)
@example(["--db", "scan", "list"])
@example(["--json", "--config", "put", "--db=x", "scan", "--limit", "2", "q"])
@example(["--d", "scan", "list"])
@pytest.mark.slow
def test_the_parser_of_the_named_command_alone_parses_as_the_whole_one(argv: list[str]) -> None:
    """A one-shot command builds only its own subparser (issue 16): every argument list
    parses, or fails, exactly as with all of them."""
    assert parsed(tactmem._build_parser(argv), argv) == parsed(tactmem._build_parser(), argv)
    event("one subparser" if tactmem._named_command(argv) else "all subparsers")


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    argv=st.lists(ARGV_WORDS | st.text(max_size=10), max_size=7)
    | st.tuples(st.sampled_from([[], ["--json"]]), COMMANDS).map(
        lambda p: ["--db", "db", *p[0], *p[1]]
    )
)
@pytest.mark.slow
def test_main_never_raises_for_any_argv(argv: list[str]) -> None:
    """Any argument list: an exit status, never an exception; the store stays within bounds."""
    with fast_tmp() as directory:
        # Whatever follows --db or --config names a file in this directory.
        argv = [
            os.path.join(directory, "named.file") if before in ("--db", "--config") else word
            for before, word in zip(["", *argv], argv, strict=False)
        ]
        environment = {"HOME": directory, "TACT_HOME": directory, "TACT_CONFIG": ""}
        saved = {name: os.environ.get(name) for name in environment}
        saved_stdin, saved_stdout, saved_stderr = sys.stdin, sys.stdout, sys.stderr
        os.environ.update(environment)
        sys.stdin = io.TextIOWrapper(io.BytesIO(b'{"operation": "scan", "query": "q"}\n'))
        sys.stdout = sys.stderr = io.StringIO()
        cwd = os.getcwd()
        os.chdir(directory)
        try:
            for _ in range(2):  # the second run meets what the first one stored
                status = tactmem.main(argv)
                assert status in (0, 1, 2, 3)  # issue 14: 3 is "nothing found"
        finally:
            os.chdir(cwd)
            sys.stdin, sys.stdout, sys.stderr = saved_stdin, saved_stdout, saved_stderr
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        event(f"exit {status}")
        store_file = Path(directory) / "named.file"
        if store_file.is_file() and store_file.stat().st_size:
            with raw(store_file) as connection:
                assert connection.execute("PRAGMA integrity_check").fetchone() == ("ok",)
                (rows,) = connection.execute("SELECT COUNT(*) FROM memories").fetchone()
            assert rows <= 512
