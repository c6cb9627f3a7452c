"""Queues and the arena: demand before prefetch, fairness, promotion,
cancel, waiting for pins to drop, per-session pin limits, eviction.

Order is checked through the daemon's own read_start stamps, with a single
slow reader (--read-rate) so that requests pile up in the queues."""

import os
import random

import pytest

import native
from iod.arena import Arena
from shared import protocol as P
from shared import slots as S
from tests.iod_fixtures import LiveDaemon, Raw

E = P.ErrorCode


@pytest.fixture
def slow():
    # one reader at 2 MB/s: a 40 KB record takes ~20 ms, a 130 KB one ~65 ms
    d = LiveDaemon(args=["--arena", "16M", "--workers", "1", "--read-rate", "2"])
    yield d
    d.stop()


def _readies(r, n):
    out = [m for m in getattr(r, "notes", []) if isinstance(m, P.Ready)]
    r.notes = []
    while len(out) < n:
        m = r.recv()
        if isinstance(m, P.Ready):
            out.append(m)
    return out


def test_demand_goes_before_queued_prefetch(slow, model):
    a, b = Raw(slow.socket), Raw(slow.socket)
    ha, hb = a.hello(model), b.hello(model)
    assert a.rt(P.Prefetch(a.req(), ha.model_id, 0, list(range(10)))).count == 10
    ok = b.rt(P.Acquire(b.req(), hb.model_id, 1, [0], True))
    received, demand_start = ok.slots[0][4], ok.slots[0][6]
    starts = [m.slot[6] for m in _readies(a, 10)]
    # once the demand is in, at most the prefetch already handed to the
    # reader (and the one it grabs next while the demand is being queued) start first
    overtook = sum(1 for s in starts if received < s < demand_start)
    assert overtook <= 2, (overtook, "prefetches overtook the demand")
    assert any(s > demand_start for s in starts)


def test_sessions_take_turns(slow, model):
    a, b = Raw(slow.socket), Raw(slow.socket)
    ha, hb = a.hello(model), b.hello(model)
    a.rt(P.Prefetch(a.req(), ha.model_id, 0, list(range(8))))
    b.rt(P.Prefetch(b.req(), hb.model_id, 2, list(range(8))))
    order = sorted([(m.slot[6], "a") for m in _readies(a, 8)] +
                   [(m.slot[6], "b") for m in _readies(b, 8)])
    seq = "".join(who for _, who in order)
    # from b's first read until a runs dry, they alternate (a run of two
    # where a read was already handed to the reader)
    both = seq[seq.index("b"): seq.rindex("a") + 1]
    assert "aaa" not in both and "bbb" not in both, seq


def test_demand_promotes_a_queued_prefetch(slow, model):
    a = Raw(slow.socket)
    h = a.hello(model)
    a.rt(P.Prefetch(a.req(), h.model_id, 0, list(range(8))))
    ok = a.rt(P.Acquire(a.req(), h.model_id, 0, [7], True))
    starts = {m.slot[0]: m.slot[6] for m in _readies(a, 8)}
    received, start = ok.slots[0][4], ok.slots[0][6]
    assert sum(1 for e in range(7) if received < starts[e] < start) <= 2
    assert a.rt(P.Stats(a.req())).stats["counters"]["promoted"] == 1


def test_cancel_drops_only_queued_prefetches(slow, model):
    a = Raw(slow.socket)
    h = a.hello(model)
    a.rt(P.Prefetch(a.req(), h.model_id, 2, list(range(8))))
    dropped = a.rt(P.Cancel(a.req(), h.model_id, 2)).count
    assert dropped >= 1
    a.notes = [m for m in a.notes if not isinstance(m, P.Ready)]  # keep things simple
    st = a.rt(P.Stats(a.req())).stats
    # what was not dropped was started already: it lands and is announced
    landed = st["sessions"][0]["pins"] + st["sessions"][0]["queued"]
    assert landed + dropped == 8


@pytest.fixture
def tiny(model):
    # room for 4 slots of the model's largest stride (303104 B)
    d = LiveDaemon(args=["--arena", str(S.arena_bytes(303104, 4)), "--workers", "1"])
    yield d
    d.stop()


