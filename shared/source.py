"""The expert-source interface the streaming model reads through, and the
session side of the arena that both implementations share.

``ExpertSource.fetch_into(layer, experts, sink)`` delivers each record to
``sink`` (a ``Batch`` of records pinned in the arena) and unpins it after
the sink has copied it; ``prefetch`` hints at records a later layer call
will need. Records already ready in the arena cost no message: they are
found in its directory and pinned in this session's pin-table row
(``native.pin_ready``). The rest of a call's records go in one demand, and
its reply grants them pinned. When the session's share of the arena is
used up the daemon grants fewer, and the rest come in further waves.

``ExpertSource`` is the whole surface callers use. Implementations:
``infer.runtime.client.IodClient`` (the user's daemon over ZeroMQ) and
``iod.inproc.InprocSource`` (the same core in this process); both are made
by ``infer.runtime.source.make_source``. They provide the abstract methods.
"""

import abc
import time

import numpy as np

import native

from . import protocol as P
from . import slots as S


class SourceError(RuntimeError):
    """A typed error from the daemon's core; ``code`` is a protocol ``ErrorCode``."""

    def __init__(self, message, code=None, layer=-1, expert=-1):
        super().__init__(message)
        self.code = code
        self.layer = layer
        self.expert = expert


class Batch:
    """Records pinned for one copy: ``experts[i]``'s record lies at
    ``offsets[i]`` in ``buf`` (the arena), ``sizes[i]`` bytes long.
    ``source``: the session whose mapping ``buf`` is (None: a plain buffer)."""

    def __init__(self, buf, experts, offsets, sizes, source=None):
        self.buf = buf
        self.experts = experts
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.sizes = sizes
        self.source = source

    def __len__(self):
        return len(self.experts)

    def record(self, i) -> memoryview:
        off = int(self.offsets[i])
        return self.buf[off : off + self.sizes[i]]


