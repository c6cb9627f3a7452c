"""Encoding of protocol messages into frames, and the strict decoder.

A message is two frames: ``bytes([kind])`` and a msgpack map of its fields.
The decoder checks the kind, the exact set of fields and every field's type,
and refuses msgpack ExtTypes; anything else raises ``DecodeError``.
"""

import dataclasses
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


def encode(msg) -> list:
    kind = _KIND_OF[type(msg)]
    body = {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}
    return [bytes([kind]), msgpack.packb(body, use_bin_type=True)]


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
    cls = MESSAGE_TYPES[kind]
    if not isinstance(fields, dict):
        raise DecodeError(f"{cls.__name__} body must be a map")
    expected = _FIELDS[cls]
    if fields.keys() != expected.keys():
        missing = sorted(set(expected) - set(fields))
        extra = sorted(map(str, set(fields) - set(expected)))
        raise DecodeError(f"{cls.__name__}: missing {missing}, extra {extra}")
    for name, check in _CHECKS[cls].items():
        if not check(fields[name]):  # fast path; the slow one says where it failed
            _check(fields[name], expected[name], f"{cls.__name__}.{name}")
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
    else:
        raise TypeError(f"unsupported field type {tp} at {where}")


_KIND_OF = {cls: kind for kind, cls in MESSAGE_TYPES.items()}
_FIELDS = {cls: typing.get_type_hints(cls) for cls in MESSAGE_TYPES.values()}
_CHECKS = {cls: {n: _compile(tp) for n, tp in f.items()} for cls, f in _FIELDS.items()}
