"""Team memory for tactmem: a server that speaks Tact's remote protocol v1, on SQLite or PostgreSQL.

The server is a second shell over tactmem's pure core: the tokenizer, BM25 ranking, previews,
secret rules, identities, bounds, versions and plans all come from `tactmem`; this module adds
namespaces, bearer tokens, the HTTP routes, two storage engines, and the memory tool over MCP
at `/mcp`. Every operation is one transaction: read what the plan needs, ask the core, write
exactly the plan.

Requires Python >= 3.11, tactmem, Starlette, uvicorn, psycopg 3 (with psycopg_pool), numpy and the
MCP SDK.

Command line::

    tactmem-server (--sqlite FILE | --postgres URL) --credentials FILE [--host HOST] [--port N]
"""

# tactmem-server is released under the MIT licence, like tactmem.
# Copyright (c) 2026 the tactmem authors.

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import errno
import functools
import gc
import hashlib
import importlib
import ipaddress
import itertools
import json
import logging
import math
import os
import re
import resource
import socket
import sqlite3
import stat
import sys
import threading
import time
import tomllib
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Final, NamedTuple, NoReturn, Protocol

import anyio
import anyio.to_thread
import attrs
import numpy
import tactmem
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send
from tactmem import Key, Record, TactmemError

__version__ = "0.1.0"

__all__ = [
    "NamespaceStore", "PostgresEngine", "SqliteEngine", "TeamStore", "create_app",
    "load_credentials", "main",
]  # fmt: skip

# ============================================================================ constants

PROTOCOL_VERSION: Final = 1
LIMITS: Final = tactmem.Limits()  # the protocol's bounds, per namespace
MAX_BODY_BYTES: Final = 2 * 1024 * 1024
MAX_IN_FLIGHT: Final = 64  # places for store work: a request takes one once its body is in
READ_TIMEOUT_S: Final = 10.0  # for a request's head, and then for its body
MAX_CONNECTIONS: Final = 1024  # open connections, fewer when open files are short
_FILES_KEPT: Final = 64  # open files the connection bound leaves for the store, logs and the rest
STORE_TIMEOUT_S: Final = 30.0
MAX_EXPORT_PAGE: Final = 128
MCP_PATH: Final = "/mcp"
MCP_SESSION_IDLE_S: Final = 30 * 60.0  # an MCP session unused this long is closed
MCP_MAX_SESSIONS: Final = 1024  # open MCP sessions per server process
MCP_SESSIONS_PER_TOKEN: Final = 64  # a token opening more closes its least recently used
_MAX_I64: Final = 2**63 - 1
_MAX_U64: Final = 2**64 - 1
_NAMESPACE: Final = re.compile(r"[A-Za-z0-9._-]{1,128}")
_TOKEN: Final = re.compile(r"[A-Za-z0-9._~+/=-]{1,4096}")
_NAMESPACE_HEADER: Final = b"x-tact-memory-namespace"
_CREDENTIALS_FILE_BYTES: Final = 1 << 20
_ROLES: Final = ("reader", "writer")
_RETRIES: Final = 3  # a transaction PostgreSQL aborted for a deadlock is run again this often
_GRACE_S: Final = 5.0  # past the store timeout, a request stops waiting for a stuck thread
# Beyond the original (docs/server.md, "Safe pushes"): each export answer says, in these
# headers, the caller's namespace's change counter, next id and row count, and a sync naming the
# counter in `IF_CHANGES` is refused (409 conflict, nothing changed) if the counter has moved since.
FACT_HEADERS: Final = ("x-tactmem-changes", "x-tactmem-next-id", "x-tactmem-records")
IF_CHANGES: Final = "x-tactmem-if-changes"
_SIGNED: Final = re.compile(rb"-?[0-9]{1,19}")

_log = logging.getLogger("tactmem_server")

# ============================================================================ errors


class ApiError(Exception):
    """A protocol failure: an HTTP status and a stable code, the whole body `{"code":"..."}`.
    An `internal` one keeps, for the log only, the class names of what failed: the error and
    the one it was raised from or while handling (never a message, which may quote content)."""

    def __init__(self, status: int, code: str, failed: BaseException | None = None) -> None:
        super().__init__(code)
        self.status = status
        self.code = code
        cause = None if failed is None else failed.__cause__ or failed.__context__
        self.log = {} if failed is None else {"error_type": type(failed).__name__}
        if cause is not None:
            self.log["error_cause"] = type(cause).__name__


def _internal(failed: BaseException) -> ApiError:
    return ApiError(500, "internal", failed)


def _bad_request() -> ApiError:
    return ApiError(400, "bad_request")


def _forbidden() -> ApiError:
    return ApiError(403, "forbidden")


# How each of the core's errors travels (the original router's table). Any other error is
# `internal`, without detail.
_STORE_ERRORS: Final[Mapping[type[TactmemError], tuple[int, str]]] = {
    tactmem.EmptyContent: (400, "bad_request"),
    tactmem.SecretRejected: (400, "bad_request"),
    tactmem.InvalidRequest: (400, "bad_request"),
    tactmem.ContentTooLarge: (413, "content_too_large"),
    tactmem.QueryTooLarge: (413, "query_too_large"),
    tactmem.RecordCapacity: (507, "record_capacity"),
    tactmem.ContentCapacity: (507, "content_capacity"),
    tactmem.DatabaseCapacity: (507, "content_capacity"),
    tactmem.Duplicate: (409, "duplicate"),
    tactmem.Conflict: (409, "conflict"),
    tactmem.NotFound: (404, "not_found"),
    tactmem.StoreBusy: (503, "unavailable"),
    tactmem.RemoteDenied: (403, "forbidden"),  # another namespace's key, or a reader's change
}


def _api_error(error: TactmemError) -> ApiError:
    for kind in type(error).__mro__:
        if kind in _STORE_ERRORS:
            return ApiError(*_STORE_ERRORS[kind])
    return _internal(error)


class CredentialsError(Exception):
    """The credentials file cannot be used; the message never holds a token."""


class _Again(Exception):
    """PostgreSQL aborted the transaction (deadlock, serialization): run it again."""


# ============================================================================ wire (pure)


class Principal(NamedTuple):
    namespace: str
    role: str


class WireKey(NamedTuple):
    """A key as the protocol carries it: `namespace` is None for a local key."""

    namespace: str | None
    id: int
    version: int


def _valid_namespace(value: object) -> bool:
    return isinstance(value, str) and _NAMESPACE.fullmatch(value) is not None


def _valid_key(key: WireKey) -> bool:
    return (
        key.id > 0
        and key.version > 0
        and (key.namespace is None or _valid_namespace(key.namespace))
    )


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose names are all distinct (serde refuses a repeated field)."""
    value = dict(pairs)
    if len(value) != len(pairs):
        raise ValueError("repeated name")
    return value


def _no_constant(_name: str) -> NoReturn:
    raise ValueError("NaN and Infinity are not JSON")


def _check_texts(value: object) -> None:
    """Refuse a string holding a lone surrogate: `json` lets one through, UTF-8 cannot carry it."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            item.encode("utf-8")
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())


def decode_json(body: bytes) -> Any:
    """Parse a request body as strictly as serde_json: UTF-8, no NaN, no repeated names."""
    try:
        value = json.loads(
            body.decode("utf-8"), object_pairs_hook=_unique_object, parse_constant=_no_constant
        )
        _check_texts(value)
    except (ValueError, RecursionError):  # UnicodeError is a ValueError
        raise _bad_request() from None
    return value


_Decoder = Callable[[object], Any]
_REQUIRED: Final = object()


def _integer(low: int, high: int) -> _Decoder:
    def decode(value: object) -> int:
        if type(value) is not int or not low <= value <= high:
            raise _bad_request()
        return value

    return decode


_i64: Final = _integer(-_MAX_I64 - 1, _MAX_I64)
_u64: Final = _integer(0, _MAX_U64)


def _string(value: object) -> str:
    if not isinstance(value, str):
        raise _bad_request()
    return value


def _optional(decode: _Decoder) -> _Decoder:
    return lambda value: None if value is None else decode(value)


def _list_of(decode: _Decoder) -> _Decoder:
    def decoded(value: object) -> list[Any]:
        if not isinstance(value, list):
            raise _bad_request()
        return [decode(item) for item in value]

    return decoded


def _fields(
    value: object, fields: Mapping[str, tuple[_Decoder, object]], *, closed: bool
) -> dict[str, Any]:
    """Decode an object field by field; a closed one refuses unknown names (deny_unknown_fields)."""
    if not isinstance(value, dict) or (closed and value.keys() - fields.keys()):
        raise _bad_request()
    decoded = {}
    for name, (decode, default) in fields.items():
        if name in value:
            decoded[name] = decode(value[name])
        elif default is _REQUIRED:
            raise _bad_request()
        else:
            decoded[name] = default
    return decoded


def _key(value: object) -> WireKey:
    fields = _fields(value, _KEY_FIELDS, closed=False)
    return WireKey(fields["namespace"], fields["id"], fields["version"])


def _record(value: object) -> tuple[WireKey, Record]:
    fields = _fields(value, _RECORD_FIELDS, closed=False)
    key = fields.pop("key")
    return key, Record(Key(key.id, key.version), **fields)


def _cursor(value: object) -> tuple[str, int]:
    fields = _fields(
        value, {"namespace": (_string, _REQUIRED), "id": (_i64, _REQUIRED)}, closed=True
    )
    return fields["namespace"], fields["id"]


_KEY_FIELDS: Final = {
    "id": (_i64, _REQUIRED), "version": (_u64, _REQUIRED), "namespace": (_optional(_string), None),
}  # fmt: skip
_RECORD_FIELDS: Final = {
    "key": (_key, _REQUIRED), "content": (_string, _REQUIRED),
    "created_at_ms": (_i64, _REQUIRED), "updated_at_ms": (_i64, _REQUIRED),
    "last_scanned_at_ms": (_optional(_i64), None), "scan_count": (_u64, _REQUIRED),
    "last_used_at_ms": (_optional(_i64), None), "use_count": (_u64, _REQUIRED),
    "probation_until_ms": (_optional(_i64), None),
}  # fmt: skip
_usize: Final = _u64
_REQUESTS: Final[Mapping[str, Mapping[str, tuple[_Decoder, object]]]] = {
    "scan": {"query": (_string, _REQUIRED), "limit": (_usize, _REQUIRED)},
    "read": {"ids": (_list_of(_i64), []), "keys": (_list_of(_key), [])},
    "put": {"content": (_string, _REQUIRED), "replacement": (_optional(_key), None)},
    "delete": {"key": (_key, _REQUIRED)},
    "sync": {"memories": (_list_of(_record), _REQUIRED)},
    "export": {
        "namespaces": (_optional(_list_of(_string)), None),
        "cursor": (_optional(_cursor), None),
        "limit": (_usize, _REQUIRED),
    },
}


def wire_key(namespace: str, key: Key) -> dict[str, Any]:
    return {"id": key.id, "version": key.version, "namespace": namespace}


def wire_record(namespace: str, record: Record) -> dict[str, Any]:
    fields = attrs.asdict(record, recurse=False)
    return {**fields, "key": wire_key(namespace, record.key)}


def _body(value: object) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


# ============================================================================ rules (pure)
# What the protocol adds to the core's rules: request checks in the original router's order,
# one combined corpus over every namespace, and the sync snapshot's plan.

_Principals = Mapping[bytes, Principal]


def _token_hash(token: str) -> bytes:
    return hashlib.sha256(token.encode("ascii")).digest()


def bearer(principals: _Principals, headers: Mapping[bytes, bytes]) -> tuple[bytes, Principal]:
    """The caller's token hash and principal: `Authorization: Bearer <token>` of a known token
    (401 otherwise)."""
    scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
    try:
        text = token.decode("ascii")
    except UnicodeDecodeError:
        raise ApiError(401, "unauthorized") from None
    if scheme.lower() != b"bearer" or _TOKEN.fullmatch(text) is None:
        raise ApiError(401, "unauthorized")
    digest = _token_hash(text)
    principal = principals.get(digest)
    if principal is None:
        raise ApiError(401, "unauthorized")
    return digest, principal


def authenticate(principals: _Principals, headers: Mapping[bytes, bytes]) -> Principal:
    """The caller of a `/v1` route: a known bearer token (401 otherwise), and the namespace
    header naming that token's namespace (403 `namespace_mismatch` otherwise)."""
    _, principal = bearer(principals, headers)
    if headers.get(_NAMESPACE_HEADER) != principal.namespace.encode("ascii"):
        raise ApiError(403, "namespace_mismatch")
    return principal


def _doc_id(namespace: str, doc_id: int) -> int:
    """One integer per `(namespace, id)` that orders as the pair does (namespaces by bytes),
    so the core's corpus, which breaks ties by id, breaks them by namespace, then id."""
    prefix = int.from_bytes(namespace.encode("ascii").ljust(128, b"\0"), "big")
    return prefix << 64 | doc_id


def _doc_key(doc_id: int) -> tuple[str, int]:
    prefix = (doc_id >> 64).to_bytes(128, "big").rstrip(b"\0")
    return prefix.decode("ascii"), doc_id & _MAX_U64


# The request checks below raise the core's errors; `_STORE_ERRORS` says how each travels on
# `/v1`, and the memory tool at `/mcp` answers with their own codes and messages.


def check_scan(payload: Mapping[str, Any]) -> tuple[list[str], int]:
    query, limit = payload["query"], payload["limit"]
    if len(query.encode("utf-8")) > LIMITS.query_bytes:
        raise tactmem.QueryTooLarge(LIMITS.query_bytes)
    if not 1 <= limit <= LIMITS.scan_results:
        raise tactmem.InvalidRequest(
            f"memory scan limit must be between 1 and {LIMITS.scan_results}"
        )
    return tactmem.core.scan_terms(query, LIMITS), limit