class ExpertSource(abc.ABC):
    """A session on one prep folder's experts (see the module docstring).

    Fields every implementation sets: ``model_dir``, ``manifest``,
    ``profile`` (keep per-record hop stamps in ``hop_log``), ``daemon_pid``
    (0 where the core runs in this process), ``session_id``; ``counters``
    and ``layer_calls`` come with the arena."""

    daemon_pid = 0
    session_id = 0

    def _attach_arena(self, arena_buf, pins_buf, hello, manifest):
        """Map the daemon's HelloOk onto this session's view of the arena."""
        self._arena = arena_buf
        self._pins = pins_buf
        self.model_id = hello.model_id
        self.layout = S.Layout(hello.slot_size, hello.slot_count)
        pin_layout = S.PinLayout(hello.slot_count, hello.pin_rows)
        self._pin_off = pin_layout.pins(hello.pin_row)
        self._ref_off = pin_layout.refs(hello.pin_row)
        self._record_bytes = {l.layer: l.record_bytes for l in manifest.layers}
        self._num_experts = {l.layer: l.num_experts for l in manifest.layers}
        self._first = {}  # layer -> its first directory word
        entry = hello.dir_base
        for l in manifest.layers:
            self._first[l.layer] = entry
            entry += l.num_experts
        self.layer_calls = 0  # layer calls so far: prefetches say when they are due
        self._cuda_pinned = None  # None: not tried; then whether cudaHostRegister took it
        self.cuda_address = 0  # where a kernel reads the pinned arena; 0 while it is not pinned

    def _reset_counters(self):
        self.counters = dict.fromkeys(
            ("arena_hits", "demanded", "granted", "waves", "prefetch_hints", "prefetched",
             "bytes_copied", "stall_ns"), 0)
        self.hop_log = []

    # ---- the interface ------------------------------------------------------------

    def prefetch(self, layer, experts, ahead=1) -> list:
        """Hint: ``layer``'s ``experts`` are likely needed ``ahead`` layer calls
        from now. Records already ready are left out; returns the ones hinted."""
        return self.prefetch_many([(layer, experts, ahead)])[0]

    def prefetch_many(self, hints) -> list:
        """``prefetch`` of several layers, [(layer, experts, ahead)], in one
        message; returns, per hint, the experts hinted."""
        self._check()
        now = self.layer_calls
        todo = [self.not_ready(layer, experts) for layer, experts, _ in hints]
        sent = [P.Hint(layer, t, now + ahead) for (layer, _, ahead), t in zip(hints, todo) if t]
        if sent:
            self.counters["prefetch_hints"] += 1
            self.counters["prefetched"] += sum(len(h.experts) for h in sent)
            self._send_prefetch(sent, now)
        return todo

    def not_ready(self, layer, experts) -> list:
        """Those of ``experts`` (once each) whose records are not ready in the arena."""
        self._check()  # a dead daemon's arena may be unmapped
        return [e for e in dict.fromkeys(int(e) for e in experts) if not self._is_ready(layer, e)]

    def fetch_into(self, layer, experts, sink) -> None:
        """Call ``sink(batch)`` until every expert's record was delivered once;
        the records are pinned during each call and unpinned after it."""
        self._check()
        self._poll()
        self.layer_calls += 1
        todo = [int(e) for e in dict.fromkeys(experts)]
        stalled = 0
        while todo:
            self.counters["waves"] += 1
            t0 = time.monotonic_ns()
            arr = np.array(todo, dtype=np.int32)
            slots = np.empty(len(todo), np.int32)
            gens = np.empty(len(todo), np.uint64)
            native.pin_ready(self._arena, self._pins, self.layout.dir_word(self._first[layer]),
                             self.layout.headers_offset, self.layout.slot_count, self._pin_off,
                             self._ref_off, self.model_id, layer, arr, slots, gens)
            hit = slots >= 0
            got = [e for e, h in zip(todo, hit) if h]
            got_slots = slots[hit].tolist()
            self.counters["arena_hits"] += len(got)
            if self.profile:
                t1 = time.monotonic_ns()
                size = self._record_bytes[layer]
                self.hop_log += [{"kind": "hit", "layer": layer, "expert": e, "size": size,
                                  "client_send": t0, "client_recv": t1} for e in got]
            missing = [e for e, h in zip(todo, hit) if not h]
            refs = []
            if missing:
                tw = time.monotonic_ns()
                try:
                    refs, stamps = self._demand(layer, missing)
                except BaseException:
                    self._unpin(got_slots)
                    raise
                t2 = time.monotonic_ns()
                stalled += t2 - tw
                self.counters["demanded"] += len(missing)
                self.counters["granted"] += len(refs)
                if self.profile:
                    self.hop_log += [{
                        "kind": "demand", "layer": layer, "expert": r.expert, "size": r.size,
                        "client_send": tw, "received": st[0], "queued": st[1],
                        "read_start": st[2], "read_end": st[3], "sent": st[4],
                        "client_recv": t2} for r, st in zip(refs, stamps)]
            pinned = got_slots + [r.slot for r in refs]
            try:
                for r in refs:  # pinned for us: its generation cannot have moved
                    if native.load_u64(self._arena, self.layout.generation(r.slot)) != r.generation:
                        raise SourceError(f"layer {layer} expert {r.expert}: slot {r.slot} "
                                          f"changed under its pin", None, layer, r.expert)
                experts_now = got + [r.expert for r in refs]
                if not experts_now:
                    raise SourceError(f"layer {layer}: the daemon granted none of "
                                      f"{len(missing)} records", None, layer)
                sizes = [self._record_bytes[layer]] * len(got) + [r.size for r in refs]
                offsets = [self.layout.data(s) for s in pinned]
                sink(Batch(self._arena, experts_now, offsets, sizes, self))
                self.counters["bytes_copied"] += sum(sizes)
            finally:
                self._unpin(pinned)
            done = set(experts_now)
            todo = [e for e in todo if e not in done]
        self.counters["stall_ns"] += stalled

    def read(self, layer, experts) -> dict:
        """{expert: record bytes}: a copy of each record (tools and tests)."""
        out = {}

        def sink(batch):
            for i, e in enumerate(batch.experts):
                out[e] = bytes(batch.record(i))

        self.fetch_into(layer, experts, sink)
        return out

    def ready(self, layer) -> list:
        """Experts of ``layer`` ready in the arena right now."""
        self._check()
        l = self._num_experts[layer]
        return [e for e in range(l) if self._is_ready(layer, e)]

    def pin_for_cuda(self) -> bool:
        """Register this mapping of the arena as pinned host memory (copies at
        DMA speed), once; ``_unpin_cuda`` undoes it before the mapping goes.
        A registration that outlived its mapping would make copies from a later
        mapping at the same address read the old pages. Returns whether the
        mapping is pinned (a refused registration stays refused). Pinned, its
        ``cuda_address`` is where a kernel reads it (the device wait's copies)."""
        if self._cuda_pinned is None:
            self._cuda_pinned = native.cuda_register(self._arena, True)
            if self._cuda_pinned:
                self.cuda_address = native.cuda_device_pointer(self._arena)
        return self._cuda_pinned

    @property
    def cuda_pinned(self):
        """None until ``pin_for_cuda`` is tried, then whether it pinned the arena."""
        return self._cuda_pinned

    def _unpin_cuda(self):
        if getattr(self, "_cuda_pinned", None):
            native.cuda_unregister(self._arena)
        self._cuda_pinned, self.cuda_address = None, 0

    # ---- helpers --------------------------------------------------------------------

    def _is_ready(self, layer, expert) -> bool:
        word = self.layout.dir_word(self._first[layer] + expert)
        return native.load_u32(self._arena, word) != 0

    def _unpin(self, slots):
        if slots:
            native.unpin(self._pins, self._pin_off, self.layout.slot_count,
                         np.array(slots, dtype=np.int32))

    def heartbeat(self) -> int:
        return native.load_u64(self._arena, S.HEARTBEAT_OFFSET)

    def reads_done(self) -> int:
        return native.load_u64(self._arena, S.READS_DONE_OFFSET)

    def _check(self):
        """Raise the source's sticky error, if it has one."""

    def _poll(self):
        """Take in what the core finished meanwhile."""

    # ---- what an implementation provides -------------------------------------------

    @abc.abstractmethod
    def stats(self) -> dict:
        """The core's STATS dict (as ``iod status --json`` prints it)."""

    @abc.abstractmethod
    def reconnect(self) -> None:
        """After a dead core: attach to a fresh one, or raise."""

    @abc.abstractmethod
    def close(self) -> None:
        """End the session; every later call raises."""

    @abc.abstractmethod
    def _send_prefetch(self, hints, now):
        """Send ``hints`` (``protocol.Hint``s) as one PREFETCH."""

    @abc.abstractmethod
    def _demand(self, layer, experts):
        """(SlotRefs, stamps): records granted, pinned for this session, for
        some of ``experts``; stamps per ref when profiling (else empty)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
