"""Wire types and the strict codec: round trips and refusals, no daemon."""

import dataclasses
import typing

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared import codec
from shared import protocol as P


def _sample(cls):
    vals = {}
    for name, tp in typing.get_type_hints(cls).items():
        origin = typing.get_origin(tp)
        if tp is int:
            vals[name] = 7
        elif tp is bool:
            vals[name] = True
        elif tp is str:
            vals[name] = "x"
        elif origin is list:
            (item,) = typing.get_args(tp)
            if dataclasses.is_dataclass(item):
                vals[name] = [_sample(item), _sample(item)]
            else:
                vals[name] = [[1, 2]] if typing.get_origin(item) is list else [1, 2, 3]
        elif origin is dict:
            vals[name] = {"a": 1}
    return cls(**vals)


@pytest.mark.parametrize("kind", list(P.MsgKind))
def test_every_kind_round_trips(kind):
    msg = _sample(P.MESSAGE_TYPES[kind])
    frames = codec.encode(msg)
    assert frames[0] == bytes([kind])
    assert codec.decode(frames) == msg
    assert codec.kind_of(msg) == kind


def test_kinds_and_codes_are_fixed():
    # never renumber: these values are on the wire; retired ones are not reused
    assert (P.MsgKind.HELLO, P.MsgKind.BYE, P.MsgKind.OK, P.MsgKind.SHUTDOWN) == (1, 7, 32, 65)
    assert (P.MsgKind.DEMAND, P.MsgKind.DEMAND_OK) == (8, 37)
    assert not {3, 4, 5, 35, 64, 66} & {int(k) for k in P.MsgKind}
    assert P.ErrorCode.INTERNAL == 16 and P.ErrorCode.QUEUE_FULL == 17
    assert P.ErrorCode.MODEL_CHANGED == 18 and P.PROTOCOL_VERSION == 3
    assert set(P.MESSAGE_TYPES) == set(P.MsgKind)
    assert P.REQUEST_KINDS < set(P.MsgKind)


def _body(d):
    return msgpack.packb(d, use_bin_type=True)


HELLO = {"req_id": 1, "version": 2, "pid": 2, "model_dir": "/m", "manifest_hash": "ab",
         "working_set": 8, "profile": False}
REF = {"expert": 1, "slot": 2, "generation": 3, "size": 4}
DEMAND_OK = {"req_id": 1, "layer": 0, "refs": [REF], "stamps": []}


@pytest.mark.parametrize(
    "frames, exc",
    [
        ([b"\x01"], codec.DecodeError),
        ([b"\x01", _body(HELLO)[:-3]], codec.DecodeError),  # truncated msgpack
        ([b"\x63", _body(HELLO)], codec.UnknownKind),
        ([b"\x01\x01", _body(HELLO)], codec.DecodeError),
        ([b"\x01", _body({**HELLO, "pid": "2"})], codec.DecodeError),  # wrong type
        ([b"\x01", _body({**HELLO, "pid": True})], codec.DecodeError),  # bool is not int
        ([b"\x01", _body({**HELLO, "x": 1})], codec.DecodeError),  # extra field
        ([b"\x01", _body({"req_id": 1})], codec.DecodeError),  # missing fields
        ([b"\x01", _body([1, 1, 2, "/m"])], codec.DecodeError),  # positional
        ([b"\x01", _body({**HELLO, "model_dir": msgpack.ExtType(1, b"x")})], codec.DecodeError),
        ([b"\x01", _body({**HELLO, "model_dir": b"/m"})], codec.DecodeError),  # bin
        ([b"\x01", _body({**HELLO, "pid": 2.0})], codec.DecodeError),
        ([b"\x08", _body({"req_id": 1, "model_id": 1, "layer": 0,
                          "experts": list(range(5000)), "now": 1})], codec.TooLarge),
        ([b"\x08", _body({"req_id": 1, "model_id": 1, "layer": 0,
                          "experts": [1, "2"], "now": 1})], codec.DecodeError),
        # nested slot references are checked field by field
        ([b"\x25", _body({**DEMAND_OK, "refs": [[1, 2, 3, 4]]})], codec.DecodeError),
        ([b"\x25", _body({**DEMAND_OK, "refs": [{**REF, "x": 1}]})], codec.DecodeError),
        ([b"\x25", _body({**DEMAND_OK, "refs": [{**REF, "slot": "2"}]})], codec.DecodeError),
        ([b"\x02", _body({"req_id": 1, "model_id": 1, "now": 0,
                          "hints": [{"layer": 0, "experts": [1, "2"], "due": 1}]})], codec.DecodeError),
        ([b"\x01", b"\xc1"], codec.DecodeError),  # never-used msgpack byte
        ([b"\x01", b"\x00" * (codec.MAX_MESSAGE_BYTES + 1)], codec.TooLarge),
    ],
)
def test_strict_decoder_refuses(frames, exc):
    with pytest.raises(exc):
        codec.decode(frames)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 255), st.binary(max_size=200))
def test_decoder_never_raises_anything_but_decode_error(kind, body):
    try:
        codec.decode([bytes([kind]), body])
    except codec.DecodeError:
        pass


def test_nested_refs_decode_to_slot_refs():
    m = codec.decode([b"\x25", _body(DEMAND_OK)])
    assert m.refs == [P.SlotRef(1, 2, 3, 4)] and isinstance(m.refs[0], P.SlotRef)


def test_frozen():
    m = P.Ok(1, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.count = 3


def test_reused_packer_leaves_nothing_behind():
    # encode reuses one msgpack Packer per thread: a message that fails to
    # pack must not leave bytes for the next, and threads must not share it
    import threading

    msg = _sample(P.Demand)
    want = msgpack.packb(codec._plain(msg), use_bin_type=True)
    with pytest.raises(TypeError):
        codec.encode(dataclasses.replace(msg, experts=[1, object()]))
    assert codec.encode(msg)[1] == want
    out = []

    def worker():
        for i in range(200):
            m = dataclasses.replace(msg, req_id=i)
            out.append(codec.decode(codec.encode(m)) == m)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(out) == 800 and all(out)
