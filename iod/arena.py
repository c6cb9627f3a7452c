"""The daemon's side of the shared-memory arena: slots, the directory, pins
and eviction.

Slots move FREE -> FILLING -> READY. A READY slot is found by sessions
through the directory (``shared.slots``) and pinned by them in their own row
of the pin table, with no message; the daemon pins records for a session
there too when it grants a demand. A slot any row pins, or a FILLING one, is
never reused. When a read needs a slot and none is free, a CLOCK hand sweeps
the READY slots: pinned ones are skipped, ones whose reference byte a session
set (a hit) or that were just filled get a second chance, and the first other
one is evicted — after zeroing its generation and directory word and checking
the pins once more (see ``shared.slots`` for why that is safe).

Only the daemon's main thread (or the in-process source's caller) touches
this object; reader threads write slot data only, into slots this object
handed out as FILLING.
"""

import errno
import mmap
import os
import threading

import numpy as np

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
    __slots__ = ("index", "state", "key", "entry", "generation", "size", "fresh", "prefetched",
                 "used")

    def __init__(self, index):
        self.index = index
        self.state = S.FREE
        self.key = None  # (model_id, layer, expert)
        self.entry = -1  # its directory word
        self.generation = 0
        self.size = 0
        self.fresh = False  # just filled: one pass of the hand before it may go
        self.prefetched = False  # filled by a prefetch ...
        self.used = False  # ... and since hit or granted


