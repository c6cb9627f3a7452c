"""The arena's memory layout: arena header, slot header table, slot data.

    [0, 4096)                      arena header (ARENA_HEADER)
    [4096, 4096 + 64 * slot_count) one SLOT_HEADER per slot
    [data_offset, ...)             slot i's data at data_offset + i * slot_size

Slot data starts on 4096-byte boundaries, so O_DIRECT reads land in place.
The daemon writes a slot header's fields, then publishes its ``generation``
with a release store; a client loads ``generation`` with an acquire load
(``native``) and rejects the bytes when it differs from its slot reference.
"""

import struct

from .blob import round_up

ARENA_MAGIC = 0x494F4441  # "IODA"
ARENA_VERSION = 1
PAGE = 4096
SLOT_HEADER_BYTES = 64

# magic, version, slot_size, slot_count, data_offset, daemon pid
ARENA_HEADER = struct.Struct("<IIQQQQ")
# state, model_id, layer, expert, generation, checksum, size
SLOT_HEADER = struct.Struct("<IIIIQQQ")
GENERATION_OFFSET = 16  # of the generation word inside a slot header

FREE, FILLING, READY = 0, 1, 2


def data_offset(slot_count: int) -> int:
    return round_up(PAGE + SLOT_HEADER_BYTES * slot_count, PAGE)


def arena_bytes(slot_size: int, slot_count: int) -> int:
    return data_offset(slot_count) + slot_size * slot_count


def slot_count_for(arena_size: int, slot_size: int) -> int:
    """How many slots of ``slot_size`` fit in ``arena_size`` bytes, headers included."""
    n = max(arena_size // (slot_size + SLOT_HEADER_BYTES), 1)
    while n > 1 and arena_bytes(slot_size, n) > arena_size:
        n -= 1
    return n


def header_offset(slot: int) -> int:
    return PAGE + SLOT_HEADER_BYTES * slot
