"""The daemon's core driven in-process with a reader that completes reads on
command: queues, fairness, promotion, coalescing, prefetch expiry, fair
shares served in waves, pins in the arena, eviction, failures. Deterministic:
no daemon process, no slowed disk, no timing."""

import os
import threading

import numpy as np
import pytest

import native
from iod.arena import Arena
from iod.core import Config, Core, Failure
from iod.reader import Faults
from iod.sched import DEMAND, PREFETCH
from shared import protocol as P
from shared import slots as S
from shared.blob import Manifest, manifest_hash, record_checksum
from shared.fixtures import make_prep, record_bytes

E = P.ErrorCode


class FakeReader:
    """Holds submitted reads until the test completes them, in any order."""

    def __init__(self):
        self.jobs = []
        self.classes = {}

    def submit(self, job, cls):
        self.classes[id(job)] = cls
        self.jobs.append(job)

    def cls(self, job):
        return self.classes[id(job)]

    def take(self, key=None):
        job = self.jobs[0] if key is None else next(j for j in self.jobs if j.key == key)
        self.jobs.remove(job)
        return job

    def keys(self):
        return [j.key for j in self.jobs]


def finish(core, folder, job, error=None, corrupt=False):
    """Do the read ``job`` asks for (from the blob file) and hand it back."""
    layout = core.models[job.key[0]].layouts[job.layer]
    data = record_bytes(folder, layout, job.expert)
    job.read_start, job.read_end = 1, 2
    if error is None:
        job.dest[: len(data)] = data
        if corrupt:
            job.dest[0] ^= 0xFF
        job.got = job.nbytes
        ok = record_checksum(job.layer, job.expert, job.dest[: job.record_bytes]) == job.checksum
        job.error = None if ok else ("CHECKSUM", "record checksum mismatch")
    else:
        job.error = error
    core.completed(job)


class Harness:
    """A core with a fake reader, and sessions that speak to it."""

    def __init__(self, folder, slots=12, workers=2, **cfg):
        self.folder = folder
        self.manifest = Manifest.load(folder)
        stride = self.manifest.max_stride
        size = S.Layout(stride, slots).nbytes
        self.arena = Arena(None, size, anonymous=True)
        self.reader = FakeReader()
        self.now = 0  # the core's clock (ns), moved by the test
        self.core = Core(Config(arena_size=size, workers=workers, **cfg), self.arena, self.reader,
                         Faults(), clock=lambda: self.now)
        self.req = 0

    def call(self, ident, msg_cls, *fields):
        self.req += 1
        msg = msg_cls(self.req, *fields)
        self.core.handle(ident, msg, 0)
        self.core.pump()
        return self.req

    def hello(self, ident, working_set=1, mhash=None):
        rid = self.call(ident, P.Hello, P.PROTOCOL_VERSION, os.getpid(), str(self.folder),
                        mhash or manifest_hash(self.folder), working_set, True)
        return self.reply(ident, rid)

    def reply(self, ident, req_id):
        for i, (who, msg) in enumerate(self.core.outbox):
            if who == ident and getattr(msg, "req_id", None) == req_id:
                del self.core.outbox[i]
                return msg
        return None

    def demand(self, ident, mid, layer, experts, now=0):
        return self.call(ident, P.Demand, mid, layer, experts, now)

    def prefetch(self, ident, mid, layer, experts, now=0, due=1):
        self.call(ident, P.Prefetch, mid, now, [P.Hint(layer, experts, due)])

    def row(self, hello):
        return self.arena._pins[hello.pin_row]

    def unpin_all(self, hello, refs):
        native.unpin(self.arena.pins_buf, self.arena.pin_layout.pins(hello.pin_row),
                     self.arena.slot_count, np.array([r.slot for r in refs], np.int32))

    def finish(self, key=None, **kw):
        finish(self.core, self.folder, self.reader.take(key), **kw)
        self.core.pump()


@pytest.fixture
def folder(tmp_path):
    make_prep(tmp_path / "m", records=(40_000, 40_000, 40_000), num_experts=16)
    return tmp_path / "m"


