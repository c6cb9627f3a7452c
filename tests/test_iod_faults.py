"""Injected disk faults (IOD_FAULTS, test-only): typed errors to every
waiter, the daemon lives, and the next read of the record works."""

import pytest

from shared import protocol as P
from shared.blob import Manifest
from tests.iod_fixtures import LiveDaemon, Raw, record_bytes, shm_entries

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
    """The AcquireOk's slots hold the blob file's bytes (read through the shm file)."""
    m = Manifest.load(model)
    with open("/dev/shm" + daemon.shm_name(), "rb") as f:
        for ref in reply.slots:
            off = hello.data_offset + ref[1] * hello.slot_size
            f.seek(off)
            assert f.read(ref[3]) == record_bytes(model, m.layer(layer), ref[0])


# layer-2 records no other test reads: queued ahead of the faulty one
FILLERS = [0, 1, 2, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]


def test_eio_then_next_read_works(daemon, model):
    a, b = Raw(daemon.socket), Raw(daemon.socket)
    ha, hb = a.hello(model), b.hello(model)
    # ~4 MB at 2 MB/s queued first in a's own queue: the faulty read of
    # expert 3 cannot start before b's request has attached to it, however
    # loaded the machine is
    a.send(P.Acquire(10, ha.model_id, 2, FILLERS, True))
    a.send(P.Acquire(1, ha.model_id, 2, [3, 4], True))
    b.send(P.Acquire(2, hb.model_id, 2, [3], True))
    ea, eb = a.until(1, timeout=30), b.until(2, timeout=30)
    for err in (ea, eb):  # every waiter of the record hears of it
        assert isinstance(err, P.Error) and err.code == E.IO_ERROR
        assert (err.layer, err.expert) == (2, 3) and "layer 2 expert 3" in err.message
    early = [m for m in a.notes if getattr(m, "req_id", None) == 10]
    fillers = early[0] if early else a.until(10, timeout=30)
    assert isinstance(fillers, P.AcquireOk)
    assert isinstance(a.rt(P.Release(11, [[r[1], r[2]] for r in fillers.slots])), P.Ok)
    ok = a.rt(P.Acquire(3, ha.model_id, 2, [3, 4], True))
    assert isinstance(ok, P.AcquireOk)
    _bytes_ok(model, daemon, ha, ok, 2)
    st = a.rt(P.Stats(4)).stats
    # the failed acquire's other pin (expert 4) was undone; now 3 and 4 are pinned once
    assert st["sessions"][0]["pins"] == 2 and st["counters"]["read_errors"] >= 1


def test_short_read_is_io_error(daemon, model):
    r = Raw(daemon.socket)
    h = r.hello(model)
    err = r.rt(P.Acquire(r.req(), h.model_id, 2, [5], True))
    assert err.code == E.IO_ERROR and "short read" in err.message and err.expert == 5
    assert isinstance(r.rt(P.Acquire(r.req(), h.model_id, 2, [5], True)), P.AcquireOk)


def test_transient_corruption_is_retried(daemon, model):
    r = Raw(daemon.socket)
    h = r.hello(model)
    before = r.rt(P.Stats(r.req())).stats["counters"]
    ok = r.rt(P.Acquire(r.req(), h.model_id, 1, [2], True))
    assert isinstance(ok, P.AcquireOk)
    _bytes_ok(model, daemon, h, ok, 1)
    after = r.rt(P.Stats(r.req())).stats["counters"]
    assert after["retries"] == before["retries"] + 1
    assert after["checksum_errors"] == before["checksum_errors"] + 1


def test_persistent_corruption_fails_with_checksum(daemon, model):
    r = Raw(daemon.socket)
    h = r.hello(model)
    err = r.rt(P.Acquire(r.req(), h.model_id, 1, [4], True))
    assert err.code == E.CHECKSUM and (err.layer, err.expert) == (1, 4)
    ok = r.rt(P.Acquire(r.req(), h.model_id, 1, [4], True))
    _bytes_ok(model, daemon, h, ok, 1)


def test_prefetch_failure_is_notified(daemon, model):
    r = Raw(daemon.socket)
    h = r.hello(model)
    assert r.rt(P.Prefetch(r.req(), h.model_id, 0, [9])).count == 1
    note = r.recv()
    assert isinstance(note, P.PrefetchFailed) and (note.layer, note.expert) == (0, 9)
    assert note.code == E.IO_ERROR
    assert r.rt(P.Stats(r.req())).stats["sessions"][-1]["queued"] == 0


def test_client_error_names_layer_and_expert(model):
    from infer.client import IodClient, IodError

    d = LiveDaemon(args=["--arena", "16M"], env={"IOD_FAULTS": "corrupt:2:7:2"})
    try:
        with IodClient(model, iod=str(d.socket)) as c:
            with pytest.raises(IodError) as e:
                c.fetch(2, [6, 7])
            assert e.value.code == E.CHECKSUM and (e.value.layer, e.value.expert) == (2, 7)
            assert "layer 2 expert 7" in str(e.value)
            v = c.fetch(2, [6, 7])  # read again: fine now
            assert bytes(v[7]) == record_bytes(model, Manifest.load(model).layer(2), 7)
    finally:
        d.stop()


def test_handler_bug_answers_internal_and_daemon_lives(model):
    d = LiveDaemon(args=["--arena", "16M"], env={"IOD_FAULTS": "handler:3:0:1"})
    try:
        r = Raw(d.socket)
        h = r.hello(model)
        err = r.rt(P.Acquire(r.req(), h.model_id, 0, [1], True))
        assert err.code == E.INTERNAL
        assert isinstance(r.rt(P.Acquire(r.req(), h.model_id, 0, [1], True)), P.AcquireOk)
        assert r.rt(P.Stats(r.req())).stats["counters"]["internal_errors"] == 1
        assert "injected handler fault" in d.logtext()
    finally:
        assert d.stop() == 0


@pytest.mark.parametrize("hashers", [0, 1])
def test_checks_in_readers_or_hashers(model, hashers):
    from infer.client import IodClient, IodError

    d = LiveDaemon(args=["--arena", "16M", "--hashers", str(hashers)],
                   env={"IOD_FAULTS": "corrupt:0:1:2,corrupt:0:2:1"})
    try:
        with IodClient(model, iod=str(d.socket)) as c:
            with pytest.raises(IodError) as e:
                c.fetch(0, [1])
            assert e.value.code == E.CHECKSUM
            v = c.fetch(0, [1, 2, 3])  # 2 is read twice: the retry is clean
            m = Manifest.load(model)
            assert all(bytes(v[x]) == record_bytes(model, m.layer(0), x) for x in v)
            del v
            assert c.stats()["counters"]["retries"] == 2
    finally:
        assert d.stop() == 0
