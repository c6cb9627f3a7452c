"""Random mixes of hints, demands, arena hits and unpins from several
sessions against a small arena: every demand gets exactly one terminal
reply, every granted or hit record holds the blob file's bytes while
pinned, and nothing leaks (pins, awaited records, queued reads)."""

import mmap
import os
import random

import numpy as np

import native
from shared import protocol as P
from shared import slots as S
from shared.blob import Manifest
from shared.fixtures import LiveDaemon, Raw, record_bytes, shm_entries, wait_for

E = P.ErrorCode
SHARE = 4  # 12 slots, 3 sessions


def _map(name, write):
    fd = native.shm_open_rw(name) if write else native.shm_open_readonly(name)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size,
                         prot=mmap.PROT_READ | (mmap.PROT_WRITE if write else 0))
    finally:
        os.close(fd)


def test_random_mix_no_leaks(model):
    m = Manifest.load(model)
    first = {}
    n = 0
    for l in m.layers:
        first[l.layer] = n
        n += l.num_experts
    d = LiveDaemon(args=["--arena", str(S.Layout(303104, 12).nbytes), "--workers", "2",
                         "--max-sessions", "3"])
    rnd = random.Random(7)
    try:
        sessions = []
        for _ in range(3):
            r = Raw(d.socket)
            r.h = r.hello(model)
            r.held = []  # slots this session pins, one entry per pin
            r.open = set()  # demand req ids awaiting their reply
            r.arena = _map(r.h.shm_name, False)
            r.pins = _map(r.h.pins_name, True)
            r.lay = S.Layout(r.h.slot_size, r.h.slot_count)
            r.pin_lay = S.PinLayout(r.h.slot_count, r.h.pin_rows)
            sessions.append(r)

        def check(r, layer, expert, slot):
            data = r.arena[r.lay.data(slot): r.lay.data(slot) + m.layer(layer).record_bytes]
            assert data == record_bytes(model, m.layer(layer), expert), (layer, expert, slot)

        def unpin(r, k):
            drop, r.held = r.held[:k], r.held[k:]
            native.unpin(r.pins, r.pin_lay.pins(r.h.pin_row), r.h.slot_count,
                         np.array(drop, np.int32))

        def handle(r, msg):
            assert msg.req_id in r.open, msg  # exactly one terminal reply
            r.open.discard(msg.req_id)
            if isinstance(msg, P.DemandOk):
                for ref in msg.refs:
                    check(r, msg.layer, ref.expert, ref.slot)
                    r.held.append(ref.slot)
            else:
                assert isinstance(msg, P.Error) and msg.code == E.QUEUE_FULL, msg

        for step in range(800):
            r = rnd.choice(sessions)
            layer = rnd.randrange(3)
            experts = rnd.sample(range(16), rnd.randint(1, 3))
            op = rnd.random()
            if op < 0.3:
                r.send(P.Prefetch(r.req(), r.h.model_id, step, [P.Hint(layer, experts, step + 1)]))
            elif op < 0.55:
                msg = P.Demand(r.req(), r.h.model_id, layer, experts, step)
                r.open.add(msg.req_id)
                r.send(msg)
            elif op < 0.75 and not r.open and len(set(r.held)) + len(experts) <= SHARE:
                # arena hits, pinned by the session alone — as a client does it:
                # not while a demand of its waits, and within its share
                arr = np.array(experts, np.int32)
                slots = np.empty(len(experts), np.int32)
                gens = np.empty(len(experts), np.uint64)
                native.pin_ready(r.arena, r.pins, r.lay.dir_word(r.h.dir_base + first[layer]),
                                 r.lay.headers_offset, r.h.slot_count,
                                 r.pin_lay.pins(r.h.pin_row), r.pin_lay.refs(r.h.pin_row),
                                 r.h.model_id, layer, arr, slots, gens)
                for e, s in zip(experts, slots.tolist()):
                    if s >= 0:
                        check(r, layer, e, s)
                        r.held.append(s)
            elif r.held:
                unpin(r, rnd.randint(1, len(r.held)))
            for s in sessions:  # take whatever has arrived
                while s.s.poll(0):
                    handle(s, s.recv())
            if step % 50 == 49:  # let queues drain: unpin everything, wait for replies
                for s in sessions:
                    while s.open:
                        handle(s, s.recv())
                    unpin(s, len(s.held))
        for s in sessions:
            while s.open:
                handle(s, s.recv())
            unpin(s, len(s.held))
        probe = sessions[0]
        stats = lambda: probe.rt(P.Stats(probe.req())).stats  # noqa: E731
        wait_for(lambda: stats()["queued_reads"] + stats()["inflight_reads"] == 0,
                 what="reads drained")
        st = stats()
        assert st["counters"]["internal_errors"] == 0 and st["counters"]["demands"] > 100
        assert all(x["pins"] == 0 and x["awaiting"] == 0 for x in st["sessions"]), st["sessions"]
        assert st["arena"]["slots"]["ready_pinned"] == 0
        for s in sessions:
            s.arena.close()
            s.pins.close()
    finally:
        assert d.stop() == 0
    assert not shm_entries(d.pid)