def test_demand_goes_before_queued_prefetch(folder):
    h = Harness(folder, workers=1)  # two reads in flight, at most one a prefetch
    a, b = h.hello(b"a"), h.hello(b"b")
    h.prefetch(b"a", a.model_id, 0, list(range(6)))
    assert [h.reader.cls(j) for j in h.reader.jobs] == [PREFETCH]
    rid = h.demand(b"b", b.model_id, 1, [3])  # starts at once, ahead of five queued prefetches
    assert [h.reader.cls(j) for j in h.reader.jobs] == [PREFETCH, DEMAND]
    assert h.reader.jobs[-1].key == (b.model_id, 1, 3)
    h.finish((b.model_id, 1, 3))
    ok = h.reply(b"b", rid)
    assert [r.expert for r in ok.refs] == [3]
    assert ok.stamps[0][2] == 1  # read for it: the read's own stamps


def test_sessions_take_turns(folder):
    h = Harness(folder, workers=1)
    a, b = h.hello(b"a"), h.hello(b"b")
    h.prefetch(b"a", a.model_id, 0, list(range(6)))
    h.prefetch(b"b", b.model_id, 2, list(range(6)))
    order = []
    while h.reader.jobs:
        job = h.reader.jobs[0]
        order.append("a" if job.layer == 0 else "b")
        h.finish()
    # the first two were handed over before b asked; from then on, while both
    # have reads queued, they alternate
    assert order[:2] == ["a", "a"] and "".join(order[2:10]) in ("abababab", "babababa")


def test_demand_promotes_a_queued_prefetch_and_reads_once(folder):
    h = Harness(folder, workers=1)
    a, b = h.hello(b"a"), h.hello(b"b")
    h.prefetch(b"a", a.model_id, 0, [0, 1, 2, 3, 4])
    rid = h.demand(b"b", b.model_id, 0, [4])  # queued behind 1, 2, 3 as a prefetch
    assert h.core.sched.promoted == 1
    assert h.reader.jobs[-1].key == (a.model_id, 0, 4) and h.reader.cls(h.reader.jobs[-1]) == DEMAND
    h.finish((a.model_id, 0, 4))
    assert h.reply(b"b", rid).refs[0].expert == 4
    while h.reader.jobs:
        h.finish()
    assert h.core.c["reads"] == 5  # one read of expert 4, for both


def test_a_hint_due_now_is_read_as_demand_ahead_of_queued_prefetches(folder):
    """A session's own misses, hinted before its DEMAND (due at its current
    call), go ahead of its queued guesses: a new read as a demand read, a
    queued prefetch promoted; the DEMAND that follows waits on that read."""
    h = Harness(folder, workers=1)  # two reads in flight, at most one a prefetch
    a = h.hello(b"a")
    h.prefetch(b"a", a.model_id, 0, [0, 1, 2, 3], now=5, due=6)  # 0 starts, 1-3 queued
    h.prefetch(b"a", a.model_id, 1, [7], now=5, due=5)  # due now: starts at once
    h.prefetch(b"a", a.model_id, 0, [3], now=5, due=5)  # queued prefetch: promoted
    assert h.core.sched.promoted == 1
    assert [(j.key[1:], h.reader.cls(j)) for j in h.reader.jobs] == \
        [((0, 0), PREFETCH), ((1, 7), DEMAND)]
    h.finish((a.model_id, 0, 0))
    assert [(j.key[1:], h.reader.cls(j)) for j in h.reader.jobs] == \
        [((1, 7), DEMAND), ((0, 3), DEMAND)]
    rid = h.demand(b"a", a.model_id, 1, [7], now=5)
    assert h.core.c["reads"] == 1 and len(h.reader.jobs) == 2  # no second read of 7
    assert h.core.c["prefetch_reads"] == 1  # the misses are not counted as prefetches
    h.finish((a.model_id, 1, 7))
    assert [r.expert for r in h.reply(b"a", rid).refs] == [7]


