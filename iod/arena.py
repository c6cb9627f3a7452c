"""The daemon's side of the shared-memory arena: slots, pins and eviction.

Slots move FREE -> FILLING -> READY; a READY slot is pinned by a set of
sessions, and an unpinned READY slot sits in an LRU from which it is evicted
when a read needs room. A pinned or FILLING slot is never reused.

The slot header in shared memory is written with the record's identity, and
then its ``generation`` is published with a release store; a fill first
zeroes the generation, so a client holding a stale reference sees a mismatch.
Only the daemon's main thread touches this object; reader threads write
slot data only, into slots this object handed out as FILLING.
"""

import errno
import mmap
import os
import threading
from collections import OrderedDict

import native
from shared import paths
from shared import slots as S


MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14
PREFAULT_CHUNK = 16 << 20  # the stop flag is looked at between chunks (~10 ms each)
NAME_TRIES = 16


class ArenaError(RuntimeError):
    """The arena cannot be made; the message is one line."""


def create_segment(size: int, names=None) -> tuple:
    """(name, fd) of a new segment: a fresh unguessable name, created with
    O_EXCL and its pages committed (``native.shm_create``). A name already
    taken (squatted, or a collision) is skipped for the next, so nobody can
    block a start by creating names ahead."""
    names = names or (paths.shm_name() for _ in range(NAME_TRIES))
    tried = 0
    for name in names:
        tried += 1
        try:
            return name, native.shm_create(name, size)
        except FileExistsError:
            continue
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                raise ArenaError(f"an arena of {size >> 20} MiB cannot be committed in shared "
                                 f"memory: {os.strerror(e.errno)}") from None
            raise ArenaError(f"cannot create shared memory {name}: {e.strerror}") from None
    raise ArenaError(f"no free shared-memory name after {tried} tries")


class Slot:
    __slots__ = ("index", "state", "key", "generation", "pins", "size")

    def __init__(self, index):
        self.index = index
        self.state = S.FREE
        self.key = None  # (model_id, layer, expert)
        self.generation = 0
        self.pins = {}  # session id -> pin count
        self.size = 0


