"""Encoding of protocol messages into frames, and the strict decoder.

A message is two frames: ``bytes([kind])`` and a msgpack map of its fields;
a field whose type is itself a message type (``SlotRef``) is a nested map.
The decoder checks the kind, the exact set of fields and every field's type,
nested maps included, and refuses msgpack ExtTypes; anything else raises
``DecodeError``.
"""

import dataclasses
import threading
import typing

import msgpack

from .protocol import MESSAGE_TYPES, MsgKind

MAX_MESSAGE_BYTES = 1 << 20
MAX_LIST = 4096
MAX_STR = 4096
INT_MIN, INT_MAX = -(1 << 63), (1 << 64) - 1


class DecodeError(ValueError):
    pass


class UnknownKind(DecodeError):
    """The kind byte names no message."""


class TooLarge(DecodeError):
    """The body or one of its lists/strings exceeds the codec's limits."""


def _no_ext(code, data):
    raise DecodeError(f"msgpack ExtType {code} refused")


_local = threading.local()


def encode(msg) -> list:
    kind = _KIND_OF[type(msg)]
    # one Packer per thread, reused: msgpack.packb builds a fresh one and its
    # buffer per message, measured at ~135 us a message in a session whose
    # other threads run MLX, against ~2 us reused
    packer = getattr(_local, "packer", None)
    if packer is None:
        packer = _local.packer = msgpack.Packer(use_bin_type=True)
    return [bytes([kind]), packer.pack(_plain(msg))]


def _plain(value):
    """A message as nested dicts and lists."""
    if dataclasses.is_dataclass(value):
        return {name: _plain(getattr(value, name)) for name in _NAMES[type(value)]}
    if type(value) is list and value and dataclasses.is_dataclass(value[0]):
        return [_plain(v) for v in value]
    return value


def kind_of(msg) -> int:
    return _KIND_OF[type(msg)]


def decode(frames) -> object:
    """Decode ``[kind, body]`` frames into a message, or raise DecodeError."""
    if len(frames) != 2:
        raise DecodeError(f"expected 2 frames, got {len(frames)}")
    kind_frame, body = (bytes(f) for f in frames)
    if len(kind_frame) != 1:
        raise DecodeError("kind frame must be one byte")
    try:
        kind = MsgKind(kind_frame[0])
    except ValueError:
        raise UnknownKind(f"unknown message kind {kind_frame[0]}") from None
    if len(body) > MAX_MESSAGE_BYTES:
        raise TooLarge(f"message of {len(body)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        fields = msgpack.unpackb(
            body,
            raw=False,
            ext_hook=_no_ext,
            strict_map_key=True,
            max_array_len=MAX_LIST,
            max_map_len=MAX_LIST,
            max_str_len=MAX_STR,
            max_bin_len=0,
        )
    except DecodeError:
        raise
    except ValueError as e:
        if "exceeds max" in str(e):
            raise TooLarge(f"msgpack body: {e}") from None
        raise DecodeError(f"bad msgpack body: {type(e).__name__}") from None
    except Exception as e:
        raise DecodeError(f"bad msgpack body: {type(e).__name__}") from None
    return _build(MESSAGE_TYPES[kind], fields, MESSAGE_TYPES[kind].__name__)


def _build(cls, fields, where):
    """``cls`` from a decoded map, every field checked."""
    if not isinstance(fields, dict):
        raise DecodeError(f"{where} must be a map")
    expected = _fields(cls)
    if fields.keys() != expected.keys():
        missing = sorted(set(expected) - set(fields))
        extra = sorted(map(str, set(fields) - set(expected)))
        raise DecodeError(f"{where}: missing {missing}, extra {extra}")
    for name, check in _checks(cls).items():
        if not check(fields[name]):  # fast path; the slow one says where it failed
            _check(fields[name], expected[name], f"{where}.{name}")
    for name, item in _NESTED.get(cls, {}).items():
        fields[name] = [_build(item, v, f"{where}.{name}[{i}]") for i, v in enumerate(fields[name])]
    return cls(**fields)


def _compile(tp):
    """A fast predicate for values of field type ``tp`` (True when valid)."""
    origin = typing.get_origin(tp)
    if tp is int:
        return lambda v: type(v) is int and INT_MIN <= v <= INT_MAX
    if tp is bool:
        return lambda v: type(v) is bool
    if tp is str:
        return lambda v: type(v) is str
    if origin is dict:
        return lambda v: type(v) is dict
    if tp is object:
        return lambda v: True
    if dataclasses.is_dataclass(tp):
        return lambda v: type(v) is dict  # checked field by field in _build
    if origin is list:
        (item,) = typing.get_args(tp)
        if item is int:
            return lambda v: type(v) is list and all(type(x) is int for x in v)
        inner = _compile(item)
        return lambda v: type(v) is list and all(inner(x) for x in v)
    raise TypeError(f"unsupported field type {tp}")


def _check(value, tp, where):
    origin = typing.get_origin(tp)
    if tp is int:
        if type(value) is not int or not INT_MIN <= value <= INT_MAX:
            raise DecodeError(f"{where}: expected int")
    elif tp is bool:
        if type(value) is not bool:
            raise DecodeError(f"{where}: expected bool")
    elif tp is str:
        if type(value) is not str:
            raise DecodeError(f"{where}: expected str")
    elif origin is list:
        if type(value) is not list:
            raise DecodeError(f"{where}: expected list")
        (item,) = typing.get_args(tp)
        for i, v in enumerate(value):
            _check(v, item, f"{where}[{i}]")
    elif origin is dict:
        if type(value) is not dict:
            raise DecodeError(f"{where}: expected map")
    elif tp is object:
        pass
    elif dataclasses.is_dataclass(tp):
        if type(value) is not dict:
            raise DecodeError(f"{where}: expected map")
    else:
        raise TypeError(f"unsupported field type {tp} at {where}")


def _fields(cls):
    if cls not in _FIELDS:
        _FIELDS[cls] = typing.get_type_hints(cls)
    return _FIELDS[cls]


def _checks(cls):
    if cls not in _CHECKS:
        _CHECKS[cls] = {n: _compile(tp) for n, tp in _fields(cls).items()}
    return _CHECKS[cls]


def _nested(cls):
    """{field: item type} of the fields that are lists of message types."""
    out = {}
    for name, tp in _fields(cls).items():
        args = typing.get_args(tp)
        if typing.get_origin(tp) is list and args and dataclasses.is_dataclass(args[0]):
            out[name] = args[0]
    return out


_KIND_OF = {cls: kind for kind, cls in MESSAGE_TYPES.items()}
_FIELDS, _CHECKS = {}, {}
_NESTED = {cls: n for cls in MESSAGE_TYPES.values() if (n := _nested(cls))}
_NAMES = {}
for _cls in list(MESSAGE_TYPES.values()) + [t for n in _NESTED.values() for t in n.values()]:
    _NAMES[_cls] = tuple(f.name for f in dataclasses.fields(_cls))
    _checks(_cls)