def check_read(payload: Mapping[str, Any], namespace: str) -> list[WireKey]:
    """What a read looks up, in the original's order (versioned keys, then the caller's own
    ids), each `(namespace, id)` once; local-shaped keys and unmatchable versions name nothing."""
    ids, keys = payload["ids"], payload["keys"]
    if len(ids) + len(keys) > LIMITS.records:
        raise tactmem.InvalidRequest(f"a read names at most {LIMITS.records} ids and keys")
    if any(doc_id <= 0 for doc_id in ids) or not all(map(_valid_key, keys)):
        raise tactmem.InvalidRequest("a read names positive ids and versions")
    wanted = [key for key in keys if key.namespace is not None and key.version <= _MAX_I64]
    wanted += [WireKey(namespace, doc_id, 0) for doc_id in ids]  # version 0: any version
    first: dict[tuple[str | None, int], WireKey] = {}
    for key in wanted:
        first.setdefault((key.namespace, key.id), key)
    return list(first.values())


def _check_own(key: WireKey, namespace: str) -> Key:
    """A key a change may name: a valid one of the caller's namespace (403 `forbidden`)."""
    if not _valid_key(key) or key.namespace != namespace:
        raise tactmem.RemoteDenied("remote memory changes only its own namespace's records")
    return Key(key.id, key.version)


def check_put(payload: Mapping[str, Any], namespace: str, now_ms: int) -> tactmem.core.Put:
    """The original router's order: empty (400), too large (413), a replacement that is not
    the caller's (403), then the store's refusals: a secret or a NUL character (400)."""
    content, replacement = payload["content"], payload["replacement"]
    key = None if replacement is None else Key(replacement.id, replacement.version)
    try:
        put, refused = tactmem.core.check_put(content, key, LIMITS, now_ms), None
    except (tactmem.SecretRejected, tactmem.InvalidRequest) as error:  # a secret, or a NUL
        put, refused = None, error
    if replacement is not None:
        _check_own(replacement, namespace)
    if refused is not None or put is None:
        raise refused or tactmem.InvalidRequest()
    return put


def check_delete(payload: Mapping[str, Any], namespace: str) -> Key:
    return _check_own(payload["key"], namespace)


def check_sync(payload: Mapping[str, Any], now_ms: int) -> list[tuple[Record, str]]:
    """A snapshot the router admits (400 otherwise: local keys, distinct ids, content within
    bounds, sane times), then the store's checks: counters that fit (409 conflict), content
    the core would store (400), one record per identity (409 duplicate). Each record with
    its identity."""
    snapshot: list[tuple[WireKey, Record]] = payload["memories"]
    sizes = [len(record.content.encode("utf-8")) for _, record in snapshot]
    if (
        len(snapshot) > LIMITS.records
        or len({key.id for key, _ in snapshot}) != len(snapshot)
        or sum(sizes) > LIMITS.total_content_bytes
        or not all(_admitted(key, record) for key, record in snapshot)
    ):
        raise _bad_request()
    checked, identities = [], set()
    for _, record in snapshot:
        if max(record.key.version, record.scan_count, record.use_count) > _MAX_I64:
            raise tactmem.Conflict()
        identity = tactmem.core.check_put(record.content, None, LIMITS, now_ms).identity
        if identity in identities:
            raise tactmem.Duplicate()
        identities.add(identity)
        checked.append((record, identity))
    return checked


def check_guard(value: bytes | None) -> int | None:
    """A sync's `IF_CHANGES` header: the change counter it expects (a 64-bit integer), or None
    without one; anything else is 400."""
    if value is None:
        return None
    if _SIGNED.fullmatch(value) is None or not -_MAX_I64 - 1 <= int(value) <= _MAX_I64:
        raise _bad_request()
    return int(value)


def _admitted(key: WireKey, record: Record) -> bool:
    """A snapshot record the router takes: a valid local key with an id below 2^63 - 1,
    content that is not blank and fits one record, and `0 <= created_at_ms <= updated_at_ms`."""
    content = record.content
    return (
        key.namespace is None
        and _valid_key(key)
        and key.id < _MAX_I64  # the allocator must hold the id after it (see `plan_put`)
        and content != ""
        and tactmem.core.BLANK.fullmatch(content) is None
        and len(content.encode("utf-8")) <= LIMITS.content_bytes
        and 0 <= record.created_at_ms <= record.updated_at_ms
    )


def check_export(
    payload: Mapping[str, Any],
) -> tuple[list[str] | None, tuple[str, int] | None, int]:
    namespaces, cursor, limit = payload["namespaces"], payload["cursor"], payload["limit"]
    if not 1 <= limit <= MAX_EXPORT_PAGE:
        raise _bad_request()
    if namespaces is not None and (
        not namespaces
        or len(namespaces) > LIMITS.records
        or not all(map(_valid_namespace, namespaces))
    ):
        raise _bad_request()
    if cursor is not None and (not _valid_namespace(cursor[0]) or cursor[1] <= 0):
        raise _bad_request()
    return namespaces, cursor, limit


def plan_put(put: tactmem.core.Put, state: tactmem.core.PutState) -> tactmem.core.PutPlan:
    """The core's put plan, in the protocol's order of refusals: a replace whose content
    another row holds is `duplicate` before `not_found` or `conflict` (the original classifies
    a failed write as duplicate, not found, conflict, capacity); an insert's order is the core's.
    The allocator records the id after each one it hands out, a 64-bit integer too, so the last
    id, 2^63 - 1, is never handed out: no id left is the core's `DatabaseCapacity` (the
    original's allocator refuses the same id with its storage capacity error)."""
    if put.replace is not None and state.duplicate_of not in (None, put.replace.id):
        raise tactmem.Duplicate()
    plan = tactmem.core.plan_put(put, state, LIMITS)
    if plan.insert and plan.record.key.id >= _MAX_I64:
        raise tactmem.DatabaseCapacity()
    return plan


def plan_sync(previous: Mapping[int, Record], snapshot: Sequence[Record]) -> dict[str, int]:
    """The sync report: each snapshot record inserted, replaced or unchanged (full equality,
    telemetry included) against the namespace's rows, and the rows it leaves out deleted."""
    report = {"inserted": 0, "replaced": 0, "unchanged": 0, "deleted": 0}
    for record in snapshot:
        old = previous.get(record.key.id)
        report["inserted" if old is None else "unchanged" if old == record else "replaced"] += 1
    report["deleted"] = len(previous.keys() - {record.key.id for record in snapshot})
    return report


def keep_reads(
    previous: Mapping[int, Record], snapshot: Sequence[tuple[Record, str]]
) -> list[tuple[Record, str]]:
    """A guarded sync's snapshot with the reads that landed since the export it was planned
    from (scans and reads do not move the change counter, so the guard lets them through): a
    record at its row's version and content keeps the row's higher counts and later times, and
    is off probation if the row is. Otherwise a push would undo an agent's read, and put back
    on probation a record an agent used, to be dropped at its end."""

    def later(a: int | None, b: int | None) -> int | None:
        return b if a is None else a if b is None else max(a, b)

    kept = []
    for record, identity in snapshot:
        row = previous.get(record.key.id)
        if row is not None and row.key == record.key and row.content == record.content:
            record = attrs.evolve(
                record,
                scan_count=max(record.scan_count, row.scan_count),
                use_count=max(record.use_count, row.use_count),
                last_scanned_at_ms=later(record.last_scanned_at_ms, row.last_scanned_at_ms),
                last_used_at_ms=later(record.last_used_at_ms, row.last_used_at_ms),
                probation_until_ms=(
                    None if row.probation_until_ms is None else record.probation_until_ms
                ),
            )
        kept.append((record, identity))
    return kept


# ============================================================================ storage (I/O)


_Statement = tuple[str, Sequence[object]]


class _Tx(Protocol):
    """One open transaction of an engine; statements use `?` placeholders."""

    def rows(self, sql: str, params: Sequence[object] = ()) -> list[tuple[Any, ...]]: ...
    def run(self, sql: str, params: Sequence[object] = ()) -> None: ...
    def many(self, sql: str, params: Iterable[Sequence[object]]) -> None: ...
    def batch(self, statements: Sequence[_Statement]) -> list[list[tuple[Any, ...]]]:
        """These statements in order, in one round trip where the engine can (PostgreSQL's
        pipeline mode); the rows of each (none for a write)."""
        ...


class _Engine(Protocol):
    bytes_sql: str  # the UTF-8 length of `content`
    lock_sql: str  # appended to a SELECT that locks its rows until commit

    def transaction(self, deadline: float) -> contextlib.AbstractContextManager[_Tx]: ...
    def check(self, deadline: float) -> None: ...
    def close(self) -> None: ...