class Arena:
    """A POSIX shm segment of ``size`` bytes; slots are laid out once the
    slot size is known (``layout``). ``name`` None: a fresh one
    (``create_segment``); the segment's pages are committed at creation."""

    def __init__(self, name, size: int, prefault: bool = False):
        self.name, fd = create_segment(size, [name] if name else None)
        self.size = size
        try:
            self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            native.shm_unlink(self.name)
            raise
        finally:
            os.close(fd)
        self.buf = memoryview(self.mm)
        self._prefaulter = None
        self._stop = threading.Event()
        self.prefaulted_bytes = 0
        # committed pages still fault into our mapping on first touch
        # (~0.3 s per 512 MiB measured); populating the page tables in the
        # background takes that off the first reads
        if prefault:
            self._prefaulter = threading.Thread(target=self._prefault, name="iod-prefault", daemon=True)
            self._prefaulter.start()
        self.slot_size = 0
        self.slot_count = 0
        self.data_offset = 0
        self.slots = []
        self.free = []
        self.lru = OrderedDict()  # slot index -> None, oldest first
        self.index = {}  # key -> slot index, READY or FILLING
        self._next_generation = 1
        self.evictions = 0

    def _prefault(self) -> None:
        """Map every page now, so the first read into a slot does not pay
        for the page faults. Stops between chunks when the arena closes."""
        chunk = PREFAULT_CHUNK
        for off in range(0, self.size, chunk):
            if self._stop.is_set():
                return
            n = min(chunk, self.size - off)
            try:  # populates without writing, so it is safe while readers fill slots
                self.mm.madvise(MADV_POPULATE_WRITE, off, n)
            except (OSError, ValueError, AttributeError):
                return  # not Linux >= 5.14: pages fault in on first use
            self.prefaulted_bytes += n

    @property
    def prefaulted(self) -> bool:
        return self._prefaulter is not None and not self._prefaulter.is_alive()

    @property
    def laid_out(self) -> bool:
        return self.slot_size > 0

    def layout(self, slot_size: int) -> None:
        slot_size = S.round_up(slot_size, S.PAGE)
        count = S.slot_count_for(self.size, slot_size)
        if S.arena_bytes(slot_size, count) > self.size:
            raise ValueError(f"arena of {self.size} bytes cannot hold one slot of {slot_size}")
        self.slot_size, self.slot_count = slot_size, count
        self.data_offset = S.data_offset(count)
        S.ARENA_HEADER.pack_into(
            self.buf, 0, S.ARENA_MAGIC, S.ARENA_VERSION, slot_size, count, self.data_offset, os.getpid()
        )
        self.slots = [Slot(i) for i in range(count)]
        self.free = list(range(count - 1, -1, -1))

    def data(self, slot: int, n: int) -> memoryview:
        off = self.data_offset + slot * self.slot_size
        return self.buf[off : off + n]

    def lookup(self, key):
        i = self.index.get(key)
        return None if i is None else self.slots[i]

    def allocate(self, key):
        """A slot for ``key`` in FILLING state, evicting the least recently
        used unpinned READY slot if needed; None when all are pinned or filling."""
        if self.free:
            i = self.free.pop()
        elif self.lru:
            i, _ = self.lru.popitem(last=False)
            old = self.slots[i]
            del self.index[old.key]
            self.evictions += 1
        else:
            return None
        s = self.slots[i]
        native.store_release_u64(self.buf, S.header_offset(i) + S.GENERATION_OFFSET, 0)
        s.state, s.key, s.generation, s.size = S.FILLING, key, 0, 0
        self.index[key] = i
        return s

    def publish(self, s: Slot, size: int, checksum: int) -> None:
        """FILLING -> READY: header fields first, then the generation with a release store."""
        gen = self._next_generation
        self._next_generation += 1
        model_id, layer, expert = s.key
        off = S.header_offset(s.index)
        S.SLOT_HEADER.pack_into(self.buf, off, S.READY, model_id, layer, expert, 0, checksum, size)
        native.store_release_u64(self.buf, off + S.GENERATION_OFFSET, gen)
        s.state, s.generation, s.size = S.READY, gen, size
        if not s.pins:
            self.lru[s.index] = None

    def abandon(self, s: Slot) -> None:
        """A failed fill: FILLING -> FREE."""
        del self.index[s.key]
        S.SLOT_HEADER.pack_into(self.buf, S.header_offset(s.index), S.FREE, 0, 0, 0, 0, 0, 0)
        s.state, s.key, s.generation, s.size = S.FREE, None, 0, 0
        self.free.append(s.index)

    def pin(self, s: Slot, session: int) -> bool:
        """One more pin of a READY slot by a session (pins are counted: each
        grant is one pin, each release drops one). True on its first pin."""
        n = s.pins.get(session, 0)
        s.pins[session] = n + 1
        self.lru.pop(s.index, None)
        return n == 0

    def unpin(self, s: Slot, session: int, every: bool = False) -> bool:
        """Drop one pin (``every``: all) of the session; True when it holds none now."""
        n = s.pins.get(session, 0)
        if n == 0:
            return False
        if n > 1 and not every:
            s.pins[session] = n - 1
            return False
        del s.pins[session]
        if not s.pins and s.state == S.READY:
            self.lru[s.index] = None  # most recently used end
        return True

    def touch(self, s: Slot) -> None:
        if s.index in self.lru:
            self.lru.move_to_end(s.index)

    def counts(self) -> dict:
        out = {"free": 0, "filling": 0, "ready_pinned": 0, "evictable": 0}
        for s in self.slots:
            if s.state == S.FREE:
                out["free"] += 1
            elif s.state == S.FILLING:
                out["filling"] += 1
            elif s.pins:
                out["ready_pinned"] += 1
            else:
                out["evictable"] += 1
        return out

    def check(self) -> None:
        """Invariants (tests): index, free list and LRU agree with slot states."""
        assert len(self.free) == len(set(self.free))
        for s in self.slots:
            if s.state == S.FREE:
                assert s.index in self.free and not s.pins and s.index not in self.lru
            else:
                assert self.index[s.key] == s.index
                assert s.index not in self.free
                in_lru = s.index in self.lru
                assert in_lru == (s.state == S.READY and not s.pins), s.index
        assert len(self.index) == sum(1 for s in self.slots if s.state != S.FREE)

    def close(self, unlink: bool = True) -> None:
        if self._prefaulter is not None:  # waits for one chunk at most
            self._stop.set()
            self._prefaulter.join()
        try:
            self.buf.release()
            self.mm.close()
        except BufferError:
            pass  # a view is still alive; the mapping goes with the process
        if unlink:
            native.shm_unlink(self.name)
