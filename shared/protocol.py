"""Wire types of the iod protocol: message kinds, messages, error codes, version.

Nothing else lives here. Encoding and the strict decoder are in
``shared.codec``. A message travels as two ZeroMQ frames: the kind as one
byte, then the msgpack body (a map of the message's fields; a nested
message type, such as ``SlotRef`` or ``Hint``, travels as a map too).

Rules: kind values and error codes are fixed by hand and never reordered or
reused (retired ones are listed, not recycled). A *call* (HELLO, DEMAND,
STATS, BYE) carries ``req_id`` and gets exactly one terminal reply (its typed
reply, ``Ok``, or ``Error``). A *hint* (PREFETCH) gets no reply unless it is
malformed. Notifications (``Shutdown``) carry no ``req_id``.

What does not travel: an arena hit. A session finds ready records in the
arena's directory and pins them in its pin-table row itself
(``shared.slots``); the socket carries predictions, one demand per layer
call for the records that are not ready, and the session's hello and bye.
"""

from dataclasses import dataclass
from enum import IntEnum
from typing import Dict, List

PROTOCOL_VERSION = 3


class MsgKind(IntEnum):
    # requests (client -> daemon); retired: ACQUIRE = 3, RELEASE = 4, CANCEL = 5
    HELLO = 1
    PREFETCH = 2
    STATS = 6
    BYE = 7
    DEMAND = 8
    # terminal replies (daemon -> client); retired: ACQUIRE_OK = 35
    OK = 32
    ERROR = 33
    HELLO_OK = 34
    STATS_OK = 36
    DEMAND_OK = 37
    # notifications (daemon -> client); retired: READY = 64, PREFETCH_FAILED = 66
    SHUTDOWN = 65


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
    MODEL_CHANGED = 18
    PINS_EXPIRED = 19  # the session held more than its share, silent, while others waited


@dataclass(frozen=True)
class SlotRef:
    """Where one ready expert record lies in the arena, pinned for the session."""

    expert: int
    slot: int
    generation: int
    size: int


@dataclass(frozen=True)
class Hello:
    """Open a session on a prep folder. ``manifest_hash`` is the hash of the
    manifest the session loaded; a daemon that reads another refuses
    (MODEL_CHANGED). ``working_set``: records one layer call needs at least
    (the model's top-k), which the daemon must be able to pin for every session.
    ``profile``: reply with per-record timestamps."""

    req_id: int
    version: int
    pid: int
    model_dir: str
    manifest_hash: str
    working_set: int
    profile: bool


@dataclass(frozen=True)
class Hint:
    """Records of ``layer`` expected to be used at the session's layer call
    number ``due``."""

    layer: int
    experts: List[int]
    due: int


@dataclass(frozen=True)
class Prefetch:
    """A hint: read these records ahead. ``now`` is the session's current
    call number: queued prefetches due before it are dropped. One message
    carries what a layer call guesses for all the layers after it."""

    req_id: int
    model_id: int
    now: int
    hints: List[Hint]


@dataclass(frozen=True)
class Demand:
    """Records of ``layer`` this layer call needs and did not find ready.
    Answered by ``DemandOk`` once each granted record is read and pinned."""

    req_id: int
    model_id: int
    layer: int
    experts: List[int]
    now: int


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
    """The session's arena and pin-table handles. ``dir_base``: the model's
    first directory entry (its layers follow in manifest order, each
    ``num_experts`` entries). ``pin_row``: the session's row of the pin table."""

    req_id: int
    session_id: int
    model_id: int
    daemon_pid: int
    shm_name: str
    pins_name: str
    pin_row: int
    pin_rows: int
    slot_size: int
    slot_count: int
    dir_base: int
    manifest_hash: str


@dataclass(frozen=True)
class DemandOk:
    """Records granted, each pinned once in the session's row (the session
    unpins them). Fewer than asked when the session's share of the arena is
    used up: the session copies these, unpins, and asks for the rest.
    ``stamps``, only for profiling sessions: per ref, the daemon's monotonic
    ns [received, queued, read_start, read_end, sent] (reads 0 for a hit)."""

    req_id: int
    layer: int
    refs: List[SlotRef]
    stamps: List[List[int]]


@dataclass(frozen=True)
class StatsOk:
    req_id: int
    stats: Dict[str, object]


@dataclass(frozen=True)
class Shutdown:
    reason: str


MESSAGE_TYPES = {
    MsgKind.HELLO: Hello,
    MsgKind.PREFETCH: Prefetch,
    MsgKind.STATS: Stats,
    MsgKind.BYE: Bye,
    MsgKind.DEMAND: Demand,
    MsgKind.OK: Ok,
    MsgKind.ERROR: Error,
    MsgKind.HELLO_OK: HelloOk,
    MsgKind.STATS_OK: StatsOk,
    MsgKind.DEMAND_OK: DemandOk,
    MsgKind.SHUTDOWN: Shutdown,
}

REQUEST_KINDS = frozenset(
    {MsgKind.HELLO, MsgKind.PREFETCH, MsgKind.STATS, MsgKind.BYE, MsgKind.DEMAND}
)