_SCHEMA: Final = (
    """CREATE TABLE IF NOT EXISTS memory_namespaces (
        namespace {ns} NOT NULL PRIMARY KEY,
        next_id {int} NOT NULL DEFAULT 1 CHECK (next_id > 0),
        changes {int} NOT NULL DEFAULT 0
    ){strict}""",
    """CREATE TABLE IF NOT EXISTS memories (
        namespace {ns} NOT NULL REFERENCES memory_namespaces (namespace),
        id {int} NOT NULL CHECK (id > 0),
        version {int} NOT NULL CHECK (version > 0),
        content TEXT NOT NULL,
        identity TEXT NOT NULL,
        created_at_ms {int} NOT NULL,
        updated_at_ms {int} NOT NULL,
        last_scanned_at_ms {int},
        scan_count {int} NOT NULL DEFAULT 0 CHECK (scan_count >= 0),
        last_used_at_ms {int},
        use_count {int} NOT NULL DEFAULT 0 CHECK (use_count >= 0),
        probation_until_ms {int},
        PRIMARY KEY (namespace, id),
        UNIQUE (namespace, identity)
    ){strict}""",
    "CREATE INDEX IF NOT EXISTS memories_probation ON memories (probation_until_ms)"
    " WHERE probation_until_ms IS NOT NULL",
)
_COLUMNS: Final = (
    "namespace, id, version, content, created_at_ms, updated_at_ms, last_scanned_at_ms,"
    " scan_count, last_used_at_ms, use_count, probation_until_ms"
)
_INSERT: Final = (
    "INSERT INTO memories (namespace, id, version, content, identity, created_at_ms,"
    " updated_at_ms, last_scanned_at_ms, scan_count, last_used_at_ms, use_count,"
    " probation_until_ms) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
_UPDATE: Final = (
    "UPDATE memories SET version = ?, content = ?, identity = ?, created_at_ms = ?,"
    " updated_at_ms = ?, last_scanned_at_ms = ?, scan_count = ?, last_used_at_ms = ?,"
    " use_count = ?, probation_until_ms = ? WHERE namespace = ? AND id = ?"
)
_CAPPED: Final = "CASE WHEN {0} < 9223372036854775807 THEN {0} + 1 ELSE {0} END"
# A change counter's move: compared for equality only, so at 2^63 - 1 it wraps to -2^63
# rather than fail every write of its namespace.
_BUMP: Final = (
    "changes = CASE WHEN changes < 9223372036854775807 THEN changes + 1"
    " ELSE -9223372036854775807 - 1 END"
)
_SQLITE_TYPES: Final = {"ns": "TEXT", "int": "INTEGER", "strict": " STRICT"}
_POSTGRES_TYPES: Final = {"ns": 'TEXT COLLATE "C"', "int": "BIGINT", "strict": ""}


# ------------------------------------------------------------------------ what the server trusts
# The local store's rules for a hostile file, applied to the server's database: inspect before
# anything writes, and refuse what tactmem-server did not create. A trigger, rule or policy
# would run on the server's own writes (an AFTER INSERT ... DELETE loses every acknowledged
# put), a changed table breaks its rules, another application's tables are not team memory.


def _not_ours(where: str, kind: str) -> tactmem.StorageError:
    article = "an" if kind[0] in "aeiou" else "a"
    return tactmem.StorageError(
        f"the {where} is not a tactmem-server database"
        f" (it holds {article} {kind} tactmem-server did not create)"
    )


@functools.cache
def _sqlite_objects() -> frozenset[tuple[object, object, object]]:
    """The schema objects tactmem-server creates in a SQLite file, as SQLite records them
    (`_SCHEMA` run on an empty in-memory database), and the statistics table `ANALYZE` adds."""
    connection = sqlite3.connect(":memory:")
    try:
        for statement in (*(sql.format(**_SQLITE_TYPES) for sql in _SCHEMA), "ANALYZE"):
            connection.execute(statement)
        return frozenset(tactmem.core.schema_objects(connection))
    finally:
        connection.close()


# What a file the server made reports besides its objects: a local tactmem store's
# user_version is 1, and text that is not UTF-8 would make stored lengths other bytes than
# the bounds count.
_SQLITE_PRAGMAS: Final = (
    ("user_version", 0, "user_version"),
    ("encoding", "UTF-8", "text encoding"),
)


def _check_sqlite(connection: sqlite3.Connection) -> None:
    """Refuse a SQLite file holding anything tactmem-server does not create (each object's
    whole SQL compared), or another user_version or text encoding."""
    for kind, _, _ in tactmem.core.schema_objects(connection) - _sqlite_objects():
        raise _not_ours("file", str(kind))
    for pragma, expected, what in _SQLITE_PRAGMAS:
        if connection.execute(f"PRAGMA {pragma}").fetchone() != (expected,):
            raise _not_ours("file", f"{what} other than {expected}")


def _inspect_sqlite(path: str) -> None:
    """`_check_sqlite` through a read-only connection first (tactmem's `_inspect`, with the
    server's rules), so that a refused file is never written: not by a journal-mode change, nor
    by SQLite checkpointing a WAL file as it closes. A WAL file without a log is opened
    immutable, which leaves no -shm beside it. A hot journal cannot be read read-only; the
    read-write connection rolls it back (as any SQLite writer does) and checks the file after."""
    name = path.replace("%", "%25").replace("?", "%3f").replace("#", "%23")
    try:
        with open(path, "rb") as file:
            settled = file.read(20)[18:] == b"\x02\x02" and not os.path.exists(path + "-wal")
    except OSError:
        raise tactmem.StorageError("could not open the memory database file") from None
    connection = tactmem.core.open_sqlite(
        f"file:{name}?mode=ro{'&immutable=1' * settled}", LIMITS, uri=True
    )
    try:
        _check_sqlite(connection)
    except sqlite3.OperationalError as error:
        if not getattr(error, "sqlite_errorname", "").startswith("SQLITE_READONLY"):
            raise
    finally:
        connection.close()


# What the schema the server uses (`current_schema()`) holds, and what is attached to its
# tables from anywhere: one `(kind, name, definition)` row per object, a table's columns and
# constraints folded into its definition, so that each table compares whole, as in SQLite.
_POSTGRES_CATALOG: Final = """
WITH here AS (SELECT oid FROM pg_namespace WHERE nspname = current_schema()),
rel AS (
    SELECT c.oid, c.relname, c.relkind, c.relrowsecurity OR c.relforcerowsecurity AS secured
      FROM pg_class c JOIN here ON c.relnamespace = here.oid
),
part AS (
    SELECT a.attrelid AS rel, concat_ws(' ', quote_ident(a.attname),
           format_type(a.atttypid, a.atttypmod), CASE WHEN a.attnotnull THEN 'NOT NULL' END,
           'DEFAULT ' || pg_get_expr(d.adbin, d.adrelid), 'COLLATE ' || quote_ident(co.collname),
           CASE WHEN a.attgenerated <> '' THEN 'GENERATED' END,
           CASE WHEN a.attidentity <> '' THEN 'IDENTITY' END) AS text
      FROM pg_attribute a
      LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
      LEFT JOIN pg_collation co ON co.oid = a.attcollation AND co.collname <> 'default'
     WHERE a.attrelid IN (SELECT oid FROM rel WHERE relkind IN ('r', 'p')) AND a.attnum > 0
       AND NOT a.attisdropped
    UNION ALL
    SELECT conrelid, quote_ident(conname) || ' ' || pg_get_constraintdef(oid) FROM pg_constraint
     WHERE conrelid IN (SELECT oid FROM rel) AND contype <> 'n'
)
SELECT CASE WHEN relkind IN ('r', 'p') THEN 'table' WHEN relkind IN ('i', 'I') THEN 'index'
            WHEN relkind IN ('v', 'm') THEN 'view' WHEN relkind = 'S' THEN 'sequence'
            ELSE 'relation' END,
       relname,
       CASE WHEN relkind IN ('i', 'I') THEN
            replace(pg_get_indexdef(oid), ' ON ' || quote_ident(current_schema()) || '.', ' ON ')
            ELSE COALESCE((SELECT string_agg(text, ', ' ORDER BY text COLLATE "C") FROM part
                            WHERE part.rel = rel.oid), '') END
  FROM rel
UNION ALL SELECT 'row security setting', relname, '' FROM rel WHERE secured
UNION ALL SELECT 'function', p.oid::regprocedure::text, '' FROM pg_proc p
           JOIN here ON p.pronamespace = here.oid
UNION ALL SELECT 'type', t.typname, '' FROM pg_type t JOIN here ON t.typnamespace = here.oid
           WHERE t.typrelid = 0
             AND NOT EXISTS (SELECT FROM pg_type e WHERE e.oid = t.typelem AND e.typrelid <> 0)
UNION ALL SELECT 'operator', o.oid::regoperator::text, '' FROM pg_operator o
           JOIN here ON o.oprnamespace = here.oid
UNION ALL SELECT 'trigger', tgname, '' FROM pg_trigger
           WHERE NOT tgisinternal AND tgrelid IN (SELECT oid FROM rel)
UNION ALL SELECT 'rule', rulename, '' FROM pg_rewrite
           WHERE rulename <> '_RETURN' AND ev_class IN (SELECT oid FROM rel)
UNION ALL SELECT 'policy', polname, '' FROM pg_policy WHERE polrelid IN (SELECT oid FROM rel)
UNION ALL SELECT 'inheritance', inhrelid::regclass::text, inhparent::regclass::text
           FROM pg_inherits
           WHERE inhparent IN (SELECT oid FROM rel) OR inhrelid IN (SELECT oid FROM rel)
UNION ALL SELECT 'foreign key', conname, conrelid::regclass::text FROM pg_constraint
           WHERE confrelid IN (SELECT oid FROM rel) AND conrelid NOT IN (SELECT oid FROM rel)
UNION ALL SELECT 'event trigger', evtname, '' FROM pg_event_trigger
"""


def _table(*parts: str) -> str:
    return ", ".join(sorted(parts))


# Exactly what `_SCHEMA` creates, as `_POSTGRES_CATALOG` describes it (PostgreSQL 15; a test
# checks that a database the server creates holds this and nothing else).
_POSTGRES_OBJECTS: Final = frozenset({
    ("table", "memory_namespaces", _table(
        "namespace text NOT NULL COLLATE \"C\"", "next_id bigint NOT NULL DEFAULT 1",
        "changes bigint NOT NULL DEFAULT 0",
        "memory_namespaces_next_id_check CHECK ((next_id > 0))",
        "memory_namespaces_pkey PRIMARY KEY (namespace)",
    )),
    ("table", "memories", _table(
        "namespace text NOT NULL COLLATE \"C\"", "id bigint NOT NULL", "version bigint NOT NULL",
        "content text NOT NULL", "identity text NOT NULL", "created_at_ms bigint NOT NULL",
        "updated_at_ms bigint NOT NULL", "last_scanned_at_ms bigint",
        "scan_count bigint NOT NULL DEFAULT 0", "last_used_at_ms bigint",
        "use_count bigint NOT NULL DEFAULT 0", "probation_until_ms bigint",
        "memories_id_check CHECK ((id > 0))", "memories_version_check CHECK ((version > 0))",
        "memories_scan_count_check CHECK ((scan_count >= 0))",
        "memories_use_count_check CHECK ((use_count >= 0))",
        "memories_namespace_fkey FOREIGN KEY (namespace) REFERENCES memory_namespaces(namespace)",
        "memories_pkey PRIMARY KEY (namespace, id)",
        "memories_namespace_identity_key UNIQUE (namespace, identity)",
    )),
    ("index", "memory_namespaces_pkey", "CREATE UNIQUE INDEX memory_namespaces_pkey"
     " ON memory_namespaces USING btree (namespace)"),
    ("index", "memories_pkey", "CREATE UNIQUE INDEX memories_pkey ON memories USING btree"
     " (namespace, id)"),
    ("index", "memories_namespace_identity_key", "CREATE UNIQUE INDEX"
     " memories_namespace_identity_key ON memories USING btree (namespace, identity)"),
    ("index", "memories_probation", "CREATE INDEX memories_probation ON memories USING btree"
     " (probation_until_ms) WHERE (probation_until_ms IS NOT NULL)"),
})  # fmt: skip


def _check_postgres(found: set[tuple[Any, ...]]) -> None:
    """Refuse a PostgreSQL database holding what tactmem-server does not create (what
    `_POSTGRES_CATALOG` finds beyond `_POSTGRES_OBJECTS`); what is missing is created."""
    for kind, _, _ in sorted(found - _POSTGRES_OBJECTS):
        raise _not_ours("PostgreSQL database", kind)


# Run in every PostgreSQL transaction, in the round trip that sets its timeouts: the tables
# held against a change until commit (a new trigger, rule or policy needs a lock this one
# conflicts with), then what would run on the server's statements is counted: a trigger, a
# rule, a policy or row security, an inheriting table. A count above 0 divides by zero: the
# statement fails, so nothing sent after it in the pipeline runs, and the operation is refused.
_POSTGRES_GUARD: Final[tuple[_Statement, ...]] = (
    ("LOCK TABLE memory_namespaces, memories IN ROW EXCLUSIVE MODE", ()),
    (
        """WITH ours AS (SELECT 'memories'::regclass::oid AS oid
              UNION ALL SELECT 'memory_namespaces'::regclass)
SELECT 1 / (count(*) = 0)::int FROM (
    SELECT FROM pg_trigger WHERE tgrelid IN (SELECT oid FROM ours) AND NOT tgisinternal
    UNION ALL SELECT FROM pg_rewrite WHERE ev_class IN (SELECT oid FROM ours)
    UNION ALL SELECT FROM pg_policy WHERE polrelid IN (SELECT oid FROM ours)
    UNION ALL SELECT FROM pg_inherits WHERE inhparent IN (SELECT oid FROM ours)
    UNION ALL SELECT FROM pg_class
               WHERE oid IN (SELECT oid FROM ours) AND (relrowsecurity OR relforcerowsecurity)
) attached""",
        (),
    ),
)


_COUNTERS: Final[_Statement] = (
    "SELECT namespace, changes FROM memory_namespaces ORDER BY namespace",
    (),
)


def _marks(count: int) -> str:
    return ", ".join("?" * count)


def _changes(namespaces: Sequence[str]) -> _Statement:
    """The statement that moves these namespaces' change counters (`_BUMP`)."""
    marks = _marks(len(namespaces))
    return f"UPDATE memory_namespaces SET {_BUMP} WHERE namespace IN ({marks})", namespaces


def _namespaced(row: Sequence[Any]) -> tuple[str, Record]:
    return row[0], Record.from_row(row[1:])


def _served(namespace: str, record: Record) -> bool:
    """Whether a row may be answered: one the core shows (text, not secret-shaped, sound
    metadata) in a namespace a credential can name, that the original client accepts (content
    within one record's bound, `0 <= created_at_ms <= updated_at_ms`). A foreign writer's
    other rows are hidden."""
    return (
        _valid_namespace(namespace)
        and tactmem.core.shown(record)
        and len(record.content.encode("utf-8")) <= LIMITS.content_bytes
        and 0 <= record.created_at_ms <= record.updated_at_ms
    )


def _deadline_left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise tactmem.StoreBusy()
    return left


# The statements that remove or overwrite a record's text: a delete (of a record, a pruned
# one, a namespace a sync replaces) and the update a replace makes.
_ERASING: Final = ("DELETE FROM memories ", _UPDATE)


class _SqliteTx:
    """A transaction's statements; `erased` once one of them removed or overwrote text."""

    def __init__(self, connection: sqlite3.Connection) -> None:
        self.connection = connection
        self.erased = False

    def rows(self, sql: str, params: Sequence[object] = ()) -> list[tuple[Any, ...]]:
        return self.connection.execute(sql, params).fetchall()

    def run(self, sql: str, params: Sequence[object] = ()) -> None:
        self._note(sql, self.connection.execute(sql, params))

    def many(self, sql: str, params: Iterable[Sequence[object]]) -> None:
        self._note(sql, self.connection.executemany(sql, params))

    def batch(self, statements: Sequence[_Statement]) -> list[list[tuple[Any, ...]]]:
        found = []
        for sql, params in statements:
            cursor = self.connection.execute(sql, params)
            self._note(sql, cursor)
            found.append(cursor.fetchall())
        return found

    def _note(self, sql: str, cursor: sqlite3.Cursor) -> None:
        self.erased = self.erased or (sql.startswith(_ERASING) and cursor.rowcount > 0)


class SqliteEngine:
    """One SQLite file: every transaction `BEGIN IMMEDIATE`, so the whole file is the lock
    (several server processes may share the file). WAL with full sync: a committed write
    survives a crash of the process or the machine. `secure_delete` zeroes a removed text in
    its page, and a commit that removed or overwrote text is checkpointed into the main file
    with the WAL truncated, so no older copy of the page outlives the answer."""

    bytes_sql = "length(CAST(content AS BLOB))"
    lock_sql = ""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(os.path.expanduser(path))
        self._lock = threading.Lock()
        self._schema_cookie = -1  # the file's `schema_version` when it was last checked
        tactmem.core.prepare_file(self.path)  # 0600 in 0700 directories
        try:
            _inspect_sqlite(self.path)  # read-only: a refused file is never written
            connection = tactmem.core.open_sqlite(
                self.path, tactmem.Limits(), isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as error:  # such as a file that is not SQLite at all
            raise tactmem.core.storage_error(error) from None
        self._connection = connection
        try:
            _check_sqlite(connection)  # again, on the connection that writes: before it does
            connection.execute("PRAGMA journal_mode = WAL")
            connection.execute("PRAGMA synchronous = FULL")
            connection.execute("PRAGMA secure_delete = ON")
            connection.execute("PRAGMA foreign_keys = ON")
            with self.transaction(time.monotonic() + STORE_TIMEOUT_S) as tx:
                for statement in _SCHEMA:
                    tx.run(statement.format(**_SQLITE_TYPES))
        except BaseException as error:
            connection.close()
            if isinstance(error, sqlite3.Error):
                raise tactmem.core.storage_error(error) from None
            raise

    def _check_file(self, connection: sqlite3.Connection) -> None:
        """The whole file checked again (`_check_sqlite`) whenever its schema changed since
        this engine last looked, in the write transaction before anything writes: a trigger
        planted under a running server is refused before it can run."""
        (cookie,) = connection.execute("PRAGMA schema_version").fetchone()
        if cookie != self._schema_cookie:
            _check_sqlite(connection)
            self._schema_cookie = cookie

    @contextlib.contextmanager
    def transaction(self, deadline: float) -> Iterator[_Tx]:
        if not self._lock.acquire(timeout=_deadline_left(deadline)):
            raise tactmem.StoreBusy()
        try:
            connection = self._connection
            tactmem.core.begin_immediate(connection, deadline)
            try:
                self._check_file(connection)
                tx = _SqliteTx(connection)
                yield tx
                connection.execute("COMMIT")
            except BaseException:
                if connection.in_transaction:
                    connection.execute("ROLLBACK")
                raise
            if tx.erased:  # waits (the busy timeout) for another process's transaction to end
                connection.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        except sqlite3.Error as error:
            raise tactmem.core.storage_error(error) from None
        finally:
            self._lock.release()

    def check(self, deadline: float) -> None:
        with self.transaction(deadline) as tx:
            tx.rows("SELECT 1")

    def close(self) -> None:
        with self._lock:
            self._connection.close()


class _PostgresTx:
    """A transaction's statements, in as few round trips as their order allows. A write waits
    (nothing reads what it returns) and goes out with the next read or with the commit, which
    first sets the timeouts to what is left of the deadline: no write runs past it. The
    opening (`BEGIN`, the timeouts, `_POSTGRES_GUARD`) goes out with the first statements; the
    guard fails when anything is attached to the tables, and PostgreSQL then runs nothing after
    it. `fresh` until the opening has gone: a connection found broken then has run nothing."""

    def __init__(
        self, connection: Any, deadline: float, guarded: bool, refused: type[Exception]
    ) -> None:
        self.connection, self.deadline = connection, deadline
        self.fresh = True
        guard = _POSTGRES_GUARD if guarded else ()
        # READ COMMITTED whatever the database's default: under REPEATABLE READ the timeouts'
        # SELECT would take the snapshot before the lock, and the guard would not see a
        # trigger committed while the lock was awaited
        self._opening = [("BEGIN ISOLATION LEVEL READ COMMITTED", ()), *_timeouts(deadline), *guard]
        self._refused = refused  # the error the guard fails with
        self._writes: list[_Statement] = []

    def rows(self, sql: str, params: Sequence[object] = ()) -> list[tuple[Any, ...]]:
        return self._flush([(sql, params)])[0]

    def run(self, sql: str, params: Sequence[object] = ()) -> None:
        self.batch([(sql, params)])

    def many(self, sql: str, params: Iterable[Sequence[object]]) -> None:
        self.batch([(sql, values) for values in params])

    def batch(self, statements: Sequence[_Statement]) -> list[list[tuple[Any, ...]]]:
        if not any(map(_reads, statements)):  # only writes: they wait
            self._writes += statements
            return [[] for _ in statements]
        return self._flush(statements)

    def commit(self) -> None:
        """Past the deadline, `StoreBusy` (the caller rolls back: it was told 503)."""
        if self.fresh and not self._writes:  # nothing was sent: no transaction was begun
            return
        self._writes[:0] = _timeouts(self.deadline)
        self._flush([("COMMIT", ())])

    def _flush(self, statements: Sequence[_Statement]) -> list[list[tuple[Any, ...]]]:
        """The opening if it has not gone, the waiting writes, then these; the rows of these."""
        waiting = [*self._opening, *self._writes, *statements]
        self._opening, self._writes = [], []
        try:
            found = self._send(waiting)
        except self._refused:  # only the guard divides by zero
            raise _not_ours(
                "PostgreSQL database", "trigger, rule, policy or inheriting table"
            ) from None
        self.fresh = False
        return found[len(found) - len(statements) :]

    def _send(self, statements: Sequence[_Statement]) -> list[list[tuple[Any, ...]]]:
        with self.connection.pipeline():
            cursors = [
                self.connection.execute(sql.replace("?", "%s"), params)
                for sql, params in statements
            ]
        return [cursor.fetchall() if cursor.description else [] for cursor in cursors]


_TIMEOUTS: Final = (  # `SET LOCAL` both, in one statement of the pipeline instead of two
    "SELECT set_config('statement_timeout', ?, true), set_config('lock_timeout', ?, true)"
)


def _timeouts(deadline: float) -> list[_Statement]:
    """What is left of the deadline as the transaction's statement and lock timeouts (whole
    milliseconds, at least 1); past it, `StoreBusy`."""
    left = str(max(1, int(_deadline_left(deadline) * 1000)))
    return [(_TIMEOUTS, [left, left])]


def _reads(statement: _Statement) -> bool:
    """A statement whose rows `batch` is asked for: every read it is given begins so, a write
    never does (`rows` always sends at once)."""
    return statement[0].startswith("SELECT ")


class PostgresEngine:
    """A PostgreSQL database through a connection pool. READ COMMITTED transactions; every
    mutation locks its namespace's row (`FOR UPDATE`), which serializes the namespace's
    writers across all server processes; deadlocks are retried. Each transaction carries the
    request's deadline as its statement and lock timeouts, so a request that answers 503
    never commits afterwards."""

    bytes_sql = "octet_length(content)"
    lock_sql = " FOR UPDATE"

    def __init__(self, url: str, *, pool_size: int = 16) -> None:
        import psycopg
        import psycopg_pool

        self._psycopg = psycopg
        self._pool_timeout = psycopg_pool.PoolTimeout
        try:  # a URL psycopg cannot even parse (not UTF-8, a bad escape) is a ValueError
            psycopg.connect(url, connect_timeout=10).close()  # fail at once, not after retries
        except (psycopg.Error, ValueError):
            raise tactmem.StorageError("could not connect to PostgreSQL") from None
        self._pool = psycopg_pool.ConnectionPool(
            url, min_size=1, max_size=pool_size, kwargs={"autocommit": True}, open=False,
        )  # fmt: skip
        try:
            self._pool.open(wait=True, timeout=10)
        except (psycopg.Error, psycopg_pool.PoolTimeout):
            self._pool.close()
            raise tactmem.StorageError("could not connect to PostgreSQL") from None
        try:
            with self._transaction(time.monotonic() + STORE_TIMEOUT_S, guarded=False) as tx:
                self._create(tx)
        except BaseException:
            self._pool.close()
            raise

    @staticmethod
    def _create(tx: _Tx) -> None:
        """Check the database before any write (UTF8, and nothing tactmem-server did not
        create), then create what is missing: an empty database gets the two tables."""
        (encoding,) = tx.rows("SHOW server_encoding")[0]
        if encoding != "UTF8":
            raise tactmem.StorageError("the PostgreSQL database must use UTF8 encoding")
        tx.run("SELECT pg_advisory_xact_lock(7406158229)")  # one schema writer at a time
        found = set(tx.rows(_POSTGRES_CATALOG))
        _check_postgres(found)
        if found != _POSTGRES_OBJECTS:
            for statement in _SCHEMA:
                tx.run(statement.format(**_POSTGRES_TYPES))

    def transaction(self, deadline: float) -> contextlib.AbstractContextManager[_Tx]:
        return self._transaction(deadline, guarded=True)

    @contextlib.contextmanager
    def _transaction(self, deadline: float, *, guarded: bool) -> Iterator[_Tx]:
        """One transaction with the deadline as its statement and lock timeouts and, when
        `guarded`, `_POSTGRES_GUARD` before any of its statements, all sent with the first of
        them (`_PostgresTx`). A connection that breaks in that first round trip (a restart
        broke the pool's idle ones) has the pool replace them all, and the transaction runs
        again: nothing of it reached the database."""
        errors = self._psycopg.errors
        tx, connection = None, None
        try:
            with self._pool.connection(timeout=_deadline_left(deadline)) as connection:
                tx = _PostgresTx(connection, deadline, guarded, errors.DivisionByZero)
                try:
                    yield tx
                    tx.commit()
                except BaseException:
                    with contextlib.suppress(self._psycopg.Error):
                        connection.rollback()
                    raise
        except (errors.DeadlockDetected, errors.SerializationFailure):
            raise _Again() from None
        except (errors.QueryCanceled, errors.LockNotAvailable, self._pool_timeout):
            raise tactmem.StoreBusy() from None
        except self._psycopg.OperationalError:
            if tx is not None and tx.fresh and connection is not None and connection.broken:
                self._pool.drain()  # a restart broke them all: new ones, and no round trip
                raise _Again() from None
            raise tactmem.StoreBusy() from None
        except self._psycopg.Error:
            raise tactmem.StorageError("PostgreSQL operation failed") from None

    def check(self, deadline: float) -> None:
        with self._transaction(deadline, guarded=False) as tx:
            tx.rows("SELECT 1")

    def close(self) -> None:
        self._pool.close()


_NO_POSTINGS: Final = (numpy.zeros(0, numpy.intp), numpy.zeros(0))  # a term no document holds


class _ArrayCorpus(tactmem.core.Corpus):
    """The core's corpus, ranked over numpy arrays instead of Python lists: the same BM25 floats
    to the bit (each weight is the core's expression, and each document's score adds them from
    0.0 in term order, one `+` at a time) and the same order (ties by id), for about a quarter
    of the core's CPU on a team's corpus. Each visible document has a slot; every term's slots
    and counts are arrays, made with the first document holding it and edited where one
    changes (a scan never builds one: at 50 namespaces a common term's took milliseconds of
    Python), and its weights are worked out whole at its first use after any change (every
    weight moves with the average length)."""

    def __init__(self) -> None:
        super().__init__()
        self._slot_of: dict[int, int] = {}  # a visible document's id -> its slot
        self._ids_by_slot: list[int] = []
        self._free_slots: list[int] = []
        self._slot_lengths = numpy.zeros(0)  # by slot (a free slot's is left: no term holds it)
        self._arrays: dict[str, tuple[Any, Any]] = {}  # every held term -> its slots and counts
        self._weights_now: dict[str, Any] = {}  # term -> its weights, until the next change
        self._norms: Any = None  # each slot's k1 (1 - b + b length / average), once asked for

    def patch(
        self,
        rows: Sequence[tuple[int, int, object]],
        gone: Iterable[int] = (),
        known: Mapping[str, tuple[bool, dict[str, int]]] | None = None,
    ) -> dict[str, tuple[bool, dict[str, int]]]:
        gone = list(gone)
        ids = [row[0] for row in rows if self.rows.get(row[0]) != row] + gone
        self._unplace(ids)
        derived = super().patch(rows, gone, known)
        self._place(ids)
        if ids:
            self._weights_now, self._norms = {}, None
        return derived

    def _unplace(self, doc_ids: Iterable[int]) -> None:
        """Free these documents' slots, and take them out of their terms' arrays: each array
        is edited once, however many of these documents hold its term."""
        terms: set[str] = set()
        freed = len(self._free_slots)
        for doc_id in doc_ids:
            slot = self._slot_of.pop(doc_id, None)
            if slot is not None:
                terms.update(self.counts[doc_id])
                self._free_slots.append(slot)
        alive = numpy.ones(len(self._slot_lengths), bool)
        alive[self._free_slots[freed:]] = False
        for term in terms.intersection(self._arrays):
            slots, counts = self._arrays[term]
            kept = alive[slots]
            if kept.any():
                self._arrays[term] = slots[kept], counts[kept]
            else:
                del self._arrays[term]

    def _place(self, doc_ids: Iterable[int]) -> None:
        """Give these documents (those now visible) slots, and add them to their terms' arrays
        (once per array, as `_unplace`)."""
        added: dict[str, tuple[list[int], list[int]]] = {}
        for doc_id in doc_ids:
            counts = self.counts.get(doc_id)
            if counts is None:  # gone, or hidden
                continue
            if self._free_slots:
                slot = self._free_slots.pop()
                self._ids_by_slot[slot] = doc_id
            else:
                slot = len(self._ids_by_slot)
                self._ids_by_slot.append(doc_id)
                if slot == len(self._slot_lengths):
                    grown = numpy.zeros(slot + 64)
                    self._slot_lengths = numpy.concatenate([self._slot_lengths, grown])
            self._slot_of[doc_id] = slot
            self._slot_lengths[slot] = self.lengths[doc_id]
            for term, count in counts.items():
                slots, term_counts = added.setdefault(term, ([], []))
                slots.append(slot)
                term_counts.append(count)
        for term, (slots, term_counts) in added.items():
            held, held_counts = self._arrays.get(term, _NO_POSTINGS)
            self._arrays[term] = numpy.append(held, slots), numpy.append(held_counts, term_counts)

    def rank(self, terms: Sequence[str], limit: int) -> list[tuple[int, float]]:
        """`Corpus.rank`'s answer: BM25, best first, ties by id, documents sharing no term left
        out (every weight is positive, so a score of 0.0 shares none)."""
        if limit <= 0 or not self.counts or not terms:
            return []
        k1, b = tactmem.core.BM25
        if self._norms is None:
            average = self.total_length / len(self.counts)
            relative = self._slot_lengths / average if average else self._slot_lengths * 0.0
            self._norms = k1 * ((1 - b) + b * relative)
        scores = numpy.zeros(len(self._slot_lengths))
        for term in terms:
            slots, counts = self._arrays.get(term, _NO_POSTINGS)
            weights = self._weights_now.get(term)
            if weights is None:
                weights = self.idf(term) * counts * (k1 + 1) / (counts + self._norms[slots])
                if term in self._arrays:
                    self._weights_now[term] = weights
            scores[slots] += weights  # a term holds a slot once
        top = numpy.flatnonzero(scores)  # numpy partitions many equal zeros slowly: skip them
        if len(top) > limit:
            held = scores[top]
            top = top[held >= numpy.partition(held, len(held) - limit)[len(held) - limit]]
        ids = map(self._ids_by_slot.__getitem__, top.tolist())
        best = sorted(zip((-scores[top]).tolist(), ids, strict=True))[:limit]
        return [(doc_id, -negative) for negative, doc_id in best]


class TeamStore:
    """Every namespace of one team on one engine, the operations of protocol v1. Each runs as
    one transaction over the core's rules; token statistics of the combined corpus are kept per
    process and refreshed only for namespaces whose change counter moved."""

    def __init__(self, engine: _Engine) -> None:
        self.engine = engine
        self._corpus = _ArrayCorpus()
        self._corpus_lock = threading.Lock()
        self._seen: dict[str, int] = {}  # namespace -> change counter the cache holds
        self._counters: list[tuple[Any, ...]] = []  # the counters' rows as last read
        self._rows: dict[str, list[tuple[int, int, object]]] = {}
        # namespace -> id -> its row as last fetched, and the corpus row made of it (`_served`)
        self._verdicts: dict[str, dict[int, tuple[tuple[Any, ...], tuple[int, int, object]]]] = {}

    def close(self) -> None:
        self.engine.close()

    def _run(
        self,
        deadline: float,
        operation: Callable[[_Tx], Any],
        failed: Callable[[], None] = lambda: None,
    ) -> Any:
        """`operation` in one transaction, again after a deadlock; `failed` after each failure."""
        for attempt in itertools.count(1):
            try:
                with self.engine.transaction(deadline) as tx:
                    return operation(tx)
            except _Again:
                failed()
                if attempt == _RETRIES:
                    raise tactmem.StoreBusy() from None
            except BaseException:
                failed()
                raise
        raise AssertionError("unreachable")

    # -------------------------------------------------------------------- locks and prune

    def _lock(
        self, tx: _Tx, namespaces: Iterable[str], then: Sequence[_Statement] = ()
    ) -> tuple[dict[str, int], list[list[tuple[Any, ...]]]]:
        """Lock these namespaces' rows in byte order (so two transactions cannot deadlock on
        them); their `next_id`s, and the rows of `then`, run in the same round trip once the
        locks are held."""
        names = sorted(set(namespaces))
        if not names:
            return {}, tx.batch(then)
        lock = (
            "SELECT namespace, next_id FROM memory_namespaces"
            f" WHERE namespace IN ({_marks(len(names))}) ORDER BY namespace{self.engine.lock_sql}",
            names,
        )
        locked, *after = tx.batch([lock, *then])
        return dict(locked), after

    def _prune(
        self, tx: _Tx, now_ms: int, own: str | None = None, then: Sequence[_Statement] = ()
    ) -> tuple[dict[str, int], list[list[tuple[Any, ...]]]]:
        """Drop what `_expired` names, in every namespace (locking those it touches, and `own`,
        which is created if new); the locked namespaces' `next_id`s, and the rows of `then`,
        statements run once the prune is done (with the locks, when nothing comes between;
        with the search itself, when nothing is to be locked and nothing is due)."""
        due = (  # `memories_probation` holds only rows on probation: a warm scan reads none
            "SELECT namespace, id, use_count, probation_until_ms FROM memories"
            " WHERE probation_until_ms <= ? AND use_count = 0"
        )
        early: list[list[tuple[Any, ...]]] | None = None  # `then`'s rows, read with the search
        if own is None:
            candidates, *early = tx.batch([(due, [now_ms]), *then])
        else:
            candidates = tx.rows(due, [now_ms])
        found = {
            ns for ns, _, uses, until in candidates if tactmem.core.expired(uses, until, now_ms)
        }
        if early is not None and not found:
            return {}, early
        locked, after = self._lock(tx, found | ({own} if own else set()), () if found else then)
        if own is not None and own not in locked:  # its first write creates the namespace
            tx.run(
                "INSERT INTO memory_namespaces (namespace) VALUES (?) ON CONFLICT DO NOTHING", [own]
            )
            more, after = self._lock(tx, [own], () if found else then)
            locked.update(more)
        if (
            found
        ):  # read again under the locks, each row locked: a read may have ended its probation
            rows = tx.rows(
                f"{due} AND namespace IN ({_marks(len(found))}){self.engine.lock_sql}",
                [now_ms, *found],
            )
            expired = [
                (ns, i) for ns, i, uses, until in rows if tactmem.core.expired(uses, until, now_ms)
            ]
            tx.many("DELETE FROM memories WHERE namespace = ? AND id = ?", expired)
            self._changed(tx, {ns for ns, _ in expired})
            after = tx.batch(then)
        return locked, after

    @staticmethod
    def _changed(tx: _Tx, namespaces: Iterable[str]) -> None:
        """Move the change counters of these namespaces, locked already (`_BUMP`)."""
        names = sorted(set(namespaces))
        tx.batch([_changes(names)] if names else [])

    # -------------------------------------------------------------------- operations

    def scan(
        self, terms: Sequence[str], limit: int, now_ms: int, deadline: float
    ) -> list[dict[str, Any]]:
        def operation(tx: _Tx) -> list[dict[str, Any]]:
            _, [counters] = self._prune(tx, now_ms, then=[_COUNTERS])
            with self._corpus_lock:
                self._refresh(tx, counters)
                plan = tactmem.core.plan_scan(self._corpus, terms, limit, LIMITS)
            cards = [(_doc_key(card.key.id), card) for card in plan.result.candidates]
            keys = [(ns, doc_id, card.key.version) for (ns, doc_id), card in cards]
            if keys:  # every card's row in one statement, each found by its primary key
                each = " OR ".join(["(namespace = ? AND id = ? AND version = ?)"] * len(keys))
                tx.run(
                    "UPDATE memories SET last_scanned_at_ms = ?,"
                    f" scan_count = {_CAPPED.format('scan_count')} WHERE {each}",
                    [now_ms, *itertools.chain.from_iterable(keys)],
                )
            return [
                {
                    "key": wire_key(ns, Key(doc_id, card.key.version)),
                    "preview": card.preview,
                    "score": card.score,
                }
                for (ns, doc_id), card in cards
            ]

        result: list[dict[str, Any]] = self._run(deadline, operation, self._forget)
        return result

    def warm(self, deadline: float) -> None:
        """Build the combined corpus now (at start, before the port answers), so that the
        first scan does not tokenize every namespace."""

        def operation(tx: _Tx) -> None:
            with self._corpus_lock:
                self._refresh(tx)

        self._run(deadline, operation, self._forget)

    def _forget(self) -> None:
        """After a failed scan: its prune may be in the cache, but was never committed."""
        with self._corpus_lock:
            self._seen.clear()
            self._counters = []

    def _refresh(self, tx: _Tx, found: list[tuple[Any, ...]] | None = None) -> None:
        """Bring the combined corpus up to date: a warm scan reads the change counters (or is
        given them, `_COUNTERS` read in this transaction) and compares them whole; only
        namespaces whose counter moved are fetched, and only their rows are changed."""
        if found is None:
            found = tx.rows(*_COUNTERS)
        if found == self._counters:
            return
        counters = {  # a namespace no credential can name holds a foreign writer's rows only
            ns: changes for ns, changes in found if _valid_namespace(ns)
        }
        fresh: list[tuple[int, int, object]] = []
        gone: list[int] = []
        for ns in [ns for ns, changes in counters.items() if self._seen.get(ns) != changes]:
            rows = tx.rows(f"SELECT {_COLUMNS} FROM memories WHERE namespace = ?", [ns])
            before = self._rows.get(ns, [])
            self._rows[ns] = self._corpus_rows(ns, rows)
            fresh += self._rows[ns]
            gone += {row[0] for row in before} - {row[0] for row in self._rows[ns]}
        for ns in self._rows.keys() - counters.keys():
            gone += [row[0] for row in self._rows.pop(ns)]
            del self._verdicts[ns]
        self._corpus.patch(fresh, gone)
        self._seen, self._counters = counters, found

    def _corpus_rows(
        self, ns: str, rows: Sequence[tuple[Any, ...]]
    ) -> list[tuple[int, int, object]]:
        """A namespace's rows (`_COLUMNS`) as the corpus takes them: the text only of a row
        `_served` admits (what a scan offers, a read returns). `_served` runs a text's secret
        rules, so it is asked again only of a row that changed, in any column, since the
        namespace was last fetched; the others are not even made `Record`s again."""
        before, verdicts = self._verdicts.get(ns, {}), {}
        for row in rows:
            kept = before.get(row[1])
            if kept is None or kept[0] != row:
                record = _namespaced(row)[1]
                text = record.content if _served(ns, record) else None
                kept = row, (_doc_id(ns, record.key.id), record.key.version, text)
            verdicts[row[1]] = kept
        self._verdicts[ns] = verdicts
        return [corpus_row for _, corpus_row in verdicts.values()]

    def read(self, wanted: Sequence[WireKey], now_ms: int, deadline: float) -> list[dict[str, Any]]:
        by_namespace: dict[str, dict[int, int]] = {}  # namespace -> id -> version (0: any)
        for key in wanted:
            by_namespace.setdefault(str(key.namespace), {})[key.id] = key.version
        selects = [
            (
                f"SELECT {_COLUMNS} FROM memories WHERE namespace = ?"
                f" AND id IN ({_marks(len(versions))}) ORDER BY id{self.engine.lock_sql}",
                [ns, *versions],
            )
            for ns, versions in by_namespace.items()
        ]

        def operation(tx: _Tx) -> list[dict[str, Any]]:
            self._prune(tx, now_ms)  # first: a read locks its rows only after the prune's locks
            fetched = tx.batch(selects)
            found: dict[tuple[str | None, int], Record] = {}
            for (ns, versions), rows in zip(by_namespace.items(), fetched, strict=True):
                current = [
                    r
                    for _, r in map(_namespaced, rows)
                    if versions[r.key.id] in (0, r.key.version) and _served(ns, r)
                ]
                for record in tactmem.core.plan_read(list(versions), current, now_ms):
                    found[ns, record.key.id] = record
            records = [
                (str(key.namespace), found[str(key.namespace), key.id])
                for key in wanted
                if (str(key.namespace), key.id) in found
            ]
            tx.many(
                "UPDATE memories SET last_used_at_ms = ?, use_count = ?, probation_until_ms = ?"
                " WHERE namespace = ? AND id = ?",
                [
                    (r.last_used_at_ms, r.use_count, r.probation_until_ms, ns, r.key.id)
                    for ns, r in records
                ],
            )
            return [wire_record(ns, record) for ns, record in records]

        result: list[dict[str, Any]] = self._run(deadline, operation)
        return result

    def list(self, now_ms: int, deadline: float) -> list[dict[str, Any]]:
        def operation(tx: _Tx) -> list[dict[str, Any]]:
            every = f"SELECT {_COLUMNS} FROM memories ORDER BY namespace, id LIMIT {LIMITS.records}"
            _, [rows] = self._prune(tx, now_ms, then=[(every, ())])
            return [wire_record(ns, r) for ns, r in map(_namespaced, rows) if _served(ns, r)]

        result: list[dict[str, Any]] = self._run(deadline, operation)
        return result

    def put(self, namespace: str, put: tactmem.core.Put, deadline: float) -> dict[str, Any]:
        def operation(tx: _Tx) -> dict[str, Any]:
            target = 0 if put.replace is None else put.replace.id  # no row has id 0
            measure = self.engine.bytes_sql
            facts = (  # one pass over the namespace's rows: all a plan needs
                f"SELECT COUNT(*), COALESCE(SUM({measure}), 0), COALESCE(MAX(id), 0),"
                " MAX(CASE WHEN identity = ? THEN id END), MAX(CASE WHEN id = ? THEN version END),"
                f" COALESCE(MAX(CASE WHEN id = ? THEN {measure} END), 0),"
                " COALESCE(MAX(CASE WHEN id = ? THEN created_at_ms END), 0)"
                " FROM memories WHERE namespace = ?",
                [put.identity, target, target, target, namespace],
            )
            locked, [[found]] = self._prune(tx, put.now_ms, namespace, [facts])
            rows, size, top, same, old_version, old_bytes, old_created = found
            state = tactmem.core.PutState(
                rows=int(rows), content_bytes=int(size),
                next_id=max(locked[namespace], int(top) + 1), duplicate_of=same,
                target_version=old_version, target_bytes=int(old_bytes),
                target_created_at_ms=int(old_created),
            )  # fmt: skip
            plan = plan_put(put, state)
            new = plan.record
            values = attrs.astuple(new, recurse=False)[2:]  # times, then telemetry
            if plan.insert:
                row = [namespace, new.key.id, new.key.version, new.content, put.identity, *values]
                next_id = "UPDATE memory_namespaces SET next_id = ? WHERE namespace = ?"
                writes = [(_INSERT, row), (next_id, [new.key.id + 1, namespace])]
            else:
                fields = [new.key.version, new.content, put.identity, *values]
                writes = [(_UPDATE, [*fields, namespace, new.key.id])]
            tx.batch([*writes, _changes([namespace])])
            return wire_record(namespace, new)

        result: dict[str, Any] = self._run(deadline, operation)
        return result

    def delete(self, namespace: str, key: Key, deadline: float) -> None:
        """Remove the row at `key` if its version still matches; an absent row is no error
        (the protocol's rule, where the local store says `not_found`). Never prunes."""

        def operation(tx: _Tx) -> None:
            tx.run(
                "INSERT INTO memory_namespaces (namespace) VALUES (?) ON CONFLICT DO NOTHING",
                [namespace],
            )
            self._lock(tx, [namespace])
            rows = tx.rows(
                "SELECT version FROM memories WHERE namespace = ? AND id = ?", [namespace, key.id]
            )
            if rows:
                tactmem.core.check_version(key, rows[0][0])
                tx.run("DELETE FROM memories WHERE namespace = ? AND id = ?", [namespace, key.id])
                self._changed(tx, [namespace])

        self._run(deadline, operation)

    def sync(
        self, namespace: str, snapshot: Sequence[tuple[Record, str]], now_ms: int,
        deadline: float, if_changes: int | None = None,
    ) -> dict[str, int]:  # fmt: skip
        """The snapshot becomes the namespace; with `if_changes`, only if the namespace's
        change counter is still that (else `Conflict`, nothing changed), and keeping the reads
        that landed since (`keep_reads`)."""

        def operation(tx: _Tx) -> dict[str, int]:
            if if_changes is not None and self._facts(tx, namespace, lock=True)[0] != if_changes:
                raise tactmem.Conflict()
            next_id = self._prune(tx, now_ms, namespace)[0][namespace]
            rows = tx.rows(f"SELECT {_COLUMNS} FROM memories WHERE namespace = ?", [namespace])
            previous = {r.key.id: r for _, r in map(_namespaced, rows)}
            sent = snapshot if if_changes is None else keep_reads(previous, snapshot)
            report = plan_sync(previous, [record for record, _ in sent])
            tx.run("DELETE FROM memories WHERE namespace = ?", [namespace])
            tx.many(
                _INSERT,
                [
                    (
                        namespace,
                        r.key.id,
                        r.key.version,
                        r.content,
                        identity,
                        *attrs.astuple(r, recurse=False)[2:],
                    )
                    for r, identity in sent
                ],
            )
            top = max((record.key.id for record, _ in sent), default=0)
            tx.run(
                "UPDATE memory_namespaces SET next_id = ? WHERE namespace = ?",
                [max(next_id, top + 1), namespace],
            )
            self._changed(tx, [namespace])
            return report

        result: dict[str, int] = self._run(deadline, operation)
        return result

    def export(
        self,
        namespaces: Sequence[str] | None,
        cursor: tuple[str, int] | None,
        limit: int,
        now_ms: int,
        deadline: float,
        own: str,
    ) -> tuple[dict[str, Any], tuple[int, int, int]]:
        """One page in `(namespace, id)` order, numeric ids, strictly after the cursor, of the
        rows `_served` admits; the next cursor only when a record follows (rows are fetched
        until one more than the page is found, or none is left). And `_facts` of `own`, the
        caller's namespace, as the page was read: read before and after it, and the page read
        again if they differ (on PostgreSQL a write that commits between two statements of one
        transaction is in the second only; a push would plan against the page and pass the
        guard with the newer counter, undoing that write)."""

        def rows_after(tx: _Tx, after: tuple[str, int] | None, count: int) -> list[Any]:
            where: list[str] = ["1 = 1"]
            params: list[object] = []
            if namespaces is not None:
                where.append(f"namespace IN ({_marks(len(namespaces))})")
                params += namespaces
            if after is not None:
                where.append("(namespace > ? OR (namespace = ? AND id > ?))")
                params += [after[0], after[0], after[1]]
            return tx.rows(
                f"SELECT {_COLUMNS} FROM memories WHERE {' AND '.join(where)}"
                f" ORDER BY namespace, id LIMIT {count}",
                params,
            )

        def operation(tx: _Tx) -> tuple[dict[str, Any], tuple[int, int, int]]:
            self._prune(tx, now_ms)
            facts = self._facts(tx, own)
            page: list[tuple[str, Record]] = []
            after, wanted = cursor, limit + 1
            while wanted:
                rows = rows_after(tx, after, wanted)
                page += [(ns, r) for ns, r in map(_namespaced, rows) if _served(ns, r)]
                wanted = 0 if len(rows) < wanted else limit + 1 - len(page)
                after = (rows[-1][0], rows[-1][1]) if rows else after
            memories = [wire_record(ns, r) for ns, r in page[:limit]]
            last = memories[-1]["key"] if len(page) > limit else None
            next_cursor = (
                None if last is None else {"namespace": last["namespace"], "id": last["id"]}
            )
            if self._facts(tx, own) != facts:
                raise _Again()
            return {"memories": memories, "next_cursor": next_cursor}, facts

        result: tuple[dict[str, Any], tuple[int, int, int]] = self._run(deadline, operation)
        return result

    def _facts(self, tx: _Tx, namespace: str, *, lock: bool = False) -> tuple[int, int, int]:
        """A namespace's change counter, next id and row count (hidden rows too); a namespace
        never written is `(0, 1, 0)`. `lock`: its row is made if missing and locked first, so
        no write of the namespace commits in between (on PostgreSQL)."""
        if lock:
            tx.run(
                "INSERT INTO memory_namespaces (namespace) VALUES (?) ON CONFLICT DO NOTHING",
                [namespace],
            )
        lock_sql = self.engine.lock_sql if lock else ""
        found = tx.rows(
            f"SELECT changes, next_id FROM memory_namespaces WHERE namespace = ?{lock_sql}",
            [namespace],
        )
        ((rows,),) = tx.rows("SELECT COUNT(*) FROM memories WHERE namespace = ?", [namespace])
        changes, next_id = found[0] if found else (0, 1)
        return changes, next_id, rows


# ============================================================================ one principal (I/O)


class NamespaceStore:
    """One principal's view of the team store as a tactmem `Backend`, for the memory tool at
    `/mcp`: what `tactmem.RemoteStore` means, with the `/v1` routes' own checks and `TeamStore`
    operations in place of HTTP. Scans rank every namespace (cards carry `RemoteKey`s); `read`
    takes ids of the principal's namespace and `read_keys` exact keys of any; put and delete
    change the principal's namespace only, and only for a writer. Each operation is one store
    transaction whose deadline is the store timeout."""

    def __init__(
        self, store: TeamStore, principal: Principal, *, timeout_s: float = STORE_TIMEOUT_S
    ) -> None:
        self.store = store
        self.principal = principal
        self.timeout_s = timeout_s
        self.limits = LIMITS

    def __repr__(self) -> str:
        return f"NamespaceStore({self.principal.namespace!r}, {self.principal.role!r})"

    def _deadline(self) -> float:
        return time.monotonic() + self.timeout_s

    def _writer(self) -> str:
        """The namespace a change may touch: a reader's is none (403 `forbidden` on `/v1`)."""
        if self.principal.role != "writer":
            raise tactmem.RemoteDenied("remote memory credential is read-only")
        return self.principal.namespace

    def scan(
        self, query: str, *, limit: int = LIMITS.scan_results, min_coverage: float = 0.0,
        now_ms: int | None = None,
    ) -> tactmem.ScanResult:  # fmt: skip
        room = tactmem.core.team_scan(query, limit, min_coverage, LIMITS)
        if isinstance(room, tactmem.ScanResult):
            return room
        terms, room = check_scan({"query": query, "limit": room})
        cards = self.store.scan(terms, room, tactmem.core.now_ms(now_ms), self._deadline())
        found = tactmem.core.remote_cards({"candidates": cards}, room)
        return tactmem.ScanResult(not found, found, None if found else "no_overlap")

    def read(self, ids: Iterable[int], *, now_ms: int | None = None) -> tuple[Record, ...]:
        return self._read("ids", tactmem.core.read_ids(ids, LIMITS), now_ms)

    def read_keys(self, keys: Iterable[tactmem.RemoteKey]) -> tuple[Record, ...]:
        named = tactmem.core.team_keys(keys, LIMITS)
        return self._read("keys", [WireKey(k.namespace, k.id, k.version) for k in named], None)

    def _read(self, field: str, names: Sequence[object], now_ms: int | None) -> tuple[Record, ...]:
        """Records by `ids` or by `keys`, in request order, as many reads as the protocol's
        512 names a request take (an id list may name 1,024)."""
        records: list[Record] = []
        for start in range(0, len(names), LIMITS.records):
            chunk = names[start : start + LIMITS.records]
            wanted = check_read({"ids": [], "keys": [], field: chunk}, self.principal.namespace)
            memories = self.store.read(wanted, tactmem.core.now_ms(now_ms), self._deadline())
            records += tactmem.core.remote_records({"memories": memories}, len(wanted))
        return tuple(records)

    def put(self, content: str, *, replace: Key | None = None, now_ms: int | None = None) -> Record:
        namespace = self._writer()
        wire = None if replace is None else self._wire(replace)
        put = check_put(
            {"content": content, "replacement": wire}, namespace, tactmem.core.now_ms(now_ms)
        )
        memory = self.store.put(namespace, put, self._deadline())
        return tactmem.core.remote_put({"memory": memory}, put, namespace)

    def delete(self, key: Key, *, now_ms: int | None = None) -> None:
        del now_ms  # a delete never prunes
        namespace = self._writer()
        self.store.delete(
            namespace, check_delete({"key": self._wire(key)}, namespace), self._deadline()
        )

    def list(self, *, now_ms: int | None = None) -> tuple[Record, ...]:
        memories = self.store.list(tactmem.core.now_ms(now_ms), self._deadline())
        return tuple(tactmem.core.remote_records({"memories": memories}, LIMITS.records))

    def _wire(self, key: Key) -> WireKey:
        """A key as a change names it: a `RemoteKey` keeps its namespace, a plain key is the
        principal's own."""
        return WireKey(getattr(key, "namespace", self.principal.namespace), key.id, key.version)


# ============================================================================ credentials (I/O)


def _without_waiting(path: str, flags: int) -> int:
    """`open` that never waits: a FIFO with no writer would block start-up for ever."""
    return os.open(path, flags | os.O_NONBLOCK | os.O_NOCTTY)


def _credentials_document(path: str) -> dict[str, Any]:
    """The credentials file parsed: a private regular file (checked before a byte is read, so
    a FIFO or a device is never read) of at most 1 MiB of UTF-8 TOML. The nesting of TOML
    arrays and tables has no limit of its own, so a deep one is refused when the parser's
    recursion runs out."""
    try:
        with open(path, "rb", opener=_without_waiting) as file:
            mode = os.fstat(file.fileno()).st_mode
            if not stat.S_ISREG(mode) or mode & 0o077:
                raise CredentialsError(
                    "the credentials file must be a regular file of mode 0600 or 0400"
                )
            data = file.read(_CREDENTIALS_FILE_BYTES + 1)
    except OSError:
        raise CredentialsError("could not read the credentials file") from None
    if len(data) > _CREDENTIALS_FILE_BYTES:
        raise CredentialsError("the credentials file is larger than 1 MiB")
    try:
        return tomllib.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError):
        raise CredentialsError("the credentials file is not valid TOML") from None


def load_credentials(path: str) -> dict[bytes, Principal]:
    """Read `[[credentials]]` tables of `namespace`, `role` and `token` (the original's shape).
    Only SHA-256 hashes of the tokens are kept. The file must be private (no group or other
    access); several tokens may name one namespace (rotation); a repeated token is refused."""
    document = _credentials_document(path)
    entries = document.get("credentials")
    if set(document) != {"credentials"} or not isinstance(entries, list) or not entries:
        raise CredentialsError("the credentials file needs [[credentials]] tables and nothing else")
    principals: dict[bytes, Principal] = {}
    for number, entry in enumerate(entries, 1):
        if not isinstance(entry, dict) or set(entry) != {"namespace", "role", "token"}:
            raise CredentialsError(f"credential {number} needs exactly namespace, role and token")
        token = entry["token"]
        if not _valid_namespace(entry["namespace"]):
            raise CredentialsError(f"credential {number} has an invalid namespace")
        if entry["role"] not in _ROLES:
            raise CredentialsError(f"credential {number} has a role other than reader or writer")
        if not isinstance(token, str) or _TOKEN.fullmatch(token) is None:
            raise CredentialsError(f"credential {number} has an invalid bearer token")
        digest = _token_hash(token)
        if digest in principals:
            raise CredentialsError(f"credential {number} repeats the bearer token of another")
        principals[digest] = Principal(entry["namespace"], entry["role"])
    return principals


# ============================================================================ HTTP (I/O)


class _Operation(NamedTuple):
    """One route: who may call it, whether it reads a JSON body, and what it does (run in a
    worker thread with the request's deadline)."""

    method: str
    writer: bool
    body: str | None  # the request shape in `_REQUESTS`
    run: Callable[[_Call, Any], _Reply]


class _Reply(NamedTuple):
    """A route's answer, the counts its log line carries, and headers of tactmem's own."""

    answer: Any
    counts: dict[str, int]
    headers: Mapping[str, str] = {}


def _now() -> int:
    return tactmem.core.now_ms()


class _Call(NamedTuple):
    """One request as a route's work sees it (in a worker thread, with the request's
    deadline)."""

    store: TeamStore
    principal: Principal
    deadline: float
    headers: Mapping[bytes, bytes]


def _scan(call: _Call, payload: Any) -> _Reply:
    terms, limit = check_scan(payload)
    cards = call.store.scan(terms, limit, _now(), call.deadline)
    return _Reply({"candidates": cards}, {"candidate_count": len(cards)})


def _read(call: _Call, payload: Any) -> _Reply:
    wanted = check_read(payload, call.principal.namespace)
    memories = call.store.read(wanted, _now(), call.deadline)
    return _Reply({"memories": memories}, {"record_count": len(memories)})


def _list(call: _Call, _payload: Any) -> _Reply:
    memories = call.store.list(_now(), call.deadline)
    return _Reply({"memories": memories}, {"record_count": len(memories)})


def _put(call: _Call, payload: Any) -> _Reply:
    namespace = call.principal.namespace
    memory = call.store.put(namespace, check_put(payload, namespace, _now()), call.deadline)
    return _Reply({"memory": memory}, {"record_count": 1})


def _delete(call: _Call, payload: Any) -> _Reply:
    namespace = call.principal.namespace
    call.store.delete(namespace, check_delete(payload, namespace), call.deadline)
    return _Reply({}, {"record_count": 1})


def _sync(call: _Call, payload: Any) -> _Reply:
    now, guard = _now(), check_guard(call.headers.get(IF_CHANGES.encode()))
    snapshot = check_sync(payload, now)
    report = call.store.sync(call.principal.namespace, snapshot, now, call.deadline, guard)
    return _Reply(report, {f"report_{name}": count for name, count in report.items()})


def _export(call: _Call, payload: Any) -> _Reply:
    own = call.principal.namespace
    page, facts = call.store.export(*check_export(payload), _now(), call.deadline, own)
    headers = dict(zip(FACT_HEADERS, map(str, facts), strict=True))
    return _Reply(page, {"record_count": len(page["memories"])}, headers)


def _session(call: _Call, _payload: Any) -> _Reply:
    principal = call.principal
    answer = {"protocol_version": PROTOCOL_VERSION, **principal._asdict()}
    return _Reply(answer, {})


_ROUTES: Final[Mapping[str, _Operation]] = {
    "/v1/session": _Operation("GET", False, None, _session),
    "/v1/memories/scan": _Operation("POST", False, "scan", _scan),
    "/v1/memories/read": _Operation("POST", False, "read", _read),
    "/v1/memories/list": _Operation("POST", False, None, _list),  # the body is never read
    "/v1/memories/put": _Operation("POST", True, "put", _put),
    "/v1/memories/delete": _Operation("POST", True, "delete", _delete),
    "/v1/memories/sync": _Operation("POST", True, "sync", _sync),
    "/v1/memories/export": _Operation("POST", False, "export", _export),
}


def _error_response(error: ApiError) -> Response:
    return Response(_body({"code": error.code}), error.status, media_type="application/json")


def _json_content_type(value: bytes) -> bool:
    """`application/json` or `application/<anything>+json`, with any parameters (as axum)."""
    kind = value.split(b";", 1)[0].strip().lower()
    main, _, sub = kind.partition(b"/")
    return main == b"application" and (sub == b"json" or sub.endswith(b"+json"))


async def _read_body(request: Request) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ApiError(413, "bad_request")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise ApiError(413, "bad_request")
        chunks.append(chunk)
    return b"".join(chunks)


def _headers(scope: Scope) -> dict[bytes, bytes]:
    """A request's headers by lower-case name, the first of a repeated one (as axum)."""
    headers: dict[bytes, bytes] = {}
    for header, value in scope["headers"]:
        headers.setdefault(header, value)
    return headers


def _log_event(**fields: object) -> None:
    _log.info(json.dumps(fields, separators=(",", ":")))


class _ForeignRecords(logging.Handler):
    """uvicorn's, asyncio's and psycopg's own warnings and errors (psycopg's pipeline warns when
    a failed statement ends it early) as JSON lines like every other: the logger, the level,
    the first line of the message's template (never its arguments, which may hold what a peer
    sent) and the class of an exception."""

    def emit(self, record: logging.LogRecord) -> None:
        error = record.exc_info[1] if record.exc_info else None
        _log_event(
            event="server_log", logger=record.name, level=record.levelname,
            message=str(record.msg).split("\n", 1)[0][:200],
            error_type=None if error is None else type(error).__name__,
        )  # fmt: skip


class _Server:
    """The routes over one store and one set of principals."""

    def __init__(self, store: TeamStore, principals: _Principals, timeout_s: float) -> None:
        self.store = store
        self.principals = principals
        self.timeout_s = timeout_s
        self.places = anyio.CapacityLimiter(MAX_IN_FLIGHT)  # /v1 operations, /mcp tool calls
        self.threads = anyio.CapacityLimiter(MAX_IN_FLIGHT)  # the worker threads of /v1's

    async def handle(self, request: Request) -> Response:
        operation = _ROUTES[request.url.path]
        name = request.url.path.rsplit("/", 1)[1]
        started = time.monotonic()
        headers = _headers(request.scope)
        principal = None
        try:
            principal = authenticate(self.principals, headers)
            if operation.writer and principal.role != "writer":
                raise _forbidden()
            body = None
            if operation.body is not None:
                if not _json_content_type(headers.get(b"content-type", b"")):
                    raise _bad_request()
                body = await _read_body(request)
            reply = await self._run(operation, principal, body, headers)
            data = _body(reply.answer)
        except ApiError as error:
            self._trace(name, principal, started, error.status, error.code, error.log)
            return _error_response(error)
        except ClientDisconnect:  # the body was cut short; nobody reads the answer
            self._trace(name, principal, started, 400, "bad_request", {})
            return _error_response(_bad_request())
        except Exception as error:  # a bug: the answer is `internal`, the log says what failed
            failure = _internal(error)
            self._trace(name, principal, started, 500, failure.code, failure.log)
            return _error_response(failure)
        self._trace(name, principal, started, 200, None, reply.counts)
        return Response(data, headers=reply.headers, media_type="application/json")

    async def _run(
        self, operation: _Operation, principal: Principal, body: bytes | None,
        headers: Mapping[bytes, bytes],
    ) -> _Reply:  # fmt: skip
        """The operation in a worker thread, once it has one of the 64 places (its body is
        read by then: a slow peer holds none); further ones wait their turn. The store timeout
        starts with the place."""

        def work(deadline: float) -> _Reply:
            payload = None
            if operation.body is not None and body is not None:
                payload = _fields(decode_json(body), _REQUESTS[operation.body], closed=True)
            try:
                return operation.run(_Call(self.store, principal, deadline, headers), payload)
            except TactmemError as error:
                raise _api_error(error) from None

        async with self.places:
            deadline = time.monotonic() + self.timeout_s
            with anyio.move_on_after(self.timeout_s + _GRACE_S):
                return await anyio.to_thread.run_sync(
                    work, deadline, limiter=self.threads, abandon_on_cancel=True
                )
        raise ApiError(503, "unavailable")

    @staticmethod
    def _trace(
        name: str, principal: Principal | None, started: float, status: int, code: str | None,
        counts: Mapping[str, int | str],
    ) -> None:  # fmt: skip
        """One structured line per request: never a token, a query or any content (a 500's
        `error_type` and `error_cause` are class names only)."""
        _log_event(
            event="operation", operation=name,
            namespace=None if principal is None else principal.namespace,
            role=None if principal is None else principal.role,
            success=code is None, status=status, error_code=code,
            elapsed_ms=round((time.monotonic() - started) * 1000, 3), **counts,
        )  # fmt: skip

    async def health(self, _request: Request) -> Response:
        """Whether the store answers, and the operations holding one of the 64 places and
        waiting for one (no authentication, no content; it takes no place itself, so it
        answers while they are all taken)."""
        counts = {"in_flight": self.places.borrowed_tokens}
        counts["waiting"] = self.places.statistics().tasks_waiting
        deadline = time.monotonic() + min(self.timeout_s, 1.0)
        try:
            await anyio.to_thread.run_sync(
                self.store.engine.check, deadline, abandon_on_cancel=True
            )
        except TactmemError:
            return Response(
                _body({"status": "unavailable", **counts}), 503, media_type="application/json"
            )
        return Response(_body({"status": "ok", **counts}), media_type="application/json")


async def _empty_error(_request: Request, error: Exception) -> Response:
    """Unknown routes (404) and wrong methods (405) answer with an empty body, as axum does."""
    assert isinstance(error, HTTPException)
    return Response(b"", error.status_code, headers=error.headers)


_MCP_CALLER: Final = "tactmem.caller"  # the ASGI scope's (token hash, principal) at /mcp
_TOOL_OPERATIONS: Final = ("scan", "read", "put", "delete")


class _McpEndpoint:
    """`/mcp`: the memory tool over MCP's streamable HTTP transport, served by the official
    SDK's session manager with stateful sessions (the tool's scan-before-put gate lives in one)
    and JSON answers; there is no server-initiated stream (GET is 405). Every request needs a
    known bearer token, 401 before any MCP work; a session belongs to the token that opened it
    (the SDK answers another token as it answers an unknown session: 404). A writer gets the
    root tool, a reader the child's (scan and read)."""

    def __init__(
        self, store: TeamStore, principals: _Principals, timeout_s: float,
        limiter: anyio.CapacityLimiter,
    ) -> None:  # fmt: skip
        self.store = store
        self.principals = principals
        self.timeout_s = timeout_s
        self.limiter = limiter
        self.definitions = {
            role: tactmem.tool_definition(
                flat=True, root=role == "writer", team=True, limits=LIMITS
            )
            for role in _ROLES
        }
        # Each session's tool and when it was last used, by (session id, token hash).
        self.tools: dict[tuple[str, bytes], tuple[tactmem.MemoryTool, float]] = {}
        self.book = _SessionBook()
        self.manager: Any = None
        self.ready: anyio.Event | None = None

    async def run(self) -> None:
        """Run the SDK's session manager until cancelled. The SDK takes seconds to import:
        `main` imports it before the port answers (`_load_first_use_modules`); for an app built
        alone, a worker thread loads it while the `/v1` routes already answer, and `/mcp`
        requests wait."""
        self.ready = anyio.Event()

        def manager() -> Any:
            from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

            return StreamableHTTPSessionManager(
                tactmem.core.mcp_server(self._surface, limiter=self.limiter), json_response=True,
                session_idle_timeout=MCP_SESSION_IDLE_S, max_request_body_size=MAX_BODY_BYTES,
                max_sessions=2 * MCP_MAX_SESSIONS,  # a backstop: `self.book` makes room first
            )  # fmt: skip

        self.manager = await anyio.to_thread.run_sync(manager)
        async with self.manager.run():
            self.ready.set()
            await anyio.sleep_forever()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started, status, caller, opened = time.monotonic(), 500, None, ""

        async def watched(message: Message) -> None:
            nonlocal status, opened
            if message["type"] == "http.response.start":
                status = message["status"]
                opened = dict(message["headers"]).get(b"mcp-session-id", b"").decode("latin-1")
            await send(message)

        headers = _headers(scope)
        asked = headers.get(b"mcp-session-id", b"").decode("latin-1")
        try:
            caller = bearer(self.principals, headers)
            assert self.ready is not None  # the application's lifespan runs `run`
            await self.ready.wait()
            from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS

            version = headers.get(b"mcp-protocol-version", b"").decode("latin-1")
            if version and version not in HANDSHAKE_PROTOCOL_VERSIONS:
                await _unsupported_version(version)(scope, receive, watched)
                return
            if not asked:  # a request that may open a session: first make room for it
                await self._make_room(caller[0])
            user = _mcp_user(*caller)
            await self.manager.handle_request(
                {**scope, "user": user, _MCP_CALLER: caller}, receive, watched
            )
            self._keep_book(asked, opened, caller[0], scope["method"], status)
        except ApiError as error:
            response = _error_response(error)
            response.headers["www-authenticate"] = "Bearer"
            await response(scope, receive, watched)
        finally:
            principal = None if caller is None else caller[1]
            _log_event(
                event="mcp", method=scope["method"],
                namespace=None if principal is None else principal.namespace,
                role=None if principal is None else principal.role,
                success=status < 400, status=status,
                elapsed_ms=round((time.monotonic() - started) * 1000, 3),
            )  # fmt: skip

    def _surface(self, context: Any) -> tactmem.core.McpSurface:
        """What one MCP request is served: its role's tool definition and its session's tool."""
        request: Request = context.request
        digest, principal = request.scope[_MCP_CALLER]
        tool = self._tool(request.headers.get("mcp-session-id"), digest, principal)
        definition = self.definitions[principal.role]
        return definition, functools.partial(self._call, tool, principal)

    def _tool(self, session: str | None, digest: bytes, principal: Principal) -> tactmem.MemoryTool:
        """The session's tool, made on its first use. Tools unused for as long as the session
        manager keeps an idle session are forgotten then (at worst a later put needs a new
        scan). A request outside any session gets a tool of its own."""
        now = time.monotonic()
        kept = None if session is None else self.tools.get((session, digest))
        if kept is None:
            for place in [
                p for p, (_, used) in self.tools.items() if now - used > MCP_SESSION_IDLE_S
            ]:
                del self.tools[place]
            backend = NamespaceStore(self.store, principal, timeout_s=self.timeout_s)
            tool = tactmem.MemoryTool(backend, root=principal.role == "writer", team=True)
            kept = (tool, now)
        if session is not None:
            self.tools[session, digest] = (kept[0], now)
        return kept[0]

    def _forget(self, session: str) -> None:
        for place in [p for p in self.tools if p[0] == session]:
            del self.tools[place]

    def _keep_book(self, asked: str, opened: str, digest: bytes, method: str, status: int) -> None:
        """After a request, the book (and the tools) in step with the SDK's sessions: one
        opened, used, ended by its client (DELETE), or gone (404 to its own token)."""
        now = time.monotonic()
        if not asked:
            if opened and status < 400:
                self.book.opened(opened, digest, now)
        elif self.book.owner(asked) == digest:
            if status == 404 or (method == "DELETE" and status < 400):
                self.book.closed(asked)
                self._forget(asked)
            else:
                self.book.used(asked, now)

    async def _make_room(self, digest: bytes) -> None:
        """Before `digest` may open a session, close what the book says must go, as its client
        would (a DELETE with its id, on its owner's behalf), and log each (never the id)."""
        for session, reason in self.book.room(digest, time.monotonic()):
            owner = self.book.owner(session)
            self.book.closed(session)
            self._forget(session)
            if owner is None:
                continue
            principal = self.principals[owner]
            scope = _closing_scope(session, _mcp_user(owner, principal))
            await self.manager.handle_request(scope, _no_body, _discard)
            _log_event(
                event="mcp_session_closed", namespace=principal.namespace,
                role=principal.role, reason=reason,
            )  # fmt: skip

    @staticmethod
    def _call(
        tool: tactmem.MemoryTool, principal: Principal, arguments: dict[str, Any]
    ) -> dict[str, Any]:
        """One tool call, and one structured line: the operation and the outcome, never a
        query, content or any other value the agent sent."""
        started = time.monotonic()
        answer = tool.call(arguments)
        operation, error = arguments.get("operation"), answer.get("error")
        _log_event(
            event="tool", operation=operation if operation in _TOOL_OPERATIONS else None,
            namespace=principal.namespace, role=principal.role,
            success=error is None, error_code=None if error is None else error["code"],
            elapsed_ms=round((time.monotonic() - started) * 1000, 3),
        )  # fmt: skip
        return answer


class _SessionBook:
    """The open MCP sessions, least recently used first, each with its owner (a token's
    hash), and which to close so that one more fits: at most `per_token` for one token, then
    `total` in all, each time the least recently used. One token's agents can so never take
    every session of the process (a host that leaks sessions loses its own oldest), and a
    session idle for `idle_s` is forgotten (the SDK has closed it by then)."""

    def __init__(
        self, per_token: int = MCP_SESSIONS_PER_TOKEN, total: int = MCP_MAX_SESSIONS,
        idle_s: float = MCP_SESSION_IDLE_S,
    ) -> None:  # fmt: skip
        self.per_token, self.total, self.idle_s = per_token, total, idle_s
        self._sessions: collections.OrderedDict[str, tuple[bytes, float]] = (
            collections.OrderedDict()
        )

    def owner(self, session: str) -> bytes | None:
        kept = self._sessions.get(session)
        return None if kept is None else kept[0]

    def opened(self, session: str, owner: bytes, now: float) -> None:
        self._sessions[session] = (owner, now)
        self._sessions.move_to_end(session)

    def used(self, session: str, now: float) -> None:
        owner = self.owner(session)
        if owner is not None:
            self.opened(session, owner, now)

    def closed(self, session: str) -> None:
        self._sessions.pop(session, None)

    def room(self, owner: bytes, now: float) -> list[tuple[str, str]]:
        """The sessions to close before `owner` opens one, each with why."""
        while self._sessions:
            session, (_, used) = next(iter(self._sessions.items()))
            if now - used < self.idle_s:
                break
            del self._sessions[session]
        mine = [session for session, (who, _) in self._sessions.items() if who == owner]
        excess = max(0, len(mine) - self.per_token + 1)
        chosen = [(session, "token_share") for session in mine[:excess]]
        taken = {session for session, _ in chosen}
        others = [session for session in self._sessions if session not in taken]
        over = len(self._sessions) - len(chosen) - self.total + 1
        return chosen + [(session, "process_total") for session in others[: max(0, over)]]


def _closing_scope(session: str, user: Any) -> Scope:
    """A DELETE of `session` by its owner, as its client would end it."""
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "DELETE",
        "scheme": "http", "path": MCP_PATH, "raw_path": MCP_PATH.encode(), "query_string": b"",
        "root_path": "", "headers": [(b"mcp-session-id", session.encode("latin-1"))],
        "client": None, "server": None, "user": user,
    }  # fmt: skip


