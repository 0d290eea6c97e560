"""The Responses API's store of stored responses (gateway/responses/store.py): JSON fidelity, owners,
expiry, restart survival, a corrupt or locked file as a clear error (never a lost write), private file
modes, and SQLite kept off the event loop."""

from __future__ import annotations

import asyncio
import sqlite3
import stat

import pytest

from interlace.gateway.config import ResponsesConfig
from interlace.gateway.responses.store import (SCHEMA_VERSION, SQLiteResponseStore, StoredResponse, StoreError,
                                               open_store)


def record(id="resp_1", owner="alice", expires_at=1e12, **kw) -> StoredResponse:
    conv = [{"role": "user", "content": "Quel temps fait-il à Zürich ? 天気 🌦"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Z\\u00fcrich"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "lone surrogate \ud800, nul \x00, 12°C"}]
    fields = dict(id=id, owner=owner, model="smollm2", created_at=1000.5, expires_at=expires_at, status="completed",
                  response={"id": id, "object": "response", "output": [{"type": "message", "content": [
                      {"type": "output_text", "text": "ok", "annotations": []}]}], "usage": {"input_tokens": 7},
                      "metadata": {"k": "v"}, "temperature": 0.7, "top_p": None, "nested": [[1, [2.5, {"a": True}]]]},
                  input_items=[{"id": "msg_1", "type": "message", "role": "user", "content": "hé"}],
                  conversation=conv, previous_response_id="resp_0")
    fields.update(kw)
    return StoredResponse(**fields)


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def store(tmp_path):
    s = SQLiteResponseStore(str(tmp_path / "r.sqlite3"), ttl_s=60, clock=Clock(500.0))
    yield s
    await s.close()


async def test_round_trip_keeps_every_field_and_json_value(store):
    r = record()
    await store.put(r)
    got = await store.get("alice", "resp_1")
    assert got == r  # unicode, a lone surrogate, NUL, nested lists/dicts, floats, None, booleans
    assert got is not r
    assert store.expires_at(1000.0) == 1060.0


async def test_put_replaces_the_same_id(store):
    await store.put(record(status="in_progress", response={"status": "in_progress"}))
    await store.put(record(status="cancelled", response={"status": "cancelled"}))
    got = await store.get("alice", "resp_1")
    assert (got.status, got.response) == ("cancelled", {"status": "cancelled"})
    assert await store.count("alice") == 1


async def test_owners_are_isolated(store):
    await store.put(record(id="resp_a", owner="alice"))
    await store.put(record(id="resp_n", owner=None))
    for owner, own, other in (("alice", "resp_a", "resp_n"), (None, "resp_n", "resp_a")):
        assert (await store.get(owner, own)).owner == owner
        assert await store.get(owner, other) is None
        assert await store.delete(owner, other) is False
        assert await store.count(owner) == 1
    for stranger in ("bob", "None", ""):
        assert await store.get(stranger, "resp_a") is None and await store.get(stranger, "resp_n") is None
        assert await store.count(stranger) == 0
    with pytest.raises(StoreError, match="another owner"):  # an id of another owner's is never overwritten
        await store.put(record(id="resp_a", owner="bob", status="failed"))
    assert (await store.get("alice", "resp_a")).status == "completed"
    assert await store.get("bob", "resp_a") is None
    assert await store.get("alice", "resp_a") is not None and await store.get(None, "resp_n") is not None


async def test_expiry_follows_the_clock(store):
    clock = store.clock
    await store.put(record(id="resp_old", expires_at=600.0))
    await store.put(record(id="resp_new", expires_at=700.0))
    assert await store.count("alice") == 2
    clock.now = 600.0  # expires_at <= now is gone
    assert await store.get("alice", "resp_old") is None
    assert await store.delete("alice", "resp_old") is False
    assert await store.count("alice") == 1
    assert await store.get("alice", "resp_new") is not None
    assert await store.expire() == 1
    clock.now = 0.0  # the row is gone, not only hidden
    assert await store.get("alice", "resp_old") is None
    assert await store.get("alice", "resp_new") is not None
    assert await store.expire() == 0


async def test_deleted_and_expired_conversations_leave_no_trace_in_the_file(tmp_path):
    path = tmp_path / "private.sqlite3"
    clock = Clock(0.0)
    store = SQLiteResponseStore(str(path), ttl_s=60, clock=clock)
    await store.put(record(id="resp_del", conversation=[{"role": "user", "content": "SECRET-DELETED " * 50}]))
    await store.put(record(id="resp_exp", expires_at=10.0,
                           conversation=[{"role": "user", "content": "SECRET-EXPIRED " * 50}]))
    await store.put(record(id="resp_keep"))
    assert await store.delete("alice", "resp_del")
    clock.now = 10.0
    assert await store.expire() == 1
    await store.close()  # checkpoints the WAL into the file and removes it
    data = path.read_bytes()
    assert b"SECRET-DELETED" not in data and b"SECRET-EXPIRED" not in data
    assert b"resp_keep" in data


async def test_count_and_delete(store):
    for i in range(3):
        await store.put(record(id=f"resp_{i}"))
    await store.put(record(id="resp_b", owner="bob"))
    assert await store.count("alice") == 3
    assert await store.delete("alice", "resp_1") is True
    assert await store.get("alice", "resp_1") is None
    assert await store.delete("alice", "resp_1") is False
    assert await store.delete("alice", "resp_unknown") is False
    assert (await store.count("alice"), await store.count("bob")) == (2, 1)


async def test_survives_a_restart_in_a_private_file(tmp_path):
    path = tmp_path / "state" / "interlace" / "responses.sqlite3"
    first = open_store(ResponsesConfig(path=str(path), ttl_s=60))
    await first.put(record())
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    wal = path.with_name(path.name + "-wal")
    assert wal.exists() and stat.S_IMODE(wal.stat().st_mode) == 0o600
    second = SQLiteResponseStore(str(path), ttl_s=60)  # another process would do the same, beside the first
    assert await second.get("alice", "resp_1") == record()
    await first.close()
    await second.close()
    third = open_store(ResponsesConfig(path=str(path)))
    assert await third.get("alice", "resp_1") == record()
    await third.close()


async def test_open_store_disabled_memory_and_default_path(tmp_path, monkeypatch):
    assert open_store(ResponsesConfig(enabled=False)) is None
    mem = open_store(ResponsesConfig(path=":memory:"))
    await mem.put(record())
    assert await mem.get("alice", "resp_1") == record()
    assert not (tmp_path / ":memory:").exists()
    await mem.close()
    monkeypatch.setenv("INTERLACE_STATE_DIR", str(tmp_path / "st"))
    default = open_store(ResponsesConfig())
    await default.put(record())
    await default.close()
    assert (tmp_path / "st" / "responses.sqlite3").is_file()


def make_db(path, rows=0) -> None:
    s = SQLiteResponseStore(str(path), ttl_s=60)

    async def fill():
        for i in range(rows):
            await s.put(record(id=f"resp_{i}", response={"pad": "x" * 3000}))
        await s.close()
    asyncio.run(fill())


def test_a_file_that_is_not_a_database_is_refused(tmp_path):
    garbage = tmp_path / "garbage.sqlite3"
    garbage.write_bytes(b"\x00\xffnot sqlite at all" * 300)
    with pytest.raises(StoreError, match=r"garbage\.sqlite3 is corrupt .*move it away or delete it"):
        SQLiteResponseStore(str(garbage), ttl_s=60)
    assert garbage.read_bytes() == b"\x00\xffnot sqlite at all" * 300  # left as it was

    header = tmp_path / "header.sqlite3"
    make_db(header, rows=2)
    data = bytearray(header.read_bytes())
    data[:16] = b"definitely not.."
    header.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=r"header\.sqlite3 is corrupt"):
        open_store(ResponsesConfig(path=str(header)))


def test_a_damaged_database_is_refused(tmp_path):
    path = tmp_path / "damaged.sqlite3"
    make_db(path, rows=40)
    data = bytearray(path.read_bytes())
    assert len(data) > 16 * 4096
    data[3 * 4096:12 * 4096] = b"\xa5" * (9 * 4096)  # pages of the table's b-tree overwritten, header intact
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=r"damaged\.sqlite3 is corrupt .*move it away or delete it"):
        SQLiteResponseStore(str(path), ttl_s=60)


