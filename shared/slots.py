"""The arena's memory layout, and the pin table's.

Arena (one POSIX shm segment, written by the daemon, mapped read-only by sessions):

    [0, 4096)                 arena header (ARENA_HEADER, then the live words)
    [4096, headers_offset)    directory: one u32 per (model, layer, expert) a
                              model was given at open; slot + 1, or 0 = not ready
    [headers_offset, ...)     one SLOT_HEADER per slot (64 bytes)
    [data_offset, ...)        slot i's data at data_offset + i * slot_size

Slot data starts on 4096-byte boundaries, so O_DIRECT reads land in place.

Pin table (a second segment, mapped read-write by sessions): one row per
session, ``slot_count`` u32 pin counts then ``slot_count`` reference bytes;
after the rows, one u64 owner word per row: the session id the row serves,
0 once the daemon took the row's pins back. A session checks its owner word
before and after each copy: pins taken back cannot have held the bytes.

A ready record is published by writing its slot header, then its generation,
then its directory word. A session pins it by adding one to its own row's
word for the slot and re-reading the generation (``native.pin_ready``); the
daemon evicts by zeroing the generation and the directory word, then
re-reading every live row's pin: whichever side comes second sees the other
(all these accesses are sequentially consistent). Reference bytes tell the
daemon's CLOCK sweep which slots sessions hit.
"""

import os
import struct
import sys
from dataclasses import dataclass

from .blob import round_up

ARENA_MAGIC = 0x494F4441  # "IODA"
ARENA_VERSION = 3  # 3: the pin table's owner words
PAGE = 4096
SLOT_HEADER_BYTES = 64
DIR_ENTRIES = 1 << 18  # (layer, expert) words of every open model, 1 MiB

# magic, version, slot_size, slot_count, data_offset, daemon pid,
# dir_offset, dir_entries, headers_offset
ARENA_HEADER = struct.Struct("<IIQQQQQQQ")
HEARTBEAT_OFFSET = 128  # u64, bumped by the daemon's loop at least every LOOP_TICK_S
READS_DONE_OFFSET = 136  # u64, completed reads: tells a busy daemon from a stuck one
LOOP_TICK_S = 0.1

# state, model_id, layer, expert, generation, checksum, size
SLOT_HEADER = struct.Struct("<IIIIQQQ")
GENERATION_OFFSET = 16  # of the generation word inside a slot header

FREE, FILLING, READY = 0, 1, 2


@dataclass(frozen=True)
class Layout:
    """Where everything lies in an arena of ``slot_count`` slots of ``slot_size``."""

    slot_size: int
    slot_count: int
    dir_entries: int = DIR_ENTRIES

    dir_offset = PAGE

    @property
    def headers_offset(self) -> int:
        return round_up(PAGE + 4 * self.dir_entries, PAGE)

    @property
    def data_offset(self) -> int:
        return round_up(self.headers_offset + SLOT_HEADER_BYTES * self.slot_count, PAGE)

    @property
    def nbytes(self) -> int:
        return self.data_offset + self.slot_size * self.slot_count

    def header(self, slot: int) -> int:
        return self.headers_offset + SLOT_HEADER_BYTES * slot

    def generation(self, slot: int) -> int:
        return self.header(slot) + GENERATION_OFFSET

    def data(self, slot: int) -> int:
        return self.data_offset + self.slot_size * slot

    def dir_word(self, entry: int) -> int:
        return self.dir_offset + 4 * entry

    @classmethod
    def fitting(cls, arena_size: int, slot_size: int, dir_entries: int = DIR_ENTRIES) -> "Layout":
        """As many slots as fit in ``arena_size`` bytes (0 if not one)."""
        empty = cls(slot_size, 0, dir_entries)
        n = max((arena_size - empty.data_offset) // (slot_size + SLOT_HEADER_BYTES), 0)
        while n > 0 and cls(slot_size, n, dir_entries).nbytes > arena_size:
            n -= 1
        return cls(slot_size, n, dir_entries)


@dataclass(frozen=True)
class PinLayout:
    """The pin table: ``rows`` session rows over ``slot_count`` slots."""

    slot_count: int
    rows: int

    @property
    def row_bytes(self) -> int:
        return round_up(5 * self.slot_count, 64)

    @property
    def nbytes(self) -> int:
        return max(round_up(self.row_bytes * self.rows + 8 * self.rows, 64), PAGE)

    def pins(self, row: int) -> int:
        return self.row_bytes * row

    def refs(self, row: int) -> int:
        return self.row_bytes * row + 4 * self.slot_count

    def owner(self, row: int) -> int:
        return self.row_bytes * self.rows + 8 * row

# ---- an arena's size bounds (`iod start --arena`, and `infer bench --arena` before it starts one)

MIN_ARENA = Layout(PAGE, 1).nbytes  # the 1 MiB directory and one slot of a page
ARENA_SHARE = 0.75  # of physical memory, and of the shared-memory file system's free space


def _fmt(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def arena_limit() -> tuple:
    """(bytes, why): the largest arena allowed here, ARENA_SHARE of physical
    memory and of the shared-memory file system's free space (Linux)."""
    phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit, why = int(phys * ARENA_SHARE), f"{ARENA_SHARE:.0%} of physical memory ({_fmt(phys)})"
    if sys.platform.startswith("linux") and os.path.isdir("/dev/shm"):
        st = os.statvfs("/dev/shm")
        free = st.f_bavail * st.f_frsize
        if int(free * ARENA_SHARE) < limit:
            limit = int(free * ARENA_SHARE)
            why = f"{ARENA_SHARE:.0%} of the free space in /dev/shm ({_fmt(free)} free)"
    return limit, why


def arena_size_problem(size: int):
    """None when ``size`` is a sane arena here, else one line saying why not."""
    if size < MIN_ARENA:
        return (f"--arena {size} bytes is less than the minimum, {MIN_ARENA >> 10} KiB "
                f"(the 1 MiB directory and one slot)")
    limit, why = arena_limit()
    if size > limit:
        return f"--arena {_fmt(size)} is more than {why}: at most {_fmt(limit)} here"
    return None