async def _no_body() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}


async def _discard(_message: Message) -> None:
    return None


def _mcp_user(digest: bytes, principal: Principal) -> Any:
    """The SDK's authenticated user for a token: the session manager binds each session to
    the user that opened it, here the token's hash (the token itself is not kept)."""
    from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
    from mcp.server.auth.provider import AccessToken

    return AuthenticatedUser(AccessToken(token="", client_id=digest.hex(), scopes=[principal.role]))


def _unsupported_version(version: str) -> Response:
    """The answer to a request of MCP 2026-07-28 or later, which has no sessions to keep the
    tool's gate in: JSON-RPC `unsupported protocol version`, naming the handshake versions, so
    a client that negotiates falls back to the initialize handshake."""
    from mcp_types import UNSUPPORTED_PROTOCOL_VERSION
    from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS, KNOWN_PROTOCOL_VERSIONS

    data = {
        "supported": list(HANDSHAKE_PROTOCOL_VERSIONS),
        "requested": version if version in KNOWN_PROTOCOL_VERSIONS else "",  # no typed text
    }
    error = {"code": UNSUPPORTED_PROTOCOL_VERSION, "message": "Unsupported protocol version"}
    body = {"jsonrpc": "2.0", "id": None, "error": {**error, "data": data}}
    return Response(_body(body), 400, media_type="application/json")


