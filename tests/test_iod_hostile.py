"""Hostile input against the live daemon: typed errors, and good requests
interleaved with the bad ones keep being answered."""

import os

import msgpack
import pytest

from shared import protocol as P
from shared.fixtures import LiveDaemon, Raw, shm_entries, unpin_refs

E = P.ErrorCode


@pytest.fixture(scope="module")
def daemon():
    d = LiveDaemon(args=["--arena", "16M", "--workers", "2", "--max-sessions", "3"])
    yield d
    assert d.stop() == 0
    assert not shm_entries(d.pid)


def _b(d):
    return msgpack.packb(d, use_bin_type=True)


def test_hostile_corpus_gets_typed_errors(daemon, model, tmp_path):
    good = Raw(daemon.socket)
    h = good.hello(model)
    bad = Raw(daemon.socket)
    hb = bad.hello(model)
    mid = hb.model_id
    (tmp_path / "notprep").mkdir()
    (tmp_path / "badjson").mkdir()
    (tmp_path / "badjson" / "manifest.json").write_text("{not json")
    v = P.PROTOCOL_VERSION
    pid = os.getpid()
    mh = h.manifest_hash

    def hello(req_id, **kw):
        return _b({"req_id": req_id, "version": v, "pid": pid, "model_dir": str(model),
                   "manifest_hash": mh, "working_set": 1, "profile": False, **kw})

    def demand(req_id, **kw):
        return _b({"req_id": req_id, "model_id": mid, "layer": 0, "experts": [1], "now": 1, **kw})

    corpus = [
        ([b"\x08", demand(1)[:-2]], E.BAD_MESSAGE),
        ([b"\x08", b""], E.BAD_MESSAGE),
        ([b"\x08", demand(2, model_id="1")], E.BAD_MESSAGE),
        ([b"\x08", demand(3, now=True)], E.BAD_MESSAGE),
        ([b"\x08", demand(4, experts=[msgpack.ExtType(5, b"boom")])], E.BAD_MESSAGE),
        ([b"\x08", demand(5, experts=list(range(100_000)))], E.TOO_LARGE),
        ([b"\x02", _b({"req_id": 6, "model_id": mid, "now": 0,
                       "hints": [{"layer": 0, "experts": [[1] * 10] * 10, "due": 1}]})], E.BAD_MESSAGE),
        ([b"\x7f", _b({"req_id": 7})], E.UNKNOWN_KIND),
        ([b"\x20", _b({"req_id": 8, "count": 1})], E.UNKNOWN_KIND),  # a reply kind
        ([b"\x03", _b({"req_id": 9})], E.UNKNOWN_KIND),  # retired: ACQUIRE
        ([b"\x08"], E.BAD_MESSAGE),  # one frame
        ([b"\x08", b"x", b"y"], E.BAD_MESSAGE),
        ([b"\x01", hello(9, version=v + 1)], E.VERSION_MISMATCH),
        ([b"\x01", hello(10, model_dir=str(tmp_path / "notprep"))], E.BAD_MODEL),
        ([b"\x01", hello(11, model_dir=str(tmp_path / "badjson"))], E.BAD_MODEL),
        ([b"\x01", hello(12, model_dir=str(model / ".." / model.name))], E.BAD_MODEL),
        ([b"\x01", hello(13, model_dir="/etc/passwd")], E.BAD_MODEL),
        ([b"\x01", hello(14, model_dir="")], E.BAD_MODEL),
        ([b"\x01", hello(15, pid=-5)], E.BAD_MESSAGE),
        ([b"\x01", hello(16, manifest_hash="0" * 16)], E.MODEL_CHANGED),
        ([b"\x08", demand(17, layer=99)], E.OUT_OF_RANGE),
        ([b"\x08", demand(18, experts=[16])], E.OUT_OF_RANGE),
        ([b"\x02", _b({"req_id": 19, "model_id": mid, "now": 0,
                       "hints": [{"layer": 0, "experts": [1], "due": 1},
                                 {"layer": 1, "experts": [-1], "due": 1}]})], E.OUT_OF_RANGE),
        ([b"\x08", demand(20, model_id=mid + 7)], E.BAD_MODEL),
    ]
    for i, (frames, code) in enumerate(corpus):
        bad.send_frames(frames)
        reply = bad.recv()
        assert isinstance(reply, P.Error) and reply.code == code, (i, reply)
        # a good request from another session, interleaved
        ok = good.rt(P.Demand(good.req(), h.model_id, i % 3, [i % 16], i))
        assert isinstance(ok, P.DemandOk) and len(ok.refs) == 1, (i, ok)
        unpin_refs(h, ok.refs)
    # error replies name layer and expert where they apply
    bad.send(P.Demand(50, mid, 0, [3, 99], 1))
    err = bad.recv()
    assert (err.code, err.layer, err.expert, err.req_id) == (E.OUT_OF_RANGE, 0, 99, 50)
    # requests before HELLO
    anon = Raw(daemon.socket)
    assert anon.rt(P.Demand(1, mid, 0, [0], 1)).code == E.NO_SESSION
    # the session table is bounded
    third, extra = Raw(daemon.socket), Raw(daemon.socket)
    assert isinstance(third.hello(model), P.HelloOk)
    assert extra.hello(model).code == E.TOO_MANY_SESSIONS
    third.rt(P.Bye(third.req()))
    assert isinstance(extra.hello(model), P.HelloOk)  # room again
    extra.rt(P.Bye(extra.req()))
    st = good.rt(P.Stats(good.req())).stats
    assert st["counters"]["internal_errors"] == 0 and st["counters"]["bad_messages"] >= 10
    for r in (good, bad):
        r.rt(P.Bye(r.req()))
    for r in (good, bad, anon, third, extra):
        r.close()


