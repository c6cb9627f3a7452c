"""Random request mixes from several sessions against a small arena: every
request gets exactly one terminal reply, nothing leaks (pins, queued claims),
and every AcquireOk's bytes are the blob file's. Pins are counted: each
granted SlotRef is one pin, each released pair drops one."""

import random


from shared import protocol as P
from shared.blob import Manifest
from shared import slots as S
from tests.iod_fixtures import LiveDaemon, Raw, record_bytes, shm_entries

E = P.ErrorCode


def test_random_mix_no_leaks(model):
    m = Manifest.load(model)
    d = LiveDaemon(args=["--arena", str(S.arena_bytes(303104, 12)), "--workers", "2",
                         "--max-pins", "6"])
    rnd = random.Random(7)
    try:
        sessions = []
        for _ in range(3):
            r = Raw(d.socket)
            r.h = r.hello(model)
            r.held = {}  # slot -> [generation, pins]
            r.open = set()  # req ids awaiting a terminal reply
            sessions.append(r)
        shm = open("/dev/shm" + d.shm_name(), "rb")

        def grant(r, ref):
            h = r.held.setdefault(ref[1], [ref[2], 0])
            assert h[0] == ref[2], "a pinned slot changed generation"
            h[1] += 1

        def release_pairs(r, slots):
            pairs = []
            for s in slots:
                gen, n = r.held[s]
                pairs.append([s, gen])
                if n == 1:
                    del r.held[s]
                else:
                    r.held[s][1] = n - 1
            return pairs

        def release_all(r):
            return [p for s in list(r.held) for p in release_pairs(r, [s] * r.held[s][1])]

        def handle(r, msg):
            if isinstance(msg, P.Ready):
                grant(r, msg.slot)
            elif isinstance(msg, P.AcquireOk):
                r.open.discard(msg.req_id)
                for ref in msg.slots:
                    grant(r, ref)
                    shm.seek(r.h.data_offset + ref[1] * r.h.slot_size)
                    assert shm.read(ref[3]) == record_bytes(model, m.layer(msg.layer), ref[0])
            elif isinstance(msg, (P.Ok, P.Error)):
                assert msg.req_id in r.open, msg  # exactly one terminal reply
                r.open.discard(msg.req_id)
                if isinstance(msg, P.Error):
                    assert msg.code in (E.TOO_MANY_PINS, E.QUEUE_FULL), msg

        for step in range(600):
            r = rnd.choice(sessions)
            layer = rnd.randrange(3)
            experts = rnd.sample(range(16), rnd.randint(1, 3))
            op = rnd.random()
            if op < 0.3:
                msg = P.Prefetch(r.req(), r.h.model_id, layer, experts)
            elif op < 0.55:
                msg = P.Acquire(r.req(), r.h.model_id, layer, experts, rnd.random() < 0.8)
            elif op < 0.9 and r.held:
                msg = P.Release(r.req(), release_pairs(r, rnd.sample(sorted(r.held), min(2, len(r.held)))))
            else:
                msg = P.Cancel(r.req(), r.h.model_id, rnd.choice([-1, layer]))
            r.open.add(msg.req_id)
            r.send(msg)
            for s in sessions:  # take whatever has arrived
                while s.s.poll(0):
                    handle(s, s.recv())
            if step % 50 == 49:  # let queues drain: release everything, wait for replies
                for s in sessions:
                    if s.held:
                        rel = P.Release(s.req(), release_all(s))
                        s.open.add(rel.req_id)
                        s.send(rel)
                for s in sessions:
                    while s.open:
                        handle(s, s.recv())
                    # late Readies of prefetches
                for s in sessions:
                    while s.s.poll(100):
                        handle(s, s.recv())
        for s in sessions:
            while s.open:
                handle(s, s.recv())
            while s.s.poll(200):
                handle(s, s.recv())
            if s.held:
                s.rt(P.Release(s.req(), release_all(s)))
        st = sessions[0].rt(P.Stats(sessions[0].req())).stats
        assert st["counters"]["internal_errors"] == 0
        assert all(x["pins"] == 0 and x["queued"] == 0 for x in st["sessions"]), st["sessions"]
        assert st["arena"]["slots"]["ready_pinned"] == 0 and st["queued_reads"] == 0
        shm.close()
    finally:
        assert d.stop() == 0
    assert not shm_entries(d.pid)