def test_two_sessions_demanding_one_record_share_one_read(folder):
    h = Harness(folder)
    a, b = h.hello(b"a"), h.hello(b"b")
    ra, rb = h.demand(b"a", a.model_id, 2, [7]), h.demand(b"b", b.model_id, 2, [7])
    assert h.reader.keys() == [(a.model_id, 2, 7)]
    h.finish()
    oa, ob = h.reply(b"a", ra), h.reply(b"b", rb)
    assert oa.refs[0].slot == ob.refs[0].slot
    slot = oa.refs[0].slot
    assert h.row(a)[slot] == 1 and h.row(b)[slot] == 1  # each pinned once, in its own row
    data = bytes(h.arena.data(slot, oa.refs[0].size))
    assert data == record_bytes(folder, h.manifest.layer(2), 7)


def test_ready_records_are_in_the_directory_and_granted_without_a_read(folder):
    h = Harness(folder)
    a = h.hello(b"a")
    h.finish() if h.reader.jobs else None
    rid = h.demand(b"a", a.model_id, 1, [5])
    h.finish()
    ref = h.reply(b"a", rid).refs[0]
    entry = h.core.models[a.model_id].entry(1, 5)
    assert native.load_u32(h.arena.buf, h.arena.lay.dir_word(entry)) == ref.slot + 1
    h.unpin_all(a, [ref])
    rid = h.demand(b"a", a.model_id, 1, [5])
    ok = h.reply(b"a", rid)  # answered at once
    assert ok.refs == [ref] and ok.stamps[0][2] == 0 and not h.reader.jobs
    h.arena.check()


def test_late_prefetches_are_dropped(folder):
    h = Harness(folder, workers=1)
    a = h.hello(b"a")
    h.prefetch(b"a", a.model_id, 0, [0, 1, 2, 3, 4, 5], now=10, due=11)
    h.prefetch(b"a", a.model_id, 1, [0, 1], now=10, due=13)
    assert h.core.sched.queued() == 7  # one prefetch in flight
    # the session moved on to call 12: the layer-0 guesses came due unread
    h.demand(b"a", a.model_id, 2, [9], now=12)
    assert h.core.sched.queued(PREFETCH) == 2 and h.core.sched.dropped == 5


def test_a_demand_over_the_share_is_served_in_waves(folder):
    h = Harness(folder, slots=6)
    a, b = h.hello(b"a"), h.hello(b"b")
    h.hello(b"c")  # three sessions: a share of 2 slots each
    assert h.core.share() == 2
    rid = h.demand(b"a", a.model_id, 0, [0, 1, 2, 3, 4])
    while h.reader.jobs:
        h.finish()
    first = h.reply(b"a", rid)
    assert [r.expert for r in first.refs] == [0, 1] and h.core.c["short_grants"] == 1
    # at its share: nothing more until it unpins, but never an error
    rid = h.demand(b"a", a.model_id, 0, [2, 3, 4])
    assert h.reply(b"a", rid).refs == []
    h.unpin_all(a, first.refs)
    rid = h.demand(b"a", a.model_id, 0, [2, 3, 4])
    while h.reader.jobs:
        h.finish()
    assert [r.expert for r in h.reply(b"a", rid).refs] == [2, 3]
    # the others still have their room
    rid = h.demand(b"b", b.model_id, 1, [0, 1])
    while h.reader.jobs:
        h.finish()
    assert len(h.reply(b"b", rid).refs) == 2


def test_admission_keeps_every_session_its_working_set(folder):
    h = Harness(folder, slots=6)
    h.hello(b"a", working_set=3)
    with pytest.raises(Failure) as e:
        h.hello(b"b", working_set=4)
    assert e.value.code == E.TOO_MANY_SESSIONS and "fewer than the 4" in str(e.value)
    assert h.hello(b"b", working_set=3).session_id == 2


def test_reads_wait_for_pins_to_drop_and_go_on_after(folder):
    h = Harness(folder, slots=3)
    a = h.hello(b"a", working_set=1)
    rid = h.demand(b"a", a.model_id, 0, [0, 1, 2])
    while h.reader.jobs:
        h.finish()
    held = h.reply(b"a", rid).refs
    assert len(held) == 3
    h.prefetch(b"a", a.model_id, 1, [0])
    assert not h.reader.jobs and h.core.blocked  # every slot pinned
    h.unpin_all(a, held[:1])
    h.core.pump()
    assert h.reader.keys() == [(a.model_id, 1, 0)]
    h.finish()
    h.arena.check()


