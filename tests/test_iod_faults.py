"""Injected disk faults (IOD_FAULTS, test-only): typed errors to every
waiter, the daemon lives, and the next read of the record works."""

import pytest

from shared import protocol as P
from shared.blob import Manifest
from shared.fixtures import LiveDaemon, Raw, record_bytes, shm_entries, slot_bytes, unpin_refs

E = P.ErrorCode


FAULTS = "eio:2:3:1,short:2:5:1,corrupt:1:2:1,corrupt:1:4:2,eio:0:9:1"


@pytest.fixture(scope="module")
def daemon():
    # slow reads (2 MB/s; 150 ms for a layer-2 record): a second asker attaches
    # while the failing read is under way
    d = LiveDaemon(args=["--arena", "16M", "--workers", "2", "--read-rate", "2"],
                   env={"IOD_FAULTS": FAULTS})
    yield d
    assert d.stop() == 0
    assert not shm_entries(d.pid)


def _bytes_ok(model, daemon, hello, reply, layer):
    """The DemandOk's slots hold the blob file's bytes (read through the shm file)."""
    m = Manifest.load(model)
    for ref in reply.refs:
        assert slot_bytes(daemon, hello, ref) == record_bytes(model, m.layer(layer), ref.expert)


# layer-2 records no other test reads: queued ahead of the faulty one
FILLERS = [0, 1, 2, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]


def test_eio_then_next_read_works(daemon, model):
    a, b = Raw(daemon.socket), Raw(daemon.socket)
    ha, hb = a.hello(model), b.hello(model)
    # ~4 MB at 2 MB/s queued first in a's own queue: the faulty read of
    # expert 3 cannot start before b's request has attached to it, however
    # loaded the machine is
    a.send(P.Demand(10, ha.model_id, 2, FILLERS, 1))
    a.send(P.Demand(1, ha.model_id, 2, [3, 4], 2))
    b.send(P.Demand(2, hb.model_id, 2, [3], 1))
    ea, eb = a.until(1, timeout=30), b.until(2, timeout=30)
    for err in (ea, eb):  # every waiter of the record hears of it
        assert isinstance(err, P.Error) and err.code == E.IO_ERROR
        assert (err.layer, err.expert) == (2, 3) and "layer 2 expert 3" in err.message
    early = [m for m in a.notes if getattr(m, "req_id", None) == 10]
    fillers = early[0] if early else a.until(10, timeout=30)
    assert isinstance(fillers, P.DemandOk)
    unpin_refs(ha, fillers.refs)
    ok = a.rt(P.Demand(3, ha.model_id, 2, [3, 4], 3))
    assert isinstance(ok, P.DemandOk)
    _bytes_ok(model, daemon, ha, ok, 2)
    st = a.rt(P.Stats(4)).stats
    # the failed demand's other pin (expert 4) was undone; now 3 and 4 are pinned once
    assert st["sessions"][0]["pins"] == 2 and st["counters"]["read_errors"] >= 1


def test_short_read_is_io_error(daemon, model):
    r = Raw(daemon.socket)
    h = r.hello(model)
    err = r.rt(P.Demand(r.req(), h.model_id, 2, [5], 1))
    assert err.code == E.IO_ERROR and "short read" in err.message and err.expert == 5
    assert isinstance(r.rt(P.Demand(r.req(), h.model_id, 2, [5], 2)), P.DemandOk)


def test_transient_corruption_is_retried(daemon, model):
    r = Raw(daemon.socket)
    h = r.hello(model)
    before = r.rt(P.Stats(r.req())).stats["counters"]
    ok = r.rt(P.Demand(r.req(), h.model_id, 1, [2], 1))
    assert isinstance(ok, P.DemandOk)
    _bytes_ok(model, daemon, h, ok, 1)
    after = r.rt(P.Stats(r.req())).stats["counters"]
    assert after["retries"] == before["retries"] + 1
    assert after["checksum_errors"] == before["checksum_errors"] + 1


