# ruff: noqa: F811
"""Attacks on issue 25, part 1: `tactmem push` never rewrites or deletes a team record this
store has not seen, a key never names other content, and a crash or a race loses nothing.

Each test is a multi-step history run with real `tactmem` processes against a real
`tactmem-server` (the fixtures of test_server.py), on the backends where the attack matters:
SQLite alone where only the client decides, both where the server's transactions do, and
PostgreSQL alone where only its READ COMMITTED transactions are attacked. Each names the
promise it holds the code to (README, "The push rule"; server/README.md, "Safe pushes").
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import threading
import time
from collections.abc import Callable

import pytest
import tactmem

# The fixtures of test_server.py, found by pytest under their names here; a test's argument of
# the same name is the fixture, not a redefinition.
from test_server import (  # noqa: F401
    CHECKLIST,
    STAGING,
    TABS,
    Member,
    Relay,
    Server,
    backend,
    cluster,
    credentials,
    relay_to,
    snapshot_record,
    start,
    team_of,
)

WEEK_MS = 7 * 24 * 3600 * 1000
sqlite_only = pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
postgres_only = pytest.mark.parametrize("backend", ["postgres"], indirect=True)


def run(member: Member, *argv: str, where: str = "home") -> subprocess.CompletedProcess[str]:
    """`member(...)`, keeping standard error and the exit status for the test to judge."""
    return subprocess.run(
        member.command(*argv), cwd=member.base / where, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


def database(member: Member) -> str:
    return tactmem.memory_db_path(str(member.config))


def a_week_passes_here(member: Member) -> None:
    """The member's local store, a little over a probation later: what it drops unread."""
    with tactmem.Store(database(member)) as store:
        store.list(now_ms=int(time.time() * 1000) + WEEK_MS + 60_000)


def remove_the_store(member: Member) -> None:
    """The member deletes the local database (as a reset, or before `restore`); the team links
    beside it, `<database>-team`, stay."""
    for suffix in ("", "-wal", "-shm"):
        pathlib.Path(database(member) + suffix).unlink(missing_ok=True)
    assert pathlib.Path(database(member) + "-team").exists()


def replacement(namespace: str, doc_id: int, version: int) -> dict[str, object]:
    return {"id": doc_id, "version": version, "namespace": namespace}


# ============================================================================ probation here


@sqlite_only
def test_a_record_used_on_the_team_is_not_deleted_when_it_expires_unread_here(
    start: Callable[..., Server], tmp_path: pathlib.Path
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
    a_week_passes_here(bob)
    bob("push")
    assert team_of(server) == {("bob", 1, 1): TABS}


@sqlite_only
def test_a_pulled_record_that_expires_unread_here_is_not_deleted_from_the_team(
    start: Callable[..., Server], tmp_path: pathlib.Path
) -> None:
    """Alice's agent stores and uses alice#1 from her workspace root; at home she pulls
    (fresh local probation, as import gives) and never reads the copy there. A week later the
    copy expires at home, and `pull` then `push` deletes alice#1 from the team."""
    server = start()
    alice = Member(tmp_path, "alice", server.url)
    alice("put", STAGING, where="work")
    alice("read", "1", where="work")
    assert alice("pull", "--namespace", "alice").endswith("1 inserted, 0 skipped.\n")
    a_week_passes_here(alice)
    alice("push")
    assert team_of(server) == {("alice", 1, 1): STAGING}


# ============================================================================ races


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


# ============================================================================ conflicts


@sqlite_only
def test_a_pull_settles_a_record_changed_here_and_on_the_server(
    start: Callable[..., Server], tmp_path: pathlib.Path
) -> None:
    """README: a push refused for a conflict; "`tactmem pull` then brings the server's version in
    as a record of its own (linked, so it is not a conflict again)". For a record changed here
    and on the server, the push after the pull was refused again, and stayed refused
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


# ============================================================================ crashes


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


# ============================================================================ links and stores


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
    assert team_of(server) == {("bob", 1, 1): TABS, ("bob", 2, 1): STAGING}