def test_eviction_skips_what_a_session_pinned_and_gives_hits_a_second_chance(folder):
    h = Harness(folder, slots=4)
    a = h.hello(b"a")
    rid = h.demand(b"a", a.model_id, 0, [0, 1, 2, 3])
    while h.reader.jobs:
        h.finish()
    refs = h.reply(b"a", rid).refs
    h.unpin_all(a, refs)
    # the session pins expert 0 itself (an arena hit, no message) and has hit 1
    slots = np.empty(2, np.int32)
    gens = np.empty(2, np.uint64)
    first = h.core.models[a.model_id].entry(0, 0)
    lay = h.arena.lay
    n = native.pin_ready(h.arena.buf, h.arena.pins_buf, lay.dir_word(first), lay.headers_offset,
                         lay.slot_count, h.arena.pin_layout.pins(a.pin_row),
                         h.arena.pin_layout.refs(a.pin_row), a.model_id, 0,
                         np.array([0, 1], np.int32), slots, gens)
    assert n == 2
    native.unpin(h.arena.pins_buf, h.arena.pin_layout.pins(a.pin_row), lay.slot_count, slots[1:])
    for s in h.arena.slots:
        s.fresh = False  # as if the hand had passed once since they were filled
    rid = h.demand(b"a", a.model_id, 1, [0, 1])
    assert len(h.reader.jobs) == 2
    gone = [s for s in refs if native.load_u32(h.arena.buf, lay.dir_word(
        h.core.models[a.model_id].entry(0, s.expert))) == 0]
    assert {r.expert for r in gone} == {2, 3}  # not 0 (pinned), not 1 (hit)
    while h.reader.jobs:
        h.finish()
    h.arena.check()


def test_eviction_loses_to_a_pin_taken_in_the_race(folder):
    h = Harness(folder, slots=2)
    a = h.hello(b"a")
    rid = h.demand(b"a", a.model_id, 0, [0, 1])
    while h.reader.jobs:
        h.finish()
    refs = h.reply(b"a", rid).refs
    h.unpin_all(a, refs)
    s0 = h.arena.slots[refs[0].slot]
    # the daemon zeroes the generation; a session pins just before it re-checks
    real = native.pinned
    native_pinned_calls = []

    def pinned(*args):
        native.add_u32(h.arena.pins_buf, h.arena.pin_layout.pins(a.pin_row) + 4 * s0.index, 1)
        native_pinned_calls.append(args)
        return real(*args)

    import iod.arena as arena_mod

    arena_mod.native.pinned, saved = pinned, arena_mod.native.pinned
    try:
        assert not h.arena._evict(s0)
    finally:
        arena_mod.native.pinned = saved
    assert native_pinned_calls
    assert native.load_u64(h.arena.buf, h.arena.lay.generation(s0.index)) == s0.generation
    assert s0.state == S.READY
    h.arena.check()


def test_ended_session_releases_pins_and_its_waits(folder):
    h = Harness(folder)
    a = h.hello(b"a")
    h.hello(b"b")
    rid = h.demand(b"a", a.model_id, 0, [1, 2])
    h.finish()
    h.core.end_session(h.core.by_ident[b"a"], "test")
    h.finish()
    assert h.reply(b"a", rid) is None  # nobody to answer
    assert not h.row(a).any()
    assert h.hello(b"c").pin_row == a.pin_row  # the row is reused, clean
    h.arena.check()


def test_transient_corruption_is_read_again_and_persistent_fails(folder):
    h = Harness(folder)
    a = h.hello(b"a")
    rid = h.demand(b"a", a.model_id, 0, [3])
    h.finish(corrupt=True)  # read again once
    assert h.core.c["retries"] == 1 and h.reader.jobs
    h.finish()
    first = h.reply(b"a", rid).refs
    assert first[0].expert == 3
    h.unpin_all(a, first)
    rid = h.demand(b"a", a.model_id, 0, [4, 5])
    h.finish((a.model_id, 0, 5))
    h.finish((a.model_id, 0, 4), corrupt=True)
    h.finish((a.model_id, 0, 4), corrupt=True)
    err = h.reply(b"a", rid)
    assert isinstance(err, P.Error) and err.code == E.CHECKSUM and err.expert == 4
    assert not h.row(a).any()  # expert 5's grant was undone with the demand
    h.arena.check()