def test_requests_wait_for_pins_to_drop(tiny, model):
    a = Raw(tiny.socket)
    ha = a.hello(model)
    assert ha.slot_count == 4
    held = a.rt(P.Acquire(a.req(), ha.model_id, 2, [0, 1, 2, 3], True))  # alone: all 4
    assert isinstance(held, P.AcquireOk)
    b = Raw(tiny.socket)
    hb = b.hello(model)  # now each session's share is 2 slots; a is over it
    b.send(P.Acquire(77, hb.model_id, 2, [4, 5], True))
    assert not b.s.poll(300), "answered although every slot is pinned"
    a.rt(P.Release(a.req(), [held.slots[0][1:3]]))
    assert not b.s.poll(300), "answered with one slot for two records"
    a.rt(P.Release(a.req(), [held.slots[1][1:3]]))
    ok = b.until(77)
    assert isinstance(ok, P.AcquireOk) and sorted(x[0] for x in ok.slots) == [4, 5]
    # the released records were evicted for it
    assert {x[1] for x in ok.slots} == {held.slots[0][1], held.slots[1][1]}
    # a, over its share, gets no more until it is back under it
    assert a.rt(P.Acquire(a.req(), ha.model_id, 0, [0], True)).code == E.TOO_MANY_PINS


def test_too_many_pins_is_typed(tiny, model):
    a = Raw(tiny.socket)
    h = a.hello(model)
    err = a.rt(P.Acquire(a.req(), h.model_id, 0, [0, 1, 2, 3, 4], True))
    assert err.code == E.TOO_MANY_PINS
    assert isinstance(a.rt(P.Acquire(a.req(), h.model_id, 0, [0, 1, 2, 3], True)), P.AcquireOk)
    assert a.rt(P.Acquire(a.req(), h.model_id, 1, [0], True)).code == E.TOO_MANY_PINS
    # prefetches past the limit are not accepted: the count says how many were
    assert a.rt(P.Prefetch(a.req(), h.model_id, 1, [5, 6])).count == 0


def test_arena_eviction_and_pin_invariants():
    """Random operations on an in-process arena: a pinned or filling slot
    is never handed out again, and the LRU evicts the oldest unpinned."""
    name = f"/iod.{os.getuid()}.{os.getpid()}.9"
    native.shm_unlink(name)
    a = Arena(name, S.arena_bytes(8192, 6))
    try:
        a.layout(8192)
        assert a.slot_count == 6
        rnd = random.Random(3)
        filling, pinned = {}, {}  # key -> slot
        for step in range(3000):
            op = rnd.random()
            key = (1, rnd.randrange(3), rnd.randrange(8))
            if op < 0.35 and a.lookup(key) is None:
                s = a.allocate(key)
                if s is None:
                    assert all(x.state == S.FILLING or x.pins for x in a.slots)
                else:
                    assert s.index not in {x.index for x in filling.values()}
                    assert s.index not in {x.index for x in pinned.values()}
                    filling[key] = s
            elif op < 0.6 and filling:
                k = rnd.choice(sorted(filling))
                s = filling.pop(k)
                if rnd.random() < 0.1:
                    a.abandon(s)
                else:
                    a.publish(s, 100, 0)
                    gen = native.load_acquire_u64(a.buf, S.header_offset(s.index) + S.GENERATION_OFFSET)
                    assert gen == s.generation
            elif op < 0.8:
                s = a.lookup(key)
                if s is not None and s.state == S.READY and key not in pinned:
                    a.pin(s, 1)
                    pinned[key] = s
            elif pinned:
                k = rnd.choice(sorted(pinned))
                a.unpin(pinned.pop(k), 1)
            a.check()
        # LRU order: unpinned READY slots leave oldest first
        for k in list(pinned):
            a.unpin(pinned.pop(k), 1)
        for k, s in list(filling.items()):
            a.publish(s, 100, 0)
        n = 0
        while a.free:  # fill the free slots; they join the LRU as newest
            n += 1
            a.publish(a.allocate((3, 0, n)), 100, 0)
        order = list(a.lru)
        assert len(order) == a.slot_count
        for i, expect in enumerate(order):
            assert a.allocate((2, 0, i)).index == expect
        assert a.allocate((2, 1, 0)) is None  # all filling now
        a.check()
    finally:
        a.close()
        assert not os.path.exists("/dev/shm" + name)
