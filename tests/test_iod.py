"""The iod daemon, spawned as its own process, driven over its real socket."""

import os

import pytest

from tests.iod_fixtures import LiveDaemon, Raw, make_prep, record_bytes, shm_entries, wait_for
from shared import protocol as P
from shared.blob import Manifest


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model")
    make_prep(folder)
    return folder


@pytest.fixture
def daemon():
    d = LiveDaemon(args=["--arena", "32M", "--workers", "2"])
    yield d
    d.stop()
    assert not shm_entries(d.pid), "shm left behind"


def test_round_trip_every_kind(daemon, model):
    r = Raw(daemon.socket)
    h = r.hello(model)
    assert isinstance(h, P.HelloOk) and h.daemon_pid == daemon.pid and h.slot_count > 0
    m = Manifest.load(model)
    ok = r.rt(P.Prefetch(r.req(), h.model_id, 1, [3, 4]))
    assert isinstance(ok, P.Ok) and ok.count == 2
    readies = [r.recv() for _ in range(2)]
    assert all(isinstance(x, P.Ready) for x in readies)
    assert sorted(x.slot[0] for x in readies) == [3, 4]
    a = r.rt(P.Acquire(r.req(), h.model_id, 0, [0, 5], True))
    assert isinstance(a, P.AcquireOk) and sorted(ref[0] for ref in a.slots) == [0, 5]
    for ref in a.slots:
        assert ref[3] == m.layer(0).record_bytes
        assert ref[4] <= ref[5] <= ref[6] <= ref[7] <= ref[8]  # received..sent
    again = r.rt(P.Acquire(r.req(), h.model_id, 0, [0], True))
    assert again.slots[0][5:8] == [0, 0, 0]  # an arena hit has no read stamps
    rel = r.rt(P.Release(r.req(), [ref[1:3] for ref in a.slots]))
    assert isinstance(rel, P.Ok) and rel.count == 2
    c = r.rt(P.Cancel(r.req(), h.model_id, -1))
    assert isinstance(c, P.Ok)
    st = r.rt(P.Stats(r.req()))
    assert isinstance(st, P.StatsOk) and st.stats["sessions"][0]["pins"] == 2
    bye = r.rt(P.Bye(r.req()))
    assert isinstance(bye, P.Ok)
    r2 = Raw(daemon.socket)
    st = r2.rt(P.Stats(r2.req())).stats
    assert st["sessions"] == [] and st["arena"]["slots"]["ready_pinned"] == 0
    # a live session is told when the daemon stops
    r2.hello(model)
    daemon.stop()
    assert isinstance(r2.recv(), P.Shutdown)
    r.close()
    r2.close()


def test_client_bytes_equal(daemon, model):
    from infer.client import IodClient

    m = Manifest.load(model)
    with IodClient(model, iod=str(daemon.socket)) as c:
        assert c.daemon_pid == daemon.pid
        c.prefetch(2, range(8))
        for layout in m.layers:
            views = c.fetch(layout.layer, range(layout.num_experts))
            for e, v in views.items():
                assert v.readonly
                assert bytes(v) == record_bytes(model, layout, e)
            c.release(layout.layer, range(layout.num_experts))
        assert c.counters["ready_used"] > 0 or c.counters["acquired"] == 48
        st = c.stats()
        assert st["sessions"][0]["pins"] == 0
        assert st["counters"]["reads"] == 48