def test_io_error_fails_the_demand_and_the_next_read_works(folder):
    h = Harness(folder)
    a = h.hello(b"a")
    rid = h.demand(b"a", a.model_id, 1, [2])
    h.finish(error=("IO_ERROR", "read failed: Input/output error"))
    err = h.reply(b"a", rid)
    assert err.code == E.IO_ERROR and "layer 1 expert 2" in err.message
    rid = h.demand(b"a", a.model_id, 1, [2])
    h.finish()
    assert h.reply(b"a", rid).refs[0].expert == 2


def test_a_changed_prep_folder_is_refused(folder):
    h = Harness(folder)
    with pytest.raises(Failure) as e:
        h.hello(b"a", mhash="0" * 16)
    assert e.value.code == E.MODEL_CHANGED and "changed since the session loaded it" in str(e.value)


def test_out_of_range_and_no_session(folder):
    h = Harness(folder)
    with pytest.raises(Failure) as e:
        h.demand(b"x", 1, 0, [0])
    assert e.value.code == E.NO_SESSION
    a = h.hello(b"a")
    for layer, experts in ((9, [0]), (0, [16]), (0, [-1])):
        with pytest.raises(Failure) as e:
            h.demand(b"a", a.model_id, layer, experts)
        assert e.value.code == E.OUT_OF_RANGE


def test_one_prefetch_hints_several_layers_all_or_none(folder):
    h = Harness(folder, workers=1)
    a = h.hello(b"a")
    h.call(b"a", P.Prefetch, a.model_id, 0, [P.Hint(0, [1, 2], 1), P.Hint(2, [5], 2)])
    assert sorted(h.core.sched.reads) == [(a.model_id, 0, 1), (a.model_id, 0, 2), (a.model_id, 2, 5)]
    while h.reader.jobs:
        h.finish()
    # a bad hint refuses the message: its good hints are not read either
    with pytest.raises(Failure) as e:
        h.call(b"a", P.Prefetch, a.model_id, 0, [P.Hint(1, [3], 1), P.Hint(9, [0], 2)])
    assert e.value.code == E.OUT_OF_RANGE
    assert not h.core.sched.reads


def test_a_read_queued_for_an_ended_session_serves_the_next_asker(folder):
    h = Harness(folder, workers=1)
    a, b = h.hello(b"a"), h.hello(b"b")
    h.demand(b"a", a.model_id, 0, [0, 1, 2, 3])  # two in flight, two queued
    h.core.end_session(h.core.by_ident[b"a"], "test")
    rid = h.demand(b"b", b.model_id, 0, [3])  # queued for a, who is gone
    while h.reader.jobs:
        h.finish()
    assert [r.expert for r in h.reply(b"b", rid).refs] == [3]
    assert not h.core.sched.reads


def test_prefetches_fill_at_most_half_the_reads_in_flight(folder):
    h = Harness(folder, workers=2)  # four reads in flight at most, two of them prefetches
    a = h.hello(b"a")
    h.prefetch(b"a", a.model_id, 0, list(range(8)))
    assert len(h.reader.jobs) == 2 and h.core.prefetching == 2
    rid = h.demand(b"a", a.model_id, 1, [0, 1, 2])  # the demand takes the free readers at once
    assert [h.reader.cls(j) for j in h.reader.jobs] == [PREFETCH, PREFETCH, DEMAND, DEMAND]
    h.finish()  # a prefetch ends: the demand's third record goes before the next prefetch
    assert h.reader.cls(h.reader.jobs[-1]) == DEMAND and h.core.prefetching == 1
    while h.reader.jobs:
        h.finish()
    assert [r.expert for r in h.reply(b"a", rid).refs] == [0, 1, 2]
    assert h.core.prefetching == 0 and h.core.c["prefetch_reads"] == 8


