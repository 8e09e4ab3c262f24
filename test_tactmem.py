"""Example tests for tactmem, in the module's order: core, store, command line, packaging.

Numbers in test names ("ref12_3") point at the reference's test list (spec §12).
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import sqlite3
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import tactmem
from tactmem import (
    Conflict,
    ContentCapacity,
    ContentTooLarge,
    DatabaseCapacity,
    Duplicate,
    EmptyContent,
    Key,
    Limits,
    NotFound,
    QueryTooLarge,
    RecordCapacity,
    SecretRejected,
    StorageError,
    Store,
    StoreBusy,
    TactmemError,
    UnsupportedSchema,
    find_secret,
    normalized_identity,
    preview,
    rank,
    tokenize,
)

HERE = Path(__file__).parent
TINY = Limits(
    content_bytes=32,
    records=4,
    total_content_bytes=64,
    scan_results=2,
    query_bytes=16,
    probation_ms=10,
)


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "memory" / "v1.sqlite3"


@pytest.fixture
def tiny(db: Path) -> Iterator[Store]:
    with Store(db, limits=TINY) as store:
        yield store


def raw(path: Path) -> sqlite3.Connection:
    """A plain SQLite connection beside the store, for looking under the hood."""
    return sqlite3.connect(path, isolation_level=None)


# ============================================================================ tokenizer

TOKEN_EXAMPLES = {
    "src/core/httpServer.rs parse_request": (
        "src core httpserver http server rs parse_request parse request"
    ),
    "HTTPServer parseHTTP2Request v2Api": (
        "httpserver parsehttp2request parse http2 request v2api v2 api"
    ),
    "__init__ _ a_b_ XMLHttpRequest": "__init__ init _ a_b_ a b xmlhttprequest xmlhttp request",
    "Don't read-only naïve café ÉCOLE": "don t read only naïve café école",
    "getHTTPResponseCode iOS12App": "gethttpresponsecode get httpresponse code ios12app i os12 app",
    "camelCase camelCase": "camelcase camel case camelcase camel case",
    "foo.bar@baz 3.14 x86_64": "foo bar baz 3 14 x86_64 x86 64",
    "a1B2c3": "a1b2c3 a1 b2c3",
    "ÀbcDéf": "àbcdéf àbc déf",
    "١٢٣ ²³ Ⅻ": "١٢٣ ²³ ⅻ",
    "emoji 🚀 rocket": "emoji rocket",
    "": "",
    "   ": "",
    "---": "",
    # Unicode lowercasing is full, as Rust's `to_lowercase`: final sigma, dotted capital I.
    "ΟΔΟΣ İstanbul": "οδος i̇stanbul",
    # Circled letters are alphabetic in Rust though Python's `isalnum` says no.
    "Ⓐⓑ": "ⓐⓑ",
}


@pytest.mark.parametrize(("text", "expected"), TOKEN_EXAMPLES.items())
def test_tokenize_reference_examples(text: str, expected: str) -> None:
    assert tokenize(text) == expected.split()


def test_ref19_tokenize_path_and_identifier() -> None:
    assert tokenize("src/core/httpServer.rs parse_request") == [
        "src", "core", "httpserver", "http", "server", "rs", "parse_request", "parse", "request",
    ]  # fmt: skip


def test_combining_marks_continue_a_word() -> None:
    # Devanagari virama (Mn, not Alphabetic) splits the word in the reference; tactmem keeps it.
    assert tokenize("नमस्ते दुनिया") == ["नमस्ते", "दुनिया"]
    # A decomposed accent stays with its letter.
    assert tokenize("cafe\u0301 menu") == ["cafe\u0301", "menu"]
    # A mark never starts a word.
    assert tokenize("a \u0301b") == ["a", "b"]


def test_cjk_runs_emit_bigrams_and_non_cjk_pieces() -> None:
    assert tokenize("数据库") == ["数据库", "数据", "据库"]
    assert tokenize("数据库连接") == ["数据库连接", "数据", "据库", "库连", "连接"]
    assert tokenize("SQLite数据库") == ["sqlite数据库", "数据", "据库", "sqlite"]
    assert tokenize("数") == ["数"]
    assert tokenize("東京タワー") == ["東京タワー", "東京", "京タ", "タワ", "ワー"]
    assert tokenize("한국어 설정") == ["한국어", "한국", "국어", "설정"]
    assert tokenize("httpServer数据") == [
        "httpserver数据", "http", "server数据", "数据", "httpserver", "server",
    ]  # fmt: skip


def test_cjk_queries_match_inside_longer_runs() -> None:
    assert [doc for doc, _ in rank("数据库", [(1, "使用数据库连接池"), (2, "网络设置")])] == [1]
    assert [doc for doc, _ in rank("SQLite", [(1, "SQLite数据库"), (2, "Postgres")])] == [1]


def test_query_terms_are_a_sorted_set() -> None:
    assert tactmem._query_terms("b a B a") == ["a", "b"]


# ============================================================================ ranking


def test_ref20_bm25_scores_are_bit_exact() -> None:
    docs = [(1, "rust sqlite"), (2, "rust rust sqlite"), (3, "rust sqlite unrelated padding words")]
    assert rank("rust sqlite", docs) == [
        (2, 0.3281460565159097),
        (1, 0.31931419975429315),
        (3, 0.22171250096147146),
    ]


def test_ref21_rare_terms_win_and_ties_break_by_id() -> None:
    assert rank("common rare", [(1, "common"), (2, "common rare"), (3, "common")]) == [
        (2, 0.9251295926036784),
        (1, 0.14874382975896186),
        (3, 0.14874382975896186),
    ]


def test_bm25_single_document() -> None:
    assert rank("alpha", [(1, "alpha beta")]) == [(1, 0.28768207245178085)]


def test_bm25_camel_case_query() -> None:
    docs = [(1, "the http layer"), (2, "httpServer config"), (3, "server only")]
    assert rank("httpServer", docs) == [
        (2, 1.690336130122814),
        (3, 0.5442147286003255),
        (1, 0.47000362924573563),
    ]


def test_bm25_repeated_query_terms_change_nothing() -> None:
    docs = [(1, "Use SQLite for storage."), (2, "Prefer tabs.")]
    assert rank("sqlite sqlite SQLite", docs) == rank("sqlite", docs) == [(1, 0.6099695188927519)]


def test_ref22_verbose_query_finds_coherent_subsets() -> None:
    docs = [
        (1, "The user prefers invariant-first code review and implementation."),
        (2, "The user expects task scope to be followed. Read-only requests authorize no edits."),
        (3, "An unrelated repository fact."),
    ]
    query = "user preferences code review actionable defects read only repository"
    assert {doc for doc, _ in rank(query, docs, limit=2)} == {1, 2}


def test_ref23_partial_topic_match_survives_unrelated_terms() -> None:
    docs = [
        (
            1,
            "For Commonware storage reviews, checkpoints are trusted and paired with their"
            " database.",
        ),
        (2, "For Commonware networking reviews, peers are untrusted."),
        (3, "Durability requires an explicit synchronization boundary."),
    ]
    query = "Commonware runtime storage buffer durability review"
    assert 1 in [doc for doc, _ in rank(query, docs)]


def test_ref24_no_overlap_abstains_and_ties_sort_by_id() -> None:
    assert rank("different", [(1, "same"), (2, "same")]) == []
    assert [doc for doc, _ in rank("same", [(2, "same"), (1, "same")])] == [1, 2]


def test_rank_edges() -> None:
    assert rank("anything", []) == []
    assert rank("---", [(1, "text")]) == []
    assert rank("text", [(1, "text")], limit=0) == []


# ============================================================================ preview


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("short text", "short text"),
        ("a" * 64, "a" * 64),
        ("a" * 65, "a" * 64),
        ("a" * 63 + "é-tail", "a" * 63),
        ("x" * 62 + "日本", "x" * 62),
        ("  leading\nnewline", "  leading\nnewline"),
    ],
)
def test_ref25_preview(content: str, expected: str) -> None:
    assert preview(content) == expected


# ============================================================================ secrets


def load_cases(name: str) -> list[tuple[str, str]]:
    """`(tag, case)` pairs: one case per line, after a `# [tag] ...` group header.

    `#` comments and blank lines are skipped; `\\n` and `\\t` stand for newline and tab.
    """
    lines = (HERE / "fixtures" / "secrets" / name).read_text(encoding="utf-8").splitlines()
    cases, tag = [], ""
    for line in lines:
        if header := re.match(r"# \[([a-z_]+)\] ", line):
            tag = header.group(1)
        elif line.strip() and not line.startswith("#"):
            cases.append((tag, line.replace("\\n", "\n").replace("\\t", "\t")))
    assert len(cases) >= 50, f"{name} should hold the maintained fixture set"
    return cases


REJECTED = load_cases("rejected.txt")
ALLOWED = [case for _, case in load_cases("allowed.txt")]
RULE_OF_TAG = {
    "pem": "private_key",
    "authorization": "authorization_header",
    "bearer": "bearer_token",
    "url": "credential_url",
    "prefix": "provider_token",
    "jwt": "jwt",
    "assign": "credential_assignment",
    "anthropic": "provider_token",
    "google": "google_api_key",
    "gitlab": "gitlab_token",
    "npm": "npm_token",
    "pypi": "pypi_token",
    "huggingface": "huggingface_token",
    "slack_app": "slack_app_token",
    "slack_webhook": "slack_webhook",
    "stripe": "stripe_key",
    "aws_secret": "aws_secret_key",
    "azure": "azure_account_key",
    "sendgrid": "sendgrid_key",
}


@pytest.mark.parametrize(("tag", "content"), REJECTED)
def test_ref26_rejected_fixture_trips_its_rule(tag: str, content: str) -> None:
    rules = dict(tactmem._SECRET_RULES)
    assert rules[RULE_OF_TAG[tag]](content)
    assert find_secret(content) is not None


@pytest.mark.parametrize("content", ALLOWED)
def test_ref27_allowed_fixture(content: str) -> None:
    assert find_secret(content) is None


def test_every_secret_rule_has_fixtures() -> None:
    assert {RULE_OF_TAG[tag] for tag, _ in REJECTED} == {name for name, _ in tactmem._SECRET_RULES}


def test_secret_rules_are_named() -> None:
    assert find_secret("-----BEGIN RSA PRIVATE KEY-----") == "private_key"
    assert find_secret("  Authorization: Basic abc") == "authorization_header"
    assert find_secret("use Bearer abcdefghijk1234") == "bearer_token"
    assert find_secret("https://user:pw@example.com/path") == "credential_url"
    assert find_secret("sk-1234567890123456") == "provider_token"
    assert find_secret("password = w") == "credential_assignment"
    assert find_secret("key AIza" + "A1" * 17 + "B") == "google_api_key"
    assert find_secret("the xapp-frontend-service repository") is None
    assert find_secret("xapp-1-A0B1C2D3E4F5") == "slack_app_token"


def test_ref12_secret_is_refused_without_echo(tiny: Store) -> None:
    with pytest.raises(SecretRejected) as caught:
        tiny.put("password=w", now_ms=1)
    assert "w" not in str(caught.value).replace("was rejected", "")
    assert "password" not in str(caught.value)
    assert caught.value.code == "secret_rejected"
    assert tiny.list(now_ms=1) == ()


def test_secret_error_never_contains_content_for_any_fixture(db: Path) -> None:
    store = Store(db)
    for _, content in REJECTED:
        with pytest.raises(SecretRejected) as caught:
            store.put(content, now_ms=1)
        for word in content.split():
            if len(word) >= 4:
                assert word not in str(caught.value) and word not in repr(caught.value)
    assert store.list(now_ms=1) == ()


# ============================================================================ identity


def test_normalized_identity() -> None:
    assert normalized_identity("Remember  SQLite") == "remember sqlite"
    assert normalized_identity("  remember sqlite \n") == "remember sqlite"
    # U+001F is whitespace to Python's str.split but not to Unicode White_Space.
    assert normalized_identity("a\x1fb") == "a\x1fb"
    assert normalized_identity("a\u3000B") == "a b"


# ============================================================================ store: ref §12 1–18


def test_ref1_byte_bounds(db: Path) -> None:
    store = Store(db, limits=Limits(content_bytes=8, total_content_bytes=32, query_bytes=8))
    store.put("12345678", now_ms=1)
    with pytest.raises(ContentTooLarge) as caught:
        store.put("123456789", now_ms=1)
    assert str(caught.value) == "memory content exceeds the 8-byte limit"
    store.put("éééé", now_ms=1)
    with pytest.raises(ContentTooLarge):
        store.put("ééééé", now_ms=1)
    store.scan("12345678", now_ms=1)
    store.scan("éééé", now_ms=1)
    for query in ("123456789", "ééééé"):
        with pytest.raises(QueryTooLarge) as too_large:
            store.scan(query, now_ms=1)
        assert str(too_large.value) == "memory query exceeds the 8-byte limit"
    assert [r.content for r in store.list(now_ms=1)] == ["12345678", "éééé"]
    store.close()


def test_ref2_dedupe_by_normalized_identity(tiny: Store) -> None:
    tiny.put("Remember  SQLite", now_ms=1)
    with pytest.raises(Duplicate) as caught:
        tiny.put("  remember sqlite \n", now_ms=2)
    assert str(caught.value) == "an equivalent memory already exists"


def test_ref3_replace(db: Path) -> None:
    store = Store(db, limits=Limits(content_bytes=10, total_content_bytes=10, probation_ms=10))
    first = store.put("123456", now_ms=1)
    store.scan("123456", now_ms=2)
    store.read([first.key.id], now_ms=3)
    replaced = store.put("1234", replace=first.key, now_ms=4)
    assert replaced.key == Key(first.key.id, 2)
    assert (replaced.created_at_ms, replaced.updated_at_ms) == (1, 4)
    assert (replaced.scan_count, replaced.use_count) == (0, 0)
    assert (replaced.last_scanned_at_ms, replaced.last_used_at_ms) == (None, None)
    assert replaced.probation_until_ms == 14
    assert store.list(now_ms=5) == (replaced,)
    store.put("abcdef", now_ms=5)
    with pytest.raises(Conflict):
        store.put("9", replace=first.key, now_ms=6)
    with pytest.raises(ContentCapacity) as caught:
        store.put("toolarge", now_ms=6)
    assert str(caught.value) == "memory content capacity of 10 bytes was reached"


def test_ref4_row_cap(db: Path) -> None:
    store = Store(db, limits=Limits(records=2))
    one = store.put("one", now_ms=1)
    store.put("two", now_ms=1)
    with pytest.raises(RecordCapacity) as caught:
        store.put("three", now_ms=1)
    assert str(caught.value) == "memory record capacity of 2 was reached"
    store.delete(one.key)
    store.put("three", now_ms=1)
    assert len(store.list(now_ms=1)) == 2


def test_ref5_delete_checks_the_version(tiny: Store) -> None:
    record = tiny.put("delete me", now_ms=1)
    with pytest.raises(Conflict):
        tiny.delete(Key(record.key.id, record.key.version + 1))
    tiny.delete(record.key)
    assert tiny.list(now_ms=1) == ()
    with pytest.raises(NotFound) as caught:
        tiny.delete(record.key)
    assert str(caught.value) == "memory was not found"
    with pytest.raises(NotFound):
        tiny.delete(Key(0, 1))
    with pytest.raises(NotFound):
        tiny.delete(Key(2**70, 1))


def test_ref6_probation_deadline_is_inclusive(tiny: Store) -> None:
    tiny.put("short lived", now_ms=100)
    assert len(tiny.list(now_ms=109)) == 1
    assert tiny.list(now_ms=110) == ()


def test_ref7_read_graduates(tiny: Store) -> None:
    record = tiny.put("keep me", now_ms=100)
    (read,) = tiny.read([record.key.id], now_ms=109)
    assert (read.probation_until_ms, read.use_count, read.last_used_at_ms) == (None, 1, 109)
    assert tiny.list(now_ms=10_000) == (read,)


def test_ref8_scan_touches_only_returned_rows(db: Path) -> None:
    store = Store(db)
    for text in ("rust sqlite concise", "rust sqlite verbose padding words", "python network"):
        store.put(text, now_ms=0)
    result = store.scan("rust sqlite", limit=1, now_ms=1)
    assert not result.abstained and len(result.candidates) == 1
    (hit,) = result.candidates
    assert hit.key.id == 1 and hit.preview == "rust sqlite concise"
    for record in store.list(now_ms=1):
        touched = record.key.id == hit.key.id
        assert record.scan_count == int(touched)
        assert record.last_scanned_at_ms == (1 if touched else None)
    none = store.scan("no-overlap", now_ms=2)
    assert none.abstained and none.candidates == ()
    assert sum(record.scan_count for record in store.list(now_ms=2)) == 1


def test_ref9_scan_limit_is_clamped(db: Path) -> None:
    store = Store(db)
    for i in range(6):
        store.put(f"shared term {i}", now_ms=0)
    assert len(store.scan("shared", limit=sys.maxsize, now_ms=1).candidates) == 5
    assert store.scan("shared", limit=0, now_ms=1).abstained


def test_ref10_read_dedupes_in_input_order(tiny: Store) -> None:
    a = tiny.put("first", now_ms=1)
    b = tiny.put("second", now_ms=1)
    records = tiny.read([b.key.id, b.key.id, 999, a.key.id, -3, 2**80], now_ms=5)
    assert [r.key.id for r in records] == [b.key.id, a.key.id]
    assert all(r.use_count == 1 and r.last_used_at_ms == 5 for r in records)
    assert {r.key.id: r for r in tiny.list(now_ms=5)} == {r.key.id: r for r in records}
    assert tiny.read([], now_ms=5) == ()


def test_ref11_concurrent_puts(db: Path) -> None:
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def put(i: int) -> None:
        try:
            with Store(db) as store:
                barrier.wait()
                store.put(f"conclusion number {i}")
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=put, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(Store(db).list()) == 8


def test_one_store_shared_by_threads(db: Path) -> None:
    store = Store(db)
    barrier = threading.Barrier(8)

    def work(i: int) -> None:
        barrier.wait()
        store.put(f"shared store conclusion {i}")
        store.scan("shared store conclusion")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(r.key.id for r in store.list()) == list(range(1, 9))


def insert_raw(path: Path, content: str, *, version: int = 1) -> int:
    """Write a row the way an older or foreign writer might, bypassing every check."""
    with raw(path) as connection:
        cursor = connection.execute(
            "INSERT INTO memories (content, normalized_identity, created_at_ms, updated_at_ms,"
            " version) VALUES (?, ?, 0, 0, ?)",
            (content, normalized_identity(content), version),
        )
        assert cursor.lastrowid is not None
        return cursor.lastrowid


def test_ref13_legacy_secret_row_is_hidden_but_deletable(tiny: Store, db: Path) -> None:
    tiny.list(now_ms=0)
    doc_id = insert_raw(db, "password=w")
    assert tiny.scan("w", now_ms=1).abstained
    assert tiny.read([doc_id], now_ms=1) == ()
    assert tiny.list(now_ms=1) == ()
    with raw(db) as connection:
        assert connection.execute("SELECT use_count FROM memories").fetchone() == (0,)
    tiny.delete(Key(doc_id, 1))
    with raw(db) as connection:
        assert connection.execute("SELECT COUNT(*) FROM memories").fetchone() == (0,)


def test_ref14_pragmas(tiny: Store, db: Path) -> None:
    tiny.put("pragmas", now_ms=1)
    connection = tiny._connect()

    def pragma(name: str) -> object:
        return connection.execute(f"PRAGMA {name}").fetchone()[0]

    assert pragma("journal_mode") == "delete"
    assert pragma("page_size") == 4096
    assert int(pragma("max_page_count")) * 4096 == 4 * 1024 * 1024  # type: ignore[call-overload]
    assert pragma("secure_delete") == 1
    assert pragma("busy_timeout") == 5000
    assert pragma("integrity_check") == "ok"
    with raw(db) as other:
        assert other.execute("PRAGMA user_version").fetchone() == (1,)


def test_ref15_newer_schema_is_refused_and_left_alone(db: Path) -> None:
    db.parent.mkdir()
    with raw(db) as connection:
        connection.execute("CREATE TABLE memories (id INTEGER PRIMARY KEY)")
        connection.execute("PRAGMA user_version = 2")
    before = db.read_bytes()
    with pytest.raises(UnsupportedSchema) as caught:
        Store(db).list()
    assert (caught.value.found, caught.value.supported) == (2, 1)
    assert str(caught.value) == (
        "memory schema version 2 is unsupported; this build supports version 1"
    )
    assert db.read_bytes() == before


def test_not_a_database_is_refused_and_left_alone(db: Path) -> None:
    db.parent.mkdir()
    db.write_bytes(b"these are my notes, not a database\n" * 200)
    before = db.read_bytes()
    with pytest.raises(StorageError) as caught:
        Store(db).put("anything", now_ms=1)
    assert "not a SQLite database" in str(caught.value)
    assert db.read_bytes() == before


def test_ref16_two_stores_share_a_path(db: Path) -> None:
    first, second = Store(db), Store(db)
    record = first.put("shared between stores", now_ms=1)
    assert second.list(now_ms=1) == (record,)


def test_ref17_replace_legacy_secret_row(tiny: Store, db: Path) -> None:
    tiny.list(now_ms=0)
    doc_id = insert_raw(db, "token=" + "q" * 16)
    replaced = tiny.put("safe replacement", replace=Key(doc_id, 1), now_ms=1)
    assert replaced.key == Key(doc_id, 2)
    assert tiny.list(now_ms=1) == (replaced,)


def test_ref18_private_directory_and_file(db: Path) -> None:
    Store(db).list()
    assert stat.S_IMODE(db.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(db.stat().st_mode) == 0o600


def test_existing_directories_keep_their_mode(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    Store(tmp_path / "memory.sqlite3").list()
    assert stat.S_IMODE(tmp_path.stat().st_mode) == 0o755


# ============================================================================ store: beyond §12


def test_store_is_lazy(db: Path) -> None:
    store = Store(db)
    store.close()
    assert not db.parent.exists()


def test_validation_order_and_messages(tiny: Store) -> None:
    with pytest.raises(EmptyContent) as caught:
        tiny.put(" " * 2000, now_ms=1)  # empty wins over too large
    assert str(caught.value) == "memory content is empty"
    with pytest.raises(ContentTooLarge):
        tiny.put("password=" + "w" * 40, now_ms=1)  # too large wins over secret
    with pytest.raises(tactmem.InvalidRequest):
        tiny.put("lone \ud800 surrogate", now_ms=1)
    with pytest.raises(tactmem.InvalidRequest):
        tiny.scan("\udfff", now_ms=1)


def test_content_is_stored_verbatim(tiny: Store) -> None:
    record = tiny.put("  Mixed Case\n\twith space ", now_ms=1)
    (read,) = tiny.read([record.key.id], now_ms=2)
    assert read.content == "  Mixed Case\n\twith space "


def test_replace_order_not_found_conflict_duplicate_capacity(tiny: Store) -> None:
    a = tiny.put("alpha", now_ms=1)
    tiny.put("beta", now_ms=1)
    tiny.put("c" * 30, now_ms=1)  # 39 of 64 bytes used
    with pytest.raises(NotFound):
        tiny.put("gamma", replace=Key(99, 1), now_ms=1)
    with pytest.raises(Conflict):
        tiny.put("beta", replace=Key(a.key.id, 7), now_ms=1)  # conflict before duplicate
    with pytest.raises(Duplicate):
        tiny.put("BETA", replace=a.key, now_ms=1)
    kept = tiny.put("ALPHA", replace=a.key, now_ms=2)  # its own identity is fine
    assert kept.key == Key(a.key.id, 2)
    with pytest.raises(ContentCapacity):
        tiny.put("x" * 31, replace=kept.key, now_ms=2)  # 39 - 5 + 31 = 65
    tiny.put("x" * 30, replace=kept.key, now_ms=2)  # 39 - 5 + 30 = 64 fits exactly
    with pytest.raises(ContentCapacity):
        tiny.put("y", now_ms=2)


def test_replace_restarts_probation_even_after_graduation(tiny: Store) -> None:
    record = tiny.put("graduate", now_ms=0)
    tiny.read([record.key.id], now_ms=1)
    replaced = tiny.put("graduated then replaced", replace=record.key, now_ms=2)
    assert replaced.probation_until_ms == 12
    assert tiny.list(now_ms=12) == ()


def test_prune_runs_before_capacity_checks(tiny: Store) -> None:
    for i in range(4):
        tiny.put(f"row {i}", now_ms=0)
    keep = tiny.read([1], now_ms=5)[0]
    with pytest.raises(RecordCapacity):
        tiny.put("one more", now_ms=9)
    added = tiny.put("one more", now_ms=10)  # three unread rows expired at 10
    assert [r.key.id for r in tiny.list(now_ms=10)] == [keep.key.id, added.key.id]


def test_failed_put_rolls_back_its_prune(tiny: Store, db: Path) -> None:
    tiny.put("expires", now_ms=0)
    tiny.put("also", now_ms=5)
    with pytest.raises(Duplicate):
        tiny.put("ALSO", now_ms=10)  # prune of "expires" ran, then the put failed
    with raw(db) as connection:
        assert connection.execute("SELECT COUNT(*) FROM memories").fetchone() == (2,)


def test_delete_never_prunes(tiny: Store, db: Path) -> None:
    expired = tiny.put("expired", now_ms=0)
    other = tiny.put("other", now_ms=0)
    tiny.delete(other.key, now_ms=1_000)
    with raw(db) as connection:
        assert connection.execute("SELECT id FROM memories").fetchall() == [(expired.key.id,)]


def test_ids_are_never_reused(tiny: Store, db: Path) -> None:
    first = tiny.put("first", now_ms=1)
    second = tiny.put("second", now_ms=1)
    tiny.delete(second.key)
    tiny.delete(first.key)
    assert tiny.put("third", now_ms=1).key == Key(3, 1)
    tiny.close()
    assert Store(db, limits=TINY).put("fourth", now_ms=1).key.id == 4


def test_ref43_allocator_trigger_refuses_a_retired_id(tiny: Store, db: Path) -> None:
    record = tiny.put("retired", now_ms=1)
    tiny.delete(record.key)
    with raw(db) as connection, pytest.raises(sqlite3.IntegrityError, match="already allocated"):
        connection.execute(
            "INSERT INTO memories (id, content, normalized_identity, created_at_ms,"
            " updated_at_ms) VALUES (1, 'x', 'x', 0, 0)"
        )


def test_ref43_raw_row_advances_the_allocator(tiny: Store, db: Path) -> None:
    tiny.list()
    assert insert_raw(db, "legacy row") == 1
    assert tiny.put("next", now_ms=1).key.id == 2


def test_opens_a_database_written_by_the_v1_original(db: Path) -> None:
    db.parent.mkdir()
    with raw(db) as connection:  # the 3c0eb78 schema: no allocator table, no trigger
        connection.execute(tactmem._SCHEMA[0])
        connection.execute("PRAGMA user_version = 1")
        connection.execute(
            "INSERT INTO memories (id, content, normalized_identity, created_at_ms, updated_at_ms,"
            " probation_until_ms, version) VALUES (5, 'Rust wrote this', 'rust wrote this', 1, 1,"
            " NULL, 3)"
        )
    store = Store(db)
    (record,) = store.list(now_ms=2)
    assert record.key == Key(5, 3) and record.content == "Rust wrote this"
    assert store.put("tactmem wrote this", now_ms=2).key == Key(6, 1)


def test_database_capacity_maps_sqlite_full_and_writes_nothing(db: Path) -> None:
    limits = Limits(database_bytes=6 * 4096)  # room for the schema and a few rows
    store = Store(db, limits=limits)
    stored = 0
    with pytest.raises(DatabaseCapacity) as caught:
        for i in range(200):
            store.put(f"{i} " + "filler words " * 70, now_ms=1)
            stored += 1
    assert str(caught.value) == "memory database capacity was reached"
    assert 0 < stored < 200
    with raw(db) as connection:
        assert connection.execute("SELECT next_id FROM memory_metadata").fetchone() == (
            stored + 1,
        )
    assert len(store.list(now_ms=1)) == stored
    assert db.stat().st_size <= limits.database_bytes
    with raw(db) as connection:
        assert connection.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    store.delete(Key(1, 1))  # a full store still deletes


def test_busy_store_maps_to_store_busy(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tactmem, "_BUSY_TIMEOUT_S", 0.05)
    store = Store(db)
    store.list()
    with raw(db) as holder:
        holder.execute("BEGIN EXCLUSIVE")
        with pytest.raises(StoreBusy):
            store.put("waits for the lock", now_ms=1)
        holder.execute("ROLLBACK")
    assert store.put("waits for the lock", now_ms=1).key.id == 1


def test_scan_sees_writes_from_another_store(db: Path) -> None:
    reader, writer = Store(db), Store(db)
    assert reader.scan("sqlite", now_ms=1).abstained
    first = writer.put("use sqlite for storage", now_ms=1)
    assert [c.key for c in reader.scan("sqlite", now_ms=2).candidates] == [first.key]
    second = writer.put("sqlite pragmas matter", replace=first.key, now_ms=3)
    (candidate,) = reader.scan("sqlite", now_ms=4).candidates
    assert (candidate.key, candidate.preview) == (second.key, "sqlite pragmas matter")
    writer.delete(second.key)
    assert reader.scan("sqlite", now_ms=5).abstained


def test_scan_cache_tracks_own_writes_and_prunes(tiny: Store) -> None:
    tiny.put("cache alpha", now_ms=0)
    assert len(tiny.scan("cache", now_ms=1).candidates) == 1
    tiny.put("cache beta", now_ms=5)
    assert len(tiny.scan("cache", now_ms=6).candidates) == 2
    assert [c.preview for c in tiny.scan("cache", now_ms=10).candidates] == ["cache beta"]


def test_scan_matches_pure_rank_over_visible_rows(db: Path) -> None:
    texts = [
        "In the ledgerline repository, releases are tagged by CI.",
        "The ledgerline CI runs cargo nextest.",
        "Prefer small commits.",
        "Releases of ledgerline go out on Tuesdays.",
    ]
    store = Store(db)
    for text in texts:
        store.put(text, now_ms=1)
    result = store.scan("ledgerline releases CI", now_ms=2)
    expected = rank("ledgerline releases CI", enumerate(texts, start=1))
    assert [(c.key.id, c.score) for c in result.candidates] == expected


def test_read_prunes_at_the_inclusive_deadline(tiny: Store) -> None:
    record = tiny.put("too late to read", now_ms=100)
    assert tiny.read([record.key.id], now_ms=110) == ()
    assert tiny.list(now_ms=0) == ()


def test_scan_prunes_before_ranking(tiny: Store) -> None:
    tiny.put("expiring fact", now_ms=100)
    assert len(tiny.scan("fact", now_ms=109).candidates) == 1
    assert tiny.scan("fact", now_ms=110).abstained


def test_hidden_rows_take_no_part_in_bm25_statistics(tiny: Store, db: Path) -> None:
    tiny.put("alpha beta", now_ms=1)
    tiny.put("alpha gamma delta", now_ms=1)
    insert_raw(db, "alpha password=w and many more words to change the average length")
    scores = [(c.key.id, c.score) for c in tiny.scan("alpha", now_ms=2).candidates]
    assert scores == rank("alpha", [(1, "alpha beta"), (2, "alpha gamma delta")])


def test_failed_validation_touches_no_disk(db: Path) -> None:
    store = Store(db, limits=TINY)
    for content, error in [
        ("   ", EmptyContent),
        ("x" * 33, ContentTooLarge),
        ("token=abcdef", SecretRejected),
    ]:
        with pytest.raises(error):
            store.put(content, now_ms=1)
    with pytest.raises(QueryTooLarge):
        store.scan("q" * 17, now_ms=1)
    assert not db.parent.exists()


def test_scan_does_not_retokenize_the_corpus(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store, other = Store(db), Store(db)
    for i in range(20):
        store.put(f"conclusion {i} about sqlite caching", now_ms=1)
    store.scan("sqlite", now_ms=2)
    calls: list[str] = []
    real_tokenize = tactmem.tokenize

    def counting_tokenize(text: str) -> list[str]:
        calls.append(text)
        return real_tokenize(text)

    monkeypatch.setattr(tactmem, "tokenize", counting_tokenize)
    for _ in range(5):
        store.scan("sqlite caching", now_ms=3)
    assert calls == ["sqlite caching"] * 5  # the query only
    calls.clear()
    other.put("a new conclusion from another connection", now_ms=3)
    store.scan("conclusion", now_ms=4)
    assert calls == ["conclusion", "a new conclusion from another connection"]


def test_content_rewritten_without_a_version_bump_is_seen(db: Path) -> None:
    store = Store(db)
    store.put("postgres is the database", now_ms=1)
    assert not store.scan("postgres", now_ms=2).abstained
    with raw(db) as connection:  # a snapshot sync may rewrite a row and keep its version
        connection.execute(
            "UPDATE memories SET content = 'sqlite is the database',"
            " normalized_identity = 'sqlite is the database' WHERE id = 1"
        )
    assert store.scan("postgres", now_ms=3).abstained
    assert [c.preview for c in store.scan("sqlite", now_ms=3).candidates] == [
        "sqlite is the database"
    ]


def test_newer_schema_written_while_open_is_refused(db: Path) -> None:
    store = Store(db)
    store.put("written at version 1", now_ms=1)
    with raw(db) as connection:
        connection.execute("PRAGMA user_version = 2")
    before = db.read_bytes()
    with pytest.raises(UnsupportedSchema):
        store.put("must not land in a version 2 file", now_ms=2)
    with pytest.raises(UnsupportedSchema):
        store.scan("written", now_ms=2)
    assert db.read_bytes() == before


def test_replaced_or_removed_file_is_reopened(db: Path, tmp_path: Path) -> None:
    store = Store(db)
    store.put("old", now_ms=1)
    backup = tmp_path / "backup.sqlite3"
    with Store(backup) as other:
        other.put("from backup", now_ms=1)
    os.replace(backup, db)
    assert [r.content for r in store.list(now_ms=2)] == ["from backup"]
    assert [c.preview for c in store.scan("backup", now_ms=2).candidates] == ["from backup"]
    db.unlink()
    assert store.list(now_ms=3) == ()
    assert store.put("fresh file", now_ms=3).key == Key(1, 1)


def test_non_text_rows_are_hidden_but_deletable(tiny: Store, db: Path) -> None:
    tiny.list(now_ms=0)
    with raw(db) as connection:
        connection.execute(
            "INSERT INTO memories (content, normalized_identity, created_at_ms, updated_at_ms)"
            " VALUES (X'68656c6c6f', 'hello', 0, 0)"
        )
    assert tiny.scan("hello", now_ms=1).abstained
    assert tiny.read([1], now_ms=1) == ()
    assert tiny.list(now_ms=1) == ()
    tiny.delete(Key(1, 1))


def test_allocator_exhaustion_is_a_capacity_error(tiny: Store, db: Path) -> None:
    tiny.list(now_ms=0)
    with raw(db) as connection:
        connection.execute(
            "INSERT INTO memories (id, content, normalized_identity, created_at_ms,"
            " updated_at_ms) VALUES (?, 'last id', 'last id', 0, 0)",
            (2**63 - 1,),
        )
    with pytest.raises(DatabaseCapacity):
        tiny.put("no id left", now_ms=1)


def test_max_page_count_follows_each_stores_limits(db: Path) -> None:
    with Store(db) as big:
        big.put("roomy", now_ms=1)
    with Store(db, limits=Limits(database_bytes=8 * 4096)) as small:
        small.list(now_ms=1)
        assert small._connect().execute("PRAGMA max_page_count").fetchone() == (8,)


# ============================================================================ core and shell


def test_core_section_names_no_io_module() -> None:
    source = (HERE / "tactmem.py").read_text(encoding="utf-8")
    start = source.index("# " + "=" * 76 + " core (pure)")
    end = source.index("# " + "=" * 76 + " shell (I/O)")
    tree = ast.parse(source[start:end])
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    io_names = {"sqlite3", "os", "sys", "time", "tempfile", "threading", "open", "print", "input"}
    assert names & io_names == set()


# ============================================================================ command line


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = tactmem.main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_cli_round_trip(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_cli(capsys, "--db", str(db), "put", "Releases are tagged by CI.")
    assert (status, out) == (0, "stored #1 v1\n")
    status, out, _ = run_cli(capsys, "--db", str(db), "--json", "scan", "releases tagged")
    scan = json.loads(out)
    assert scan["operation"] == "scan" and not scan["abstained"]
    (candidate,) = scan["candidates"]
    assert candidate["key"] == {"id": 1, "version": 1}
    assert candidate["preview"] == "Releases are tagged by CI."
    status, out, _ = run_cli(capsys, "read", "1", "--db", str(db), "--json")
    (memory,) = json.loads(out)["memories"]
    assert list(memory) == [
        "key", "content", "created_at_ms", "updated_at_ms", "last_scanned_at_ms", "scan_count",
        "last_used_at_ms", "use_count", "probation_until_ms",
    ]  # fmt: skip
    assert memory["use_count"] == 1 and memory["scan_count"] == 1
    status, out, _ = run_cli(
        capsys, "--db", str(db), "put", "Releases are tagged by the workflow.", "--replace", "1@1"
    )
    assert out == "replaced #1 v2\n"
    status, out, err = run_cli(capsys, "--db", str(db), "delete", "1@1")
    assert (status, out, err) == (1, "", "tactmem: memory changed since it was read\n")
    status, out, _ = run_cli(capsys, "--db", str(db), "--json", "delete", "1@2")
    assert (status, json.loads(out)) == (0, {"operation": "delete", "id": 1})
    status, out, _ = run_cli(capsys, "--db", str(db), "list")
    assert (status, out) == (0, "memory is empty\n")


def test_cli_human_output(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_cli(capsys, "--db", str(db), "put", "Escape \x1b[31mred\x1b[0m text stays inert.")
    status, out, _ = run_cli(capsys, "--db", str(db), "scan", "escape text")
    assert status == 0 and out.startswith("#1 v1  ")
    assert "\x1b" not in out and "\ufffd[31mred" in out
    status, out, _ = run_cli(capsys, "--db", str(db), "read", "1")
    assert out.splitlines()[0].startswith("#1 v1 · updated 0s ago · scanned 1× · used 1×")
    status, out, _ = run_cli(capsys, "--db", str(db), "list", "--sort", "newest")
    assert "#1 v1" in out and "\x1b" not in out
    status, out, _ = run_cli(capsys, "--db", str(db), "scan", "nothing-shared")
    assert out == "no memory shares a term with the query (abstained)\n"


def test_cli_put_from_stdin(
    db: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO("From stdin,\nwith two lines.\n"))
    assert run_cli(capsys, "--db", str(db), "put", "-")[:2] == (0, "stored #1 v1\n")
    assert Store(db).list()[0].content == "From stdin,\nwith two lines.\n"


def test_cli_stats(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_cli(capsys, "--db", str(db), "put", "one conclusion")
    status, out, _ = run_cli(capsys, "--db", str(db), "--json", "stats")
    stats = json.loads(out)
    assert status == 0
    assert (stats["records"], stats["content_bytes"], stats["probation_records"]) == (1, 14, 1)
    assert stats["limits"]["records"] == 512
    assert stats["file_bytes"][""] == stats["database_bytes"] == db.stat().st_size
    status, out, _ = run_cli(capsys, "--db", str(db), "stats")
    assert "records        1 of 512" in out


@pytest.mark.parametrize(
    ("argv", "status", "message"),
    [
        (["scan"], 2, "tactmem: usage: the following arguments are required: query"),
        (["frobnicate"], 2, "tactmem: usage: argument COMMAND: invalid choice"),
        (["delete", "7"], 2, "tactmem: usage: argument ID@VERSION: a memory key is written"),
        (["read", "x"], 2, "tactmem: usage: argument ID: expected a whole number, not 'x'"),
        (["read", "٣"], 2, "tactmem: usage: argument ID: expected a whole number"),
        (["read", "1_0"], 2, "tactmem: usage: argument ID: expected a whole number"),
        (["read", "9" * 20], 2, "tactmem: usage: argument ID: expected a whole number"),
        (["scan", "q", "--limit", "9"], 2, "tactmem: usage: argument --limit: invalid choice: 9"),
        (["scan", "q", "--limit", "-1"], 2, "tactmem: usage: argument --limit: expected a whole"),
        (["scan", "  "], 1, "tactmem: memory scan query is empty"),
        (["scan", "q" * 513], 1, "tactmem: memory query exceeds the 512-byte limit"),
        (["put", "x" * 1025], 1, "tactmem: memory content exceeds the 1024-byte limit"),
        (["put", "ok", "--replace", "1@2"], 1, "tactmem: memory was not found"),
        (["put", "   "], 1, "tactmem: memory content is empty"),
        (["put", "password = hunter22"], 1, "tactmem: memory content was rejected"),
        (["delete", "7@1"], 1, "tactmem: memory was not found"),
    ],
)
def test_cli_errors_are_one_line(
    db: Path, capsys: pytest.CaptureFixture[str], argv: list[str], status: int, message: str
) -> None:
    got, out, err = run_cli(capsys, "--db", str(db), *argv)
    assert (got, out) == (status, "")
    assert err.startswith(message) and err.count("\n") == 1
    assert "hunter22" not in err


def test_cli_reports_unsupported_schema(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db.parent.mkdir()
    with raw(db) as connection:
        connection.execute("PRAGMA user_version = 9")
    status, _, err = run_cli(capsys, "--db", str(db), "list")
    assert status == 1
    assert err == (
        "tactmem: memory schema version 9 is unsupported; this build supports version 1\n"
    )


def test_cli_demo(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run_cli(capsys, "demo")
    assert (status, err) == (0, "")
    for expected in (
        "put three conclusions",
        "abstained: True",
        "use_count 1, probation_until_ms None",
        "now v2",
        "refused [conflict]",
        "refused [duplicate]",
        "refused [secret_rejected]",
        "refused [content_too_large]",
        "refused [record_capacity]",
        "delete #1 at v2: done",
        "2 records left",
    ):
        assert expected in out
    assert "hunter22" not in out


def test_cli_default_path_honours_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert run_cli(capsys, "put", "home store")[0] == 0
    assert (tmp_path / ".tact" / "memory" / "v1.sqlite3").exists()


def test_cli_help_and_version_return_zero(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_cli(capsys, "--version")
    assert (status, out) == (0, f"tactmem {tactmem.__version__}\n")
    status, out, _ = run_cli(capsys, "--help")
    assert status == 0 and "demo" in out


def test_cli_survives_a_closed_pipe_and_a_narrow_encoding(db: Path) -> None:
    with Store(db) as store:
        for i in range(240):
            store.put(f"{i} · " + "long conclusion text " * 45)
    command = [sys.executable, "-m", "tactmem", "--db", str(db)]
    reader = subprocess.Popen(
        [*command, "--json", "list"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=HERE
    )
    assert reader.stdout is not None and reader.stderr is not None
    reader.stdout.close()  # the reader leaves at once, like `| head -0`
    assert reader.wait() == 1
    assert reader.stderr.read() == b""
    ascii_only = subprocess.run(
        [*command, "list"], capture_output=True, cwd=HERE,
        env={**os.environ, "PYTHONIOENCODING": "ascii"},
    )  # fmt: skip
    assert ascii_only.returncode == 0 and ascii_only.stderr == b""
    assert b"\\xb7" in ascii_only.stdout
    no_stdin = subprocess.run(
        [*command, "put", "-"], capture_output=True, text=True, cwd=HERE, stdin=subprocess.DEVNULL
    )
    assert (no_stdin.returncode, no_stdin.stderr) == (1, "tactmem: memory content is empty\n")


def test_python_m_tactmem_in_a_subprocess(tmp_path: Path) -> None:
    version = subprocess.run(
        [sys.executable, "-m", "tactmem", "--version"],
        capture_output=True, text=True, cwd=HERE, check=True,
    )  # fmt: skip
    assert version.stdout == f"tactmem {tactmem.__version__}\n"
    db = tmp_path / "m.sqlite3"
    bad = subprocess.run(
        [sys.executable, "-m", "tactmem", "--db", str(db), "delete", "3@1"],
        capture_output=True, text=True, cwd=HERE,
    )  # fmt: skip
    assert (bad.returncode, bad.stderr) == (1, "tactmem: memory was not found\n")


# ============================================================================ packaging


def test_vendoring_copy_works(tmp_path: Path) -> None:
    vendor = tmp_path / "agent" / "_vendor"
    vendor.mkdir(parents=True)
    (tmp_path / "agent" / "__init__.py").write_text("")
    (vendor / "__init__.py").write_text("")
    shutil.copy(HERE / "tactmem.py", vendor / "tactmem.py")
    script = (
        "from agent._vendor import tactmem\n"
        "import sys\n"
        "store = tactmem.Store(sys.argv[1])\n"
        "store.put('Vendored copies work.')\n"
        "print(store.scan('vendored').candidates[0].preview)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "v.sqlite3")],
        capture_output=True, text=True, cwd=tmp_path, check=True,
    )  # fmt: skip
    assert result.stdout == "Vendored copies work.\n"


def test_public_api_surface() -> None:
    assert tactmem.__all__ == sorted(tactmem.__all__)
    readme = (HERE / "README.md").read_text(encoding="utf-8")
    for name in tactmem.__all__:
        assert hasattr(tactmem, name)
        assert f"`{name}" in readme, f"{name} is not documented in the README"
    for name in dir(tactmem):
        value = getattr(tactmem, name)
        if isinstance(value, type) and issubclass(value, TactmemError) and not name.startswith("_"):
            assert name in tactmem.__all__
            assert value.code == "error" or value is TactmemError or value.code.islower()


def test_error_codes_are_stable() -> None:
    assert {
        cls.__name__: cls.code
        for cls in (
            tactmem.EmptyContent, ContentTooLarge, QueryTooLarge, RecordCapacity,
            ContentCapacity, DatabaseCapacity, SecretRejected, Duplicate, NotFound, Conflict,
            UnsupportedSchema, StoreBusy, StorageError, tactmem.NotRoot, tactmem.ScanRequired,
            tactmem.InvalidRequest,
        )
    } == {
        "EmptyContent": "empty_content", "ContentTooLarge": "content_too_large",
        "QueryTooLarge": "query_too_large", "RecordCapacity": "record_capacity",
        "ContentCapacity": "content_capacity", "DatabaseCapacity": "database_capacity",
        "SecretRejected": "secret_rejected", "Duplicate": "duplicate", "NotFound": "not_found",
        "Conflict": "conflict", "UnsupportedSchema": "unsupported_schema",
        "StoreBusy": "store_busy", "StorageError": "storage_error", "NotRoot": "not_root",
        "ScanRequired": "scan_required", "InvalidRequest": "invalid_request",
    }  # fmt: skip


def test_limits_reject_nonsense() -> None:
    with pytest.raises(ValueError, match="records"):
        Limits(records=0)
    with pytest.raises(ValueError, match="probation_ms"):
        Limits(probation_ms=True)
    assert Limits() == Limits(1024, 512, 262_144, 4_194_304, 5, 512, 604_800_000)


def test_sort_modes_match_the_reference_fixture() -> None:
    def record(doc_id: int, updated: int, uses: int) -> tactmem.Record:
        return tactmem.Record(Key(doc_id, 1), "x", 0, updated, None, 0, None, uses, None)

    records = [record(1, 100, 5), record(2, 300, 1), record(3, 200, 5), record(4, 50, 0)]
    orders = {
        mode: [r.key.id for r in tactmem._sorted_records(records, mode)]
        for mode in tactmem._SORT_MODES
    }
    assert orders == {
        "useful": [3, 1, 2, 4], "newest": [2, 3, 1, 4], "oldest": [4, 1, 3, 2],
        "least": [4, 2, 1, 3],
    }  # fmt: skip