class Arena:
    """A POSIX shm segment of ``size`` bytes, under ``name`` or a fresh
    unguessable one (``create_segment``), its pages committed at creation;
    ``anonymous``: private anonymous memory instead (the in-process source).
    Slots are laid out once the slot size is known (``layout``), with a pin
    table of session rows in a second segment, named now (``pins_name``) and
    created then."""

    def __init__(self, name, size: int, prefault: bool = False, anonymous: bool = False):
        self.size = size
        self.anonymous = anonymous
        self.name, self.mm = self._segment(size, [name] if name else None)
        self.pins_name = None if anonymous else paths.shm_name()
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
        self.hand = 0  # of the CLOCK sweep
        self.index = {}  # key -> slot index, READY or FILLING
        self.dir_free = [(0, S.DIR_ENTRIES)]  # (first word, count)
        self._next_generation = 1
        self._beats = self._reads_done = 0
        self.evictions = self.unused_prefetches = 0

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
        return self.slot_count > 0

    def _segment(self, size, names=None):
        """(name, mapping) of new memory: a committed shm segment under the
        first free of ``names`` (default: fresh ones), or anonymous memory."""
        if self.anonymous:
            return None, mmap.mmap(-1, size, mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
        name, fd = create_segment(size, names)
        try:
            return name, mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            native.shm_unlink(name)
            raise
        finally:
            os.close(fd)

    def layout(self, slot_size: int, rows: int) -> None:
        """Lay out slots of ``slot_size`` and a pin table of ``rows`` rows."""
        slot_size = S.round_up(slot_size, S.PAGE)
        lay = S.Layout.fitting(self.size, slot_size)
        if lay.slot_count < 1:
            raise ValueError(f"arena of {self.size} bytes cannot hold one slot of {slot_size}")
        self.lay = lay
        self.slot_size, self.slot_count = slot_size, lay.slot_count
        self.data_offset = lay.data_offset
        self.pin_layout = S.PinLayout(lay.slot_count, rows)
        # under the name reserved at creation (already in arena.name), or a
        # fresh one should that be taken
        names = [self.pins_name] + [paths.shm_name() for _ in range(NAME_TRIES - 1)]
        self.pins_name, self.pins_mm = self._segment(self.pin_layout.nbytes, names)
        self.pins_buf = memoryview(self.pins_mm)
        row = self.pin_layout.row_bytes
        table = np.frombuffer(self.pins_mm, np.uint8, rows * row).reshape(rows, row)
        self._pins = table[:, : 4 * lay.slot_count].view(np.uint32)  # [row, slot]
        self._refs = table[:, 4 * lay.slot_count : 5 * lay.slot_count]  # [row, slot]
        S.ARENA_HEADER.pack_into(
            self.buf, 0, S.ARENA_MAGIC, S.ARENA_VERSION, slot_size, lay.slot_count,
            lay.data_offset, os.getpid(), lay.dir_offset, lay.dir_entries, lay.headers_offset)
        self.slots = [Slot(i) for i in range(lay.slot_count)]
        self.free = list(range(lay.slot_count - 1, -1, -1))
        self.free_rows = list(range(rows - 1, -1, -1))

    # ---- live words of the header ----------------------------------------------------

    def beat(self) -> None:
        """The loop is alive: sessions watch this word while they wait."""
        self._beats += 1
        native.store_u64(self.buf, S.HEARTBEAT_OFFSET, self._beats)

    def count_read(self) -> None:
        self._reads_done += 1
        native.store_u64(self.buf, S.READS_DONE_OFFSET, self._reads_done)

    # ---- the directory ---------------------------------------------------------------

    def dir_alloc(self, n: int):
        """The first of ``n`` consecutive directory words for a model, or None."""
        for i, (start, count) in enumerate(self.dir_free):
            if count >= n:
                self.dir_free[i] = (start + n, count - n)
                return start
        return None

    def dir_release(self, start: int, n: int) -> None:
        """A closed model's words (its slots were dropped first)."""
        self.dir_free.append((start, n))
        self.dir_free.sort()
        merged = []
        for a, c in self.dir_free:
            if merged and merged[-1][0] + merged[-1][1] == a:
                merged[-1] = (merged[-1][0], merged[-1][1] + c)
            elif c:
                merged.append((a, c))
        self.dir_free = merged

    # ---- slots -----------------------------------------------------------------------

    def data(self, slot: int, n: int) -> memoryview:
        off = self.data_offset + slot * self.slot_size
        return self.buf[off : off + n]

    def lookup(self, key):
        i = self.index.get(key)
        return None if i is None else self.slots[i]

    def pinned(self, slot: int) -> bool:
        return native.pinned(self.pins_buf, self.pin_layout.row_bytes, self.pin_layout.rows,
                             slot) > 0

    def allocate(self, key, entry: int):
        """A slot for ``key`` (directory word ``entry``) in FILLING state, or
        None when every slot is pinned or filling."""
        if self.free:
            i = self.free.pop()
        else:
            i = self._victim()
            if i is None:
                return None
        s = self.slots[i]
        s.state, s.key, s.entry, s.generation, s.size = S.FILLING, key, entry, 0, 0
        s.fresh = s.prefetched = s.used = False
        S.SLOT_HEADER.pack_into(self.buf, self.lay.header(i), S.FILLING, key[0], key[1], key[2],
                                0, 0, 0)
        self.index[key] = i
        return s

    def _victim(self):
        """CLOCK: the next READY slot nobody pins, nobody hit since the hand
        last passed, and not just filled; None after two full turns."""
        n = self.slot_count
        for _ in range(2 * n):
            i = self.hand
            self.hand = (i + 1) % n
            s = self.slots[i]
            if s.state != S.READY or self._pins[:, i].any():
                continue
            if self._refs[:, i].any():
                self._refs[:, i] = 0
                s.used = s.fresh = True
                continue
            if s.fresh:
                s.fresh = False
                continue
            if self._evict(s):
                return i
        return None

    def _evict(self, s: Slot) -> bool:
        """Unpublish ``s``, unless a session pinned it meanwhile."""
        gen_word = self.lay.generation(s.index)
        native.store_u64(self.buf, gen_word, 0)
        native.store_u32(self.buf, self.lay.dir_word(s.entry), 0)
        if self.pinned(s.index):  # it won the race: keep it published
            native.store_u64(self.buf, gen_word, s.generation)
            native.store_u32(self.buf, self.lay.dir_word(s.entry), s.index + 1)
            return False
        del self.index[s.key]
        self.evictions += 1
        if s.prefetched and not s.used:
            self.unused_prefetches += 1
        s.state = S.FREE
        return True

    def publish(self, s: Slot, size: int, checksum: int, prefetched: bool) -> None:
        """FILLING -> READY: header fields, then the generation, then the
        directory word, each a sequentially consistent store."""
        gen = self._next_generation
        self._next_generation += 1
        model_id, layer, expert = s.key
        off = self.lay.header(s.index)
        S.SLOT_HEADER.pack_into(self.buf, off, S.READY, model_id, layer, expert, 0, checksum, size)
        native.store_u64(self.buf, off + S.GENERATION_OFFSET, gen)
        native.store_u32(self.buf, self.lay.dir_word(s.entry), s.index + 1)
        s.state, s.generation, s.size = S.READY, gen, size
        s.fresh, s.prefetched, s.used = True, prefetched, False

    def abandon(self, s: Slot) -> None:
        """A failed fill: FILLING -> FREE."""
        del self.index[s.key]
        S.SLOT_HEADER.pack_into(self.buf, self.lay.header(s.index), S.FREE, 0, 0, 0, 0, 0, 0)
        s.state, s.key, s.entry, s.generation, s.size = S.FREE, None, -1, 0, 0
        self.free.append(s.index)

    def drop(self, s: Slot) -> bool:
        """Remove a READY slot nobody pins (its model is closing)."""
        if s.state != S.READY or not self._evict(s):
            return False
        self.evictions -= 1
        s.key, s.entry = None, -1
        self.free.append(s.index)
        return True

    # ---- pin table rows --------------------------------------------------------------

    def take_row(self):
        return self.free_rows.pop() if self.free_rows else None

    def give_row(self, row: int) -> None:
        """A session ended: its pins and reference bytes go."""
        native.store_u64(self.pins_buf, self.pin_layout.owner(row), 0)
        self._pins[row, :] = 0
        self._refs[row, :] = 0
        self.free_rows.append(row)

    def own_row(self, row: int, session_id: int) -> None:
        """The owner word a session checks around each copy."""
        native.store_u64(self.pins_buf, self.pin_layout.owner(row), session_id)

    def revoke_row(self, row: int) -> None:
        """Take a row's pins back; the session keeps the row (its late unpins
        land there, harmlessly). The owner word goes first: a session that
        sees its own after a copy knows its pins held throughout."""
        native.store_u64(self.pins_buf, self.pin_layout.owner(row), 0)
        self._pins[row, :] = 0
        self._refs[row, :] = 0

    def pin_for(self, row: int, s: Slot) -> None:
        """One pin of ``s`` in a session's row (a granted demand)."""
        native.add_u32(self.pins_buf, self.pin_layout.pins(row) + 4 * s.index, 1)
        s.used = True

    def unpin_for(self, row: int, s: Slot) -> None:
        native.unpin(self.pins_buf, self.pin_layout.pins(row), self.slot_count,
                     np.array([s.index], np.int32))

    def held(self, row: int, pins=None) -> int:
        """Distinct slots a session's row pins (in ``pins``, a ``snapshot``)."""
        return int(np.count_nonzero((self._pins if pins is None else pins)[row]))

    def snapshot(self):
        """A copy of the pin table: sessions pin and unpin without telling us,
        so figures that must agree are taken from one copy."""
        return self._pins.copy()

    def counts(self, pins=None) -> dict:
        out = {"free": 0, "filling": 0, "ready_pinned": 0, "evictable": 0}
        pinned = (self._pins if pins is None else pins).any(axis=0) if self.laid_out else None
        for s in self.slots:
            if s.state == S.FREE:
                out["free"] += 1
            elif s.state == S.FILLING:
                out["filling"] += 1
            elif pinned[s.index]:
                out["ready_pinned"] += 1
            else:
                out["evictable"] += 1
        return out

    def check(self) -> None:
        """Invariants (tests): index, free list, directory and slot states agree."""
        assert len(self.free) == len(set(self.free))
        for s in self.slots:
            word = native.load_u32(self.buf, self.lay.dir_word(s.entry)) if s.entry >= 0 else 0
            if s.state == S.FREE:
                assert s.index in self.free and s.key is None
            else:
                assert self.index[s.key] == s.index and s.index not in self.free
                assert word == (s.index + 1 if s.state == S.READY else 0), (s.index, word)
        assert len(self.index) == sum(1 for s in self.slots if s.state != S.FREE)

    def close(self, unlink: bool = True) -> None:
        if self._prefaulter is not None:  # waits for one chunk at most
            self._stop.set()
            self._prefaulter.join()
        self._pins = self._refs = None
        for view, mm in ((self.buf, self.mm), (getattr(self, "pins_buf", None),
                                               getattr(self, "pins_mm", None))):
            if mm is None:
                continue
            try:
                view.release()
                mm.close()
            except BufferError:
                pass  # a view is still alive; the mapping goes with the process
        if unlink:
            for name in (self.name, self.pins_name if self.laid_out else None):
                if name is not None:
                    native.shm_unlink(name)