def test_a_demand_finds_a_reader_free_while_the_prefetches_are_read(folder, monkeypatch):
    """One worker (a disk whose ceiling comes at depth 1): the daemon's pool
    (Config.readers threads) starts a demand while a prefetch's read is
    still going, instead of queueing it behind."""
    from iod import reader as reader_mod

    held, release = threading.Event(), threading.Event()
    read = reader_mod.ReaderPool._read

    def slow_prefetch(pool, job):
        if job.layer == 0:  # the prefetched layer's reads take until the test lets them go
            held.set()
            release.wait(10)
        read(pool, job)

    monkeypatch.setattr(reader_mod.ReaderPool, "_read", slow_prefetch)
    h = Harness(folder, workers=1)
    pool = reader_mod.ReaderPool(h.core.cfg.readers, None)
    h.core.reader = pool
    try:
        a = h.hello(b"a")
        h.prefetch(b"a", a.model_id, 0, [0, 1, 2])
        assert held.wait(5) and h.core.prefetching == 1
        rid = h.demand(b"a", a.model_id, 1, [3])
        job = pool.done.get(timeout=5)  # while the prefetch is held
        assert job.key == (a.model_id, 1, 3) and job.error is None
        h.core.completed(job)
        assert [r.expert for r in h.reply(b"a", rid).refs] == [3]
    finally:
        release.set()
        pool.stop(5)


def test_a_demanded_record_is_checked_by_its_reader_not_behind_the_prefetched_ones(folder, monkeypatch):
    """A record a demand waits for is checked by the thread that read it, at
    once: it completes while the one checksum thread is held on a prefetched
    record and two more prefetched records wait for it."""
    from iod import reader as reader_mod

    first, go, order = threading.Event(), threading.Event(), []
    verify = reader_mod.ReaderPool._verify

    def held_verify(pool, job):
        order.append(job.key[1:])
        if len(order) == 1:  # the hasher is busy while the others finish reading
            first.set()
            go.wait(10)
        verify(pool, job)

    monkeypatch.setattr(reader_mod.ReaderPool, "_verify", held_verify)
    h = Harness(folder, workers=4)
    pool = reader_mod.ReaderPool(h.core.cfg.readers, None, hashers=1)
    h.core.reader = pool
    try:
        a = h.hello(b"a")
        h.prefetch(b"a", a.model_id, 0, [0])
        assert first.wait(5)
        h.prefetch(b"a", a.model_id, 0, [1, 2])
        rid = h.demand(b"a", a.model_id, 1, [3])
        job = pool.done.get(timeout=5)  # while the hasher is held
        assert job.key[1:] == (1, 3) and job.error is None
        h.core.completed(job)
        assert [r.expert for r in h.reply(b"a", rid).refs] == [3]
        go.set()
        for _ in range(3):
            h.core.completed(pool.done.get(timeout=5))
        assert order[:2] == [(0, 0), (1, 3)] and sorted(order[2:]) == [(0, 1), (0, 2)]
    finally:
        go.set()
        pool.stop(5)


def test_a_demand_on_a_prefetch_being_read_makes_it_urgent(folder):
    h = Harness(folder, workers=1)
    a = h.hello(b"a")
    h.prefetch(b"a", a.model_id, 0, [5])
    job = h.reader.jobs[0]
    assert not job.urgent
    h.demand(b"a", a.model_id, 0, [5])
    assert job.urgent and h.reader.jobs == [job]


# ---- pins have a deadline ---------------------------------------------------------------


def owner(h, hello):
    return native.load_u64(h.arena.pins_buf, h.arena.pin_layout.owner(hello.pin_row))


def hold_the_arena(h, ident):
    """``ident`` alone demands every slot and keeps the pins (a share of all)."""
    hello = h.hello(ident)
    rid = h.demand(ident, hello.model_id, 0, list(range(h.arena.slot_count)))
    while h.reader.jobs:
        h.finish()
    assert len(h.reply(ident, rid).refs) == h.arena.slot_count
    return hello