def create_app(
    store: TeamStore, principals: _Principals, *, timeout_s: float = STORE_TIMEOUT_S
) -> Starlette:
    """The ASGI application: the eight routes of protocol v1 under `/v1`, the memory tool over
    MCP at `/mcp`, and `/healthz`."""
    if not principals:
        raise CredentialsError("at least one credential is required")
    server = _Server(store, principals, timeout_s)
    mcp = _McpEndpoint(store, principals, timeout_s, server.places)
    routes = [Route(path, server.handle, methods=[op.method]) for path, op in _ROUTES.items()]
    routes.append(Route(MCP_PATH, mcp, methods=["POST", "DELETE"]))
    routes.append(Route("/healthz", server.health, methods=["GET"]))

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(mcp.run)
            yield
            tasks.cancel_scope.cancel()
        await anyio.to_thread.run_sync(store.close)
        _log_event(event="stopped")

    app = Starlette(
        routes=routes, exception_handlers={HTTPException: _empty_error}, lifespan=lifespan
    )
    app.router.redirect_slashes = False  # `/v1/session/` is an unknown route, as in axum
    return app


# ============================================================================ command line (I/O)


def _bounded(kind: Callable[[str], float], low: float, high: float, what: str) -> Any:
    """An argparse type: a `kind` number from `low` to `high` (NaN is neither), else a usage
    error that says what is expected and does not echo what was typed."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            value = math.nan
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected {what}")
        return value

    return parse


_SECONDS: Final = (0.1, 86400.0)  # PostgreSQL's and SQLite's timeouts take int milliseconds


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tactmem-server",
        description="Serve team memory over Tact's remote protocol v1 (routes under /v1) and"
        " the memory tool over MCP streamable HTTP (/mcp).",
        epilog="Logs are JSON lines on standard error; they never hold a token or any content.",
    )
    storage = parser.add_mutually_exclusive_group(required=True)
    storage.add_argument("--sqlite", metavar="FILE", help="an embedded SQLite database file")
    storage.add_argument("--postgres", metavar="URL", help="a PostgreSQL connection URL or DSN")
    parser.add_argument(
        "--credentials", metavar="FILE", required=True,
        help="TOML file of [[credentials]] namespace, role, token (mode 0600)",
    )  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    parser.add_argument(
        "--port", type=_bounded(int, 0, 65535, "a port from 0 to 65535"), default=8420,
        help="port to listen on (8420; 0: any free)",
    )  # fmt: skip
    parser.add_argument(
        "--store-timeout", default=STORE_TIMEOUT_S, metavar="SECONDS",
        type=_bounded(float, *_SECONDS, "a number of seconds from {:g} to {:g}".format(*_SECONDS)),
        help=f"longest one store operation may take before 503 ({STORE_TIMEOUT_S:g})",
    )  # fmt: skip
    parser.add_argument(
        "--read-timeout", default=READ_TIMEOUT_S, metavar="SECONDS",
        type=_bounded(float, *_SECONDS, "a number of seconds from {:g} to {:g}".format(*_SECONDS)),
        help=f"longest a request's head, then its body, may take to arrive ({READ_TIMEOUT_S:g})",
    )  # fmt: skip
    parser.add_argument(
        "--pool-size", type=_bounded(int, 1, math.inf, "a whole number of at least 1"),
        default=16, metavar="N", help="PostgreSQL connections per server process (16)",
    )  # fmt: skip
    parser.add_argument("--version", action="version", version=f"tactmem-server {__version__}")
    return parser


def _connection_bounds(spare: int) -> tuple[int, int]:
    """How many connections to accept at a time (the listen backlog, which asyncio also takes
    as the most it accepts in one go) and to keep open, for the files this process may open:
    its soft `RLIMIT_NOFILE` raised to the hard one. A connection past the files left would
    make accepting fail, and asyncio then stops accepting for a second, again and again,
    while a fresh request waits. Kept aside: `spare` files for the store, logs and the rest,
    and two batches of accepted connections not yet closed to make room."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return _bounds_for(1 << 20 if soft == resource.RLIM_INFINITY else soft, spare)