def test_oversized_frame_drops_only_that_peer(daemon, model):
    good = Raw(daemon.socket)
    h = good.hello(model)
    hog = Raw(daemon.socket)
    hog.send_frames([b"\x06", b"\x00" * (4 << 20)])  # past the socket's MAXMSGSIZE
    assert isinstance(good.rt(P.Demand(good.req(), h.model_id, 0, [1], 1)), P.DemandOk)
    # just under the socket limit, over the codec's: a typed error
    hog2 = Raw(daemon.socket)
    hog2.send_frames([b"\x06", b"\x00" * ((1 << 20) + 10)])
    assert hog2.recv().code == E.TOO_LARGE
    assert isinstance(good.rt(P.Stats(good.req())), P.StatsOk)
    good.rt(P.Bye(good.req()))


def test_fuzzed_frames(daemon, model):
    """Random frames against the live daemon; every one is answered or
    dropped, and a good request after each batch is answered."""
    import random

    rnd = random.Random(1)
    good = Raw(daemon.socket)
    h = good.hello(model)
    fuzz = Raw(daemon.socket)
    kinds = [int(k) for k in P.MsgKind] + [0, 8, 99, 255]
    for batch in range(20):
        for _ in range(50):
            fields = {"req_id": rnd.choice([1, -1, "x", None, 2 ** 63]),
                      "model_id": rnd.choice([h.model_id, 0, "m"]),
                      "layer": rnd.choice([0, 1, -1, 2 ** 40]),
                      "experts": rnd.choice([[0], [], [-1], [1] * 20, "x", [None]]),
                      "now": rnd.choice([0, -1, 2 ** 40, "x"]), "due": rnd.choice([1, -5]),
                      "hints": rnd.choice([[], "x", [None], [{"layer": 0, "experts": [0], "due": 1}],
                                           [{"layer": 2 ** 40, "experts": [-1], "due": -5}],
                                           [{"layer": 0, "experts": [0]}]]),
                      "version": rnd.choice([1, 2]), "pid": rnd.choice([os.getpid(), 0, 1]),
                      "manifest_hash": rnd.choice([h.manifest_hash, "", "x" * 5000]),
                      "working_set": rnd.choice([1, 0, -1, 10 ** 9]),
                      "profile": rnd.choice([True, False, 1]),
                      "model_dir": rnd.choice(["", "/", "..", "x" * 5000, str(model)])}
            body = _b(dict(rnd.sample(sorted(fields.items()), rnd.randint(0, len(fields)))))
            if rnd.random() < 0.3:
                body = body[: rnd.randint(0, len(body))]
            fuzz.send_frames([bytes([rnd.choice(kinds)]), body])
        ok = good.rt(P.Stats(good.req()))
        assert isinstance(ok, P.StatsOk)
    assert ok.stats["counters"]["internal_errors"] == 0