def test_a_damaged_index_found_by_quick_check_is_refused(tmp_path):
    path = tmp_path / "index.sqlite3"
    make_db(path, rows=3)
    db = sqlite3.connect(path)
    page = db.execute("SELECT rootpage FROM sqlite_master WHERE name = 'responses_owner'").fetchone()[0]
    db.close()
    data = bytearray(path.read_bytes())
    data[(page - 1) * 4096 + 8] ^= 0x5A  # a cell pointer of the index's leaf page: out of range
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=rf"index\.sqlite3 is corrupt \(On tree page {page} cell 0: .*\): move"):
        SQLiteResponseStore(str(path), ttl_s=60)


async def test_a_row_that_does_not_decode_is_a_store_error(tmp_path):
    path = tmp_path / "row.sqlite3"
    store = SQLiteResponseStore(str(path), ttl_s=60)
    await store.put(record())
    db = sqlite3.connect(path)
    with db:
        db.execute("UPDATE responses SET conversation = '[{\"role\": \"us' WHERE id = 'resp_1'")
    db.close()
    with pytest.raises(StoreError, match=r"row\.sqlite3 is corrupt \(response 'resp_1' does not decode"):
        await store.get("alice", "resp_1")
    await store.close()


def test_another_programs_database_or_a_newer_schema_is_refused(tmp_path):
    other = tmp_path / "other.sqlite3"
    with sqlite3.connect(other) as db:
        db.execute("CREATE TABLE accounts (id INTEGER)")
    db.close()
    with pytest.raises(StoreError, match=r"other\.sqlite3 is not a response store \(it holds accounts"):
        SQLiteResponseStore(str(other), ttl_s=60)
    with sqlite3.connect(other) as db:
        assert [r[0] for r in db.execute("SELECT name FROM sqlite_master")] == ["accounts"]  # untouched
    db.close()

    newer = tmp_path / "newer.sqlite3"
    make_db(newer)
    db = sqlite3.connect(newer)
    db.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(StoreError, match=rf"newer\.sqlite3 has schema version {SCHEMA_VERSION + 1}"):
        SQLiteResponseStore(str(newer), ttl_s=60)