def _bounds_for(files: int, spare: int) -> tuple[int, int]:
    backlog = min(2048, max(16, files // 8))
    return backlog, max(1, min(MAX_CONNECTIONS, files - 2 * backlog - spare))


def _bounded_protocol(read_timeout_s: float, max_connections: int) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with the bounds uvicorn lacks (it times out only a keep-alive
    connection left idle after a response): a request's head must arrive within
    `read_timeout_s` of the connection being opened or of the previous response, and its body
    within `read_timeout_s` of the head, else the connection is closed (a body cut short is
    the app's `ClientDisconnect`). At `max_connections`, a new connection closes the one that
    has waited longest for a head or a body (an idle or a slow peer, never one being
    answered), or itself when every other is being answered."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    waiting_for = {h11.IDLE: "head", h11.SEND_BODY: "body"}

    class BoundedProtocol(H11Protocol):
        phase: str | None = None  # what the connection waits for from its peer
        since = 0.0  # when it began to
        timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)  # type: ignore[arg-type]
            self._follow()
            self._make_room()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._follow()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._follow()

        def connection_lost(self, exc: Exception | None) -> None:
            self._time(None)
            super().connection_lost(exc)

        def _follow(self) -> None:
            """Time the phase the peer is in: its head (from connection or the last answer),
            then its body; nothing while its request is answered."""
            phase = waiting_for.get(self.conn.their_state)
            if phase != self.phase and not self.transport.is_closing():
                self._time(phase)

        def _time(self, phase: str | None) -> None:
            if self.timer is not None:
                self.timer.cancel()
            self.phase, self.since, self.timer = phase, self.loop.time(), None
            if phase is not None:
                self.timer = self.loop.call_later(read_timeout_s, self._close)

        def _close(self) -> None:
            self._time(None)  # no longer waiting: never chosen to make room twice
            self.transport.close()

        def _make_room(self) -> None:
            if len(self.connections) <= max_connections:
                return
            waiting = [
                peer for peer in self.connections
                if isinstance(peer, BoundedProtocol) and peer.phase and peer is not self
            ]  # fmt: skip
            (min(waiting, key=lambda peer: peer.since) if waiting else self)._close()

    return BoundedProtocol


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket. Its protocol is named (IPPROTO_TCP, not 0) because asyncio sets
    TCP_NODELAY only on connections accepted from such a socket; without it every response
    waited about 40 ms for the client's delayed ACK (headers and body are two writes)."""
    try:  # how the socket module encodes a name: a byte that is not UTF-8 fails here
        host.encode("idna")
    except UnicodeError:
        raise OSError(errno.EINVAL, "not an address or host name") from None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(2048)
    except OSError:
        listener.close()
        raise
    return listener


_EXPOSED: Final = (
    "listening on {} reaches beyond this machine: plain HTTP carries the bearer tokens in"
    " clear, so put TLS in front (a reverse proxy) before anyone else connects"
)


_FIRST_USE_MODULES: Final = (
    "mcp.types", "mcp.server.lowlevel", "mcp.server.streamable_http_manager",
    "mcp.server.auth.middleware.bearer_auth", "mcp.server.auth.provider", "mcp_types.version",
    "anyio._backends._asyncio",  # anyio's, on its first use: each request's hand-off to a thread
)  # fmt: skip


def _load_first_use_modules() -> None:
    """Import, before the port answers, what requests would otherwise import on first use: what
    `/mcp` runs on (the SDK takes seconds), and anyio's event loop backend (about 10 ms), which
    the first request paid, and every request that came in while it loaded."""
    for module in _FIRST_USE_MODULES:
        importlib.import_module(module)


def main(argv: Sequence[str] | None = None) -> int:
    import uvicorn

    arguments = _parser().parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    _log.addHandler(handler)
    _log.setLevel(logging.INFO)
    _log.propagate = False
    try:
        principals = load_credentials(arguments.credentials)
        engine: _Engine = (
            SqliteEngine(arguments.sqlite)
            if arguments.sqlite is not None
            else PostgresEngine(arguments.postgres, pool_size=arguments.pool_size)
        )
        listener = _listen(arguments.host, arguments.port)
        store = TeamStore(engine)
        with contextlib.suppress(tactmem.StoreBusy):  # else the first scan builds it
            store.warm(time.monotonic() + arguments.store_timeout)
        _load_first_use_modules()
        gc.freeze()  # what start-up made lives as long as the process: no collection walks it
    except (CredentialsError, TactmemError) as error:
        print(f"tactmem-server: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # the address is not echoed: it may hold any byte, a newline too
        print(f"tactmem-server: cannot listen on --host, --port: {error.strerror}", file=sys.stderr)
        return 2
    app = create_app(store, principals, timeout_s=arguments.store_timeout)
    spare = _FILES_KEPT + (0 if arguments.sqlite else arguments.pool_size)
    backlog, connections = _connection_bounds(spare)
    config = uvicorn.Config(
        app, interface="asgi3", log_config=None, access_log=False, lifespan="on",
        timeout_graceful_shutdown=int(arguments.store_timeout + _GRACE_S), backlog=backlog,
        http=_bounded_protocol(arguments.read_timeout, connections), ws="none",
    )  # fmt: skip
    config.load()  # uvicorn's own imports, before the port is said to answer, not under a request
    for name in ("uvicorn", "asyncio", "psycopg"):  # psycopg: also its pool's (`psycopg.pool`)
        foreign = logging.getLogger(name)
        foreign.setLevel(logging.WARNING)
        foreign.addHandler(_ForeignRecords())
        foreign.propagate = False
    sdk = logging.getLogger("mcp")  # its lines are not JSON, and some name a session id
    sdk.addHandler(logging.NullHandler())
    sdk.propagate = False
    host, port = listener.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    if not ipaddress.ip_address(host).is_loopback:
        _log_event(event="warning", message=_EXPOSED.format(shown))
    _log_event(
        event="listening",
        url=f"http://{shown}:{port}",
        backend="sqlite" if arguments.sqlite else "postgres",
    )
    uvicorn.Server(config).run(sockets=[listener])
    return 0


if __name__ == "__main__":
    sys.exit(main())