def test_persistent_corruption_fails_with_checksum(daemon, model):
    r = Raw(daemon.socket)
    h = r.hello(model)
    err = r.rt(P.Demand(r.req(), h.model_id, 1, [4], 1))
    assert err.code == E.CHECKSUM and (err.layer, err.expert) == (1, 4)
    ok = r.rt(P.Demand(r.req(), h.model_id, 1, [4], 2))
    _bytes_ok(model, daemon, h, ok, 1)


def test_failed_prefetch_leaves_nothing_and_a_demand_reads_again(daemon, model):
    from shared.fixtures import wait_for

    r = Raw(daemon.socket)
    h = r.hello(model)
    before = r.rt(P.Stats(r.req())).stats["counters"]["read_errors"]
    r.send(P.Prefetch(r.req(), h.model_id, 0, [P.Hint(0, [9], 1)]))  # a hint: no reply, no notice
    wait_for(lambda: r.rt(P.Stats(r.req())).stats["counters"]["read_errors"] == before + 1,
             what="the prefetch read failed")
    st = r.rt(P.Stats(r.req())).stats
    assert st["sessions"][-1]["awaiting"] == 0 and st["sessions"][-1]["pins"] == 0
    ok = r.rt(P.Demand(r.req(), h.model_id, 0, [9], 1))  # read again, fine this time
    _bytes_ok(model, daemon, h, ok, 0)


def test_client_error_names_layer_and_expert(model):
    from infer.runtime.client import IodClient, IodError

    d = LiveDaemon(args=["--arena", "16M"], env={"IOD_FAULTS": "corrupt:2:7:2"})
    try:
        with IodClient(model, iod=str(d.socket)) as c:
            with pytest.raises(IodError) as e:
                c.read(2, [6, 7])
            assert e.value.code == E.CHECKSUM and (e.value.layer, e.value.expert) == (2, 7)
            assert "layer 2 expert 7" in str(e.value)
            v = c.read(2, [6, 7])  # read again: fine now
            assert v[7] == record_bytes(model, Manifest.load(model).layer(2), 7)
            assert c.stats()["sessions"][0]["pins"] == 0  # the failed demand held nothing
    finally:
        d.stop()


def test_handler_bug_answers_internal_and_daemon_lives(model):
    d = LiveDaemon(args=["--arena", "16M"], env={"IOD_FAULTS": f"handler:{int(P.MsgKind.DEMAND)}:0:1"})
    try:
        r = Raw(d.socket)
        h = r.hello(model)
        err = r.rt(P.Demand(r.req(), h.model_id, 0, [1], 1))
        assert err.code == E.INTERNAL
        assert isinstance(r.rt(P.Demand(r.req(), h.model_id, 0, [1], 2)), P.DemandOk)
        assert r.rt(P.Stats(r.req())).stats["counters"]["internal_errors"] == 1
        assert "injected handler fault" in d.logtext()
    finally:
        assert d.stop() == 0


@pytest.mark.parametrize("hashers", [0, 1])
def test_checks_in_readers_or_hashers(model, hashers):
    from infer.runtime.client import IodClient, IodError

    d = LiveDaemon(args=["--arena", "16M", "--hashers", str(hashers)],
                   env={"IOD_FAULTS": "corrupt:0:1:2,corrupt:0:2:1"})
    try:
        with IodClient(model, iod=str(d.socket)) as c:
            with pytest.raises(IodError) as e:
                c.read(0, [1])
            assert e.value.code == E.CHECKSUM
            v = c.read(0, [1, 2, 3])  # 2 is read twice: the retry is clean
            m = Manifest.load(model)
            assert all(v[x] == record_bytes(model, m.layer(0), x) for x in v)
            assert c.stats()["counters"]["retries"] == 2
    finally:
        assert d.stop() == 0