def test_an_unusable_directory_is_named(tmp_path):
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    with pytest.raises(StoreError, match=r"cannot create the response store's directory .*afile"):
        open_store(ResponsesConfig(path=str(blocker / "responses.sqlite3")))


async def test_a_locked_file_fails_the_put_loudly_then_the_same_put_works(tmp_path):
    path = tmp_path / "locked.sqlite3"
    store = SQLiteResponseStore(str(path), ttl_s=60, busy_timeout_s=0.3)
    await store.put(record(id="resp_before"))
    other = sqlite3.connect(path, isolation_level=None, timeout=0)
    other.execute("BEGIN EXCLUSIVE")  # another process holds the write lock
    ticks = []

    async def ticker():
        while True:
            ticks.append(asyncio.get_running_loop().time())
            await asyncio.sleep(0.01)

    ticking = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    try:
        before = len(ticks)
        with pytest.raises(StoreError, match=r"locked\.sqlite3 is locked"):
            await store.put(record(id="resp_during"))
        during = len(ticks) - before
        with pytest.raises(StoreError, match="is locked"):
            await store.delete("alice", "resp_before")
        assert (await store.get("alice", "resp_before")).id == "resp_before"  # WAL: reads go on
    finally:
        ticking.cancel()
        other.execute("ROLLBACK")
        other.close()
    assert during >= 3  # the loop kept running while the put waited for the lock in a worker thread
    assert await store.get("alice", "resp_during") is None  # refused, not half-written
    await store.put(record(id="resp_during"))
    assert await store.delete("alice", "resp_before") is True
    await store.close()
    reopened = SQLiteResponseStore(str(path), ttl_s=60)
    assert await reopened.get("alice", "resp_during") == record(id="resp_during")
    assert await reopened.get("alice", "resp_before") is None
    await reopened.close()


async def test_calls_waiting_for_a_lock_do_not_hold_pool_threads(tmp_path):
    import anyio.to_thread

    path = tmp_path / "queue.sqlite3"
    store = SQLiteResponseStore(str(path), ttl_s=60)
    other = sqlite3.connect(path, isolation_level=None, timeout=0)
    other.execute("BEGIN EXCLUSIVE")
    puts = [asyncio.create_task(store.put(record(id=f"resp_{i}"))) for i in range(6)]
    await asyncio.sleep(0.2)
    try:
        assert anyio.to_thread.current_default_thread_limiter().borrowed_tokens <= 1  # not one per waiting put
        assert not any(p.done() for p in puts)
    finally:
        other.execute("ROLLBACK")  # released within the busy timeout: every put goes through
        other.close()
    await asyncio.gather(*puts)
    assert await store.count("alice") == 6
    await store.close()


async def test_close_is_idempotent_and_final(store):
    await store.put(record())
    await store.close()
    await store.close()
    for call in (store.put(record(id="resp_2")), store.get("alice", "resp_1"), store.delete("alice", "resp_1"),
                 store.count("alice"), store.expire()):
        with pytest.raises(StoreError, match="closed"):
            await call


async def test_the_gateway_deletes_expired_responses_from_the_file(tmp_path):
    """Expired rows are invisible at once; the gateway's sweep also takes them out of the file."""
    from interlace.gateway.app import Gateway
    from interlace.gateway.config import parse_config

    clock = Clock(5000.0)
    gw = Gateway(parse_config({"models": {"m": {"path": "embedded"}}}))
    gw.responses = SQLiteResponseStore(str(tmp_path / "r.db"), ttl_s=60, clock=clock)
    await gw.responses.put(record("resp_old", expires_at=4000.0))
    await gw.responses.put(record("resp_new", expires_at=9000.0))
    sweep = asyncio.ensure_future(gw._expire_responses(0.05))
    try:
        for _ in range(200):
            with sqlite3.connect(tmp_path / "r.db") as db:
                ids = [r[0] for r in db.execute("SELECT id FROM responses")]
            if ids == ["resp_new"]:
                break
            await asyncio.sleep(0.05)
        assert ids == ["resp_new"]
    finally:
        sweep.cancel()
        await asyncio.gather(sweep, return_exceptions=True)
        await gw.responses.close()