def test_a_silent_session_over_its_share_loses_its_pins_at_the_deadline(folder):
    """One session pinned all 12 slots while alone, then stopped reading; the
    next one's read waits for a slot until the first has said nothing for
    pin_timeout_s since its grant, then goes on. The first keeps its (cleared)
    row, its owner word zeroed; its requests get PINS_EXPIRED; BYE ends it."""
    h = Harness(folder, slots=12, pin_timeout_s=5.0)
    a = hold_the_arena(h, b"a")
    assert owner(h, a) == a.session_id
    b = h.hello(b"b")
    assert h.core.share() == 6
    rid = h.demand(b"b", b.model_id, 1, [0, 1])
    assert not h.reader.jobs and h.core.blocked  # every slot pinned by a
    h.now += int(4.9e9)
    h.core.tick()
    h.core.pump()
    assert not h.reader.jobs and h.arena.held(a.pin_row) == 12  # before the deadline: kept
    h.now += int(0.1e9)
    h.core.tick()
    assert h.arena.held(a.pin_row) == 0 and owner(h, a) == 0
    assert h.core.c["pins_expired"] == 1 and h.core.share() == 12  # a has no share now
    h.core.pump()
    while h.reader.jobs:
        h.finish()
    assert [r.expert for r in h.reply(b"b", rid).refs] == [0, 1]
    st = h.core.stats()
    assert [(x["id"], x["expired"]) for x in st["sessions"]] == [(a.session_id, True),
                                                                (b.session_id, False)]
    with pytest.raises(Failure) as e:  # it wakes
        h.demand(b"a", a.model_id, 2, [0])
    assert e.value.code == E.PINS_EXPIRED
    assert "pins were taken back" in str(e.value) and "nothing for 5 s" in str(e.value)
    h.core.tick()
    assert h.core.c["pins_expired"] == 1  # counted once
    rid = h.call(b"a", P.Bye)
    assert isinstance(h.reply(b"a", rid), P.Ok) and len(h.core.sessions) == 1
    assert h.hello(b"c").pin_row == a.pin_row and h.core.share() == 6  # its row, clean again
    h.arena.check()


def test_the_deadline_runs_from_the_last_word_and_spares_shares_and_waits(folder):
    """Only pins beyond the session's share are at stake, only while a read
    waits for a slot, and a session that talks (any request) or was just
    granted records keeps them."""
    h = Harness(folder, slots=12, pin_timeout_s=5.0)
    a = hold_the_arena(h, b"a")
    b = h.hello(b"b")
    h.now += int(100e9)  # long silent, but nobody waits for a slot: kept
    h.core.tick()
    assert h.arena.held(a.pin_row) == 12 and not h.core.blocked
    h.call(b"a", P.Stats)  # a word from it
    rid = h.demand(b"b", b.model_id, 1, [0])
    assert h.core.blocked
    h.now += int(4e9)
    h.core.tick()
    assert h.arena.held(a.pin_row) == 12  # 4 s since its last word
    h.now += int(1e9)
    h.core.tick()
    assert h.arena.held(a.pin_row) == 0  # 5 s
    h.core.pump()
    h.finish()
    assert len(h.reply(b"b", rid).refs) == 1

    # within its share: kept however long it is silent
    h = Harness(folder, slots=12, pin_timeout_s=5.0)
    a, b = h.hello(b"a"), h.hello(b"b")
    held = {}
    for ident, hello, layer in ((b"a", a, 0), (b"b", b, 1)):
        rid = h.demand(ident, hello.model_id, layer, list(range(6)))
        while h.reader.jobs:
            h.finish()
        held[ident] = h.reply(ident, rid).refs
    h.prefetch(b"b", b.model_id, 2, [0])
    assert not h.reader.jobs and h.core.blocked  # every slot pinned, each session at its share
    h.now += int(1000e9)
    h.core.tick()
    assert h.arena.held(a.pin_row) == 6 and h.arena.held(b.pin_row) == 6
    assert h.core.c["pins_expired"] == 0
    h.unpin_all(b, held[b"b"][:1])
    h.core.pump()
    assert h.reader.keys() == [(b.model_id, 2, 0)]

    # --pin-timeout inf: never
    h = Harness(folder, slots=12, pin_timeout_s=float("inf"))
    a = hold_the_arena(h, b"a")
    b = h.hello(b"b")
    h.demand(b"b", b.model_id, 1, [0])
    h.now += int(1e15)
    h.core.tick()
    assert h.arena.held(a.pin_row) == 12 and h.core.stats()["pin_timeout_s"] is None