def test_hello_pid_must_be_the_connected_process(model):
    d = LiveDaemon(args=["--arena", "16M"])
    try:
        r = Raw(d.socket)
        err = r.hello(model, pid=d.pid)  # a live process of ours, but not the one connected
        assert err.code == E.PERMISSION and "not the process connected" in err.message
        assert isinstance(r.hello(model), P.HelloOk)
    finally:
        d.stop()


@pytest.mark.skipif(os.getuid() != 0 or not hasattr(__import__("socket"), "SO_PEERCRED"),
                    reason="needs root to become another user, and SO_PEERCRED")
def test_connection_from_another_uid_is_shut(model):
    d = LiveDaemon(args=["--arena", "16M"])
    try:
        # open the doors the modes normally close, to reach the peer check behind them
        os.chmod(d.folder, 0o711)
        os.chmod(d.socket, 0o666)
        pid = os.fork()  # the venv's python is not runnable as nobody: fork instead
        if pid == 0:
            rc = 2
            try:
                import zmq

                os.setuid(65534)
                ctx = zmq.Context()
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.connect(f"ipc://{d.socket}")
                s.send_multipart([bytes([6]), msgpack.packb({"req_id": 1})])
                rc = 1 if s.poll(2000) else 0
            finally:
                os._exit(rc)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "another uid was answered"
        r = Raw(d.socket)
        st = r.rt(P.Stats(1)).stats
        assert st["counters"]["refused_peers"] >= 1  # and we, the owner, are still served
    finally:
        d.stop()


MANIFEST_MUTATIONS = {
    "checksum not hex": lambda m: m["layers"][0].update(checksums=["zz"] * 16),
    "checksum a number": lambda m: m["layers"][0].update(checksums=[12345] * 16),
    "checksum null": lambda m: m["layers"][0].update(checksums=[None] * 16),
    "negative layer": lambda m: m["layers"][0].update(layer=-1),
    "layer past 32 bits": lambda m: m["layers"][0].update(layer=2 ** 40),
    "experts a string": lambda m: m["layers"][0].update(num_experts="16"),
    "layer twice": lambda m: m["layers"].append(dict(m["layers"][0])),
    "segment past the record": lambda m: m["layers"][0]["segments"][0].update(nbytes=10 ** 12),
    "segment shape": lambda m: m["layers"][0]["segments"][0].update(shape=[3, 3]),
    "segment dtype": lambda m: m["layers"][0]["segments"][0].update(dtype="complex128"),
}


@pytest.mark.parametrize("mutation", MANIFEST_MUTATIONS)
def test_malformed_manifest_is_refused_and_the_daemon_lives(daemon, model, tmp_path, mutation):
    """A session's prep folder with a manifest whose values no reader can use
    gets BAD_MODEL at HELLO (it used to pass HELLO and kill the shared daemon
    at the first read); the other sessions are served on."""
    import json
    import shutil

    bad_dir = tmp_path / "bad"
    shutil.copytree(model, bad_dir)
    m = json.loads((bad_dir / "manifest.json").read_text())
    MANIFEST_MUTATIONS[mutation](m)
    (bad_dir / "manifest.json").write_text(json.dumps(m))
    good = Raw(daemon.socket)
    h = good.hello(model)
    bad = Raw(daemon.socket)
    reply = bad.hello(bad_dir)
    assert isinstance(reply, P.Error) and reply.code == E.BAD_MODEL, reply
    assert "malformed manifest" in reply.message
    ok = good.rt(P.Demand(good.req(), h.model_id, 0, [1, 2], 1))
    assert isinstance(ok, P.DemandOk) and len(ok.refs) == 2
    unpin_refs(h, ok.refs)
    assert good.rt(P.Stats(good.req())).stats["counters"]["internal_errors"] == 0
    good.rt(P.Bye(good.req()))
    for r in (good, bad):
        r.close()
