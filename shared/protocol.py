"""Wire types of the iod protocol: message kinds, messages, error codes, version.

Nothing else lives here. Encoding and the strict decoder are in
``shared.codec``. A message travels as two ZeroMQ frames: the kind as one
byte, then the msgpack body (a map of the message's fields).

Rules: kind values and error codes are fixed by hand and never reordered or
reused; every request carries ``req_id`` and gets exactly one terminal reply
(``Ok``, a typed reply such as ``HelloOk``, or ``Error``); notifications
(``Ready``, ``Shutdown``) carry no ``req_id`` of the client's.
"""

from dataclasses import dataclass
from enum import IntEnum
from typing import Dict, List

PROTOCOL_VERSION = 1


class MsgKind(IntEnum):
    # requests (client -> daemon)
    HELLO = 1
    PREFETCH = 2
    ACQUIRE = 3
    RELEASE = 4
    CANCEL = 5
    STATS = 6
    BYE = 7
    # terminal replies (daemon -> client)
    OK = 32
    ERROR = 33
    HELLO_OK = 34
    ACQUIRE_OK = 35
    STATS_OK = 36
    # notifications (daemon -> client)
    READY = 64
    SHUTDOWN = 65
    PREFETCH_FAILED = 66


class ErrorCode(IntEnum):
    BAD_MESSAGE = 1
    UNKNOWN_KIND = 2
    VERSION_MISMATCH = 3
    BAD_MODEL = 4
    OUT_OF_RANGE = 5
    TOO_LARGE = 6
    TOO_MANY_SESSIONS = 7
    TOO_MANY_PINS = 8
    NO_SESSION = 9
    IO_ERROR = 10
    CHECKSUM = 11
    ARENA_FULL = 12
    SHUTTING_DOWN = 13
    BAD_SLOT = 14
    PERMISSION = 15
    INTERNAL = 16
    QUEUE_FULL = 17


# A slot reference: where one expert record lies in the arena.
# Fields: expert, slot, generation, size, then the daemon's monotonic
# timestamps in ns: [received, queued, read_start, read_end, sent]
# (read_start == read_end == 0 for an arena hit).
SlotRef = List[int]


@dataclass(frozen=True)
class Hello:
    req_id: int
    version: int
    pid: int
    model_dir: str


@dataclass(frozen=True)
class Prefetch:
    """Ask for records to be read; each is pinned for the session and
    announced by a ``Ready`` notification when it lands."""

    req_id: int
    model_id: int
    layer: int
    experts: List[int]


@dataclass(frozen=True)
class Acquire:
    """Pin records; answered by ``AcquireOk`` once all are ready."""

    req_id: int
    model_id: int
    layer: int
    experts: List[int]
    demand: bool


@dataclass(frozen=True)
class Release:
    """Drop pins: a list of [slot, generation] pairs."""

    req_id: int
    slots: List[List[int]]


@dataclass(frozen=True)
class Cancel:
    """Drop the session's queued prefetches (layer -1: of every layer)."""

    req_id: int
    model_id: int
    layer: int


@dataclass(frozen=True)
class Stats:
    req_id: int


@dataclass(frozen=True)
class Bye:
    req_id: int


@dataclass(frozen=True)
class Ok:
    req_id: int
    count: int


@dataclass(frozen=True)
class Error:
    req_id: int
    code: int
    message: str
    layer: int
    expert: int


@dataclass(frozen=True)
class HelloOk:
    req_id: int
    session_id: int
    model_id: int
    daemon_pid: int
    shm_name: str
    slot_size: int
    slot_count: int
    data_offset: int
    manifest_hash: str


@dataclass(frozen=True)
class AcquireOk:
    req_id: int
    layer: int
    slots: List[SlotRef]


@dataclass(frozen=True)
class StatsOk:
    req_id: int
    stats: Dict[str, object]


@dataclass(frozen=True)
class Ready:
    model_id: int
    layer: int
    slot: SlotRef


@dataclass(frozen=True)
class Shutdown:
    reason: str


@dataclass(frozen=True)
class PrefetchFailed:
    """A prefetched record could not be read; the session holds no pin on
    it and a later request reads it again."""

    model_id: int
    layer: int
    expert: int
    code: int
    message: str


MESSAGE_TYPES = {
    MsgKind.HELLO: Hello,
    MsgKind.PREFETCH: Prefetch,
    MsgKind.ACQUIRE: Acquire,
    MsgKind.RELEASE: Release,
    MsgKind.CANCEL: Cancel,
    MsgKind.STATS: Stats,
    MsgKind.BYE: Bye,
    MsgKind.OK: Ok,
    MsgKind.ERROR: Error,
    MsgKind.HELLO_OK: HelloOk,
    MsgKind.ACQUIRE_OK: AcquireOk,
    MsgKind.STATS_OK: StatsOk,
    MsgKind.READY: Ready,
    MsgKind.SHUTDOWN: Shutdown,
    MsgKind.PREFETCH_FAILED: PrefetchFailed,
}

REQUEST_KINDS = frozenset(
    {
        MsgKind.HELLO,
        MsgKind.PREFETCH,
        MsgKind.ACQUIRE,
        MsgKind.RELEASE,
        MsgKind.CANCEL,
        MsgKind.STATS,
        MsgKind.BYE,
    }
)
