"""Streaming expert modules: mlx-lm's SwitchGLU / SwitchMLP with on-demand experts.

Each expert module of the mlx-lm model is replaced by ``StreamingExperts``,
which keeps the module's own ``(x, indices) -> y`` contract: it reads the
routed ids, makes sure the selected experts are in the layer's stack (the
session cache), and runs the original module's code on that stack with the
ids remapped to stack positions. The math per (token, expert) is the same
``gather_qmm`` as with the whole model in memory, so the output is identical.

The stack of a layer has a fixed number of positions; an expert is copied in
once, in place, and stays until it is evicted: the victim is the expert with
the lowest access frequency under exponential decay (half-life of 16 calls
of the layer), ties going to the least recent. A call's missed experts are
placed best-scored first, each only over a victim that scores no higher.
On trained routing this misses 8-15% less than plain decay at a 10% cache
(docs/benchmarks.md, `scripts/bench/bench_policies.py`). The experts that find no
place (a long prefill with a small cache, or one-off experts) run from a
temporary compact stack.
"""

import copy
import threading
import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

import native
from shared.blob import NUMPY_DTYPES
from shared.source import Batch

from infer.runtime.placement import Placement
from infer.runtime.budget import cached_layers, split_cache
from infer.runtime.client import DaemonDead, PinsExpired
from infer.runtime.gate import PredictionGate
from infer.runtime.prefetch import DECODE_ROWS, Prefetcher

_MX_DTYPES = {
    "uint32": mx.uint32,
    "uint16": mx.uint16,
    "uint8": mx.uint8,
    "int8": mx.int8,
    "int32": mx.int32,
    "float32": mx.float32,
    "float16": mx.float16,
    "bfloat16": mx.bfloat16,
}


# how a decode call's misses were found (ExpertStore._count_misses): read
# ahead and ready, hinted but still being read, guessed but not hinted, never guessed
MISS_KINDS = ("ready", "late", "unplanned", "cold")


def _dtype(segment, cast=None):
    """The MLX dtype a segment is used in: its own, or ``cast`` for floats."""
    dtype = _MX_DTYPES[segment.dtype]
    return cast if cast is not None and mx.issubdtype(dtype, mx.floating) else dtype


def _copy_kind(segment, cast, mode):
    """How a tensor's records reach its stack array: 0, copied as stored
    (host memory, or cudaMemcpy); 1 / 2, widened from bfloat16 / float16 to
    float32 by the native copy (host memory; a 16-bit model computed in
    float32 on a CPU); None, staged through MLX (one array and one scatter,
    which copies the whole stack array while the module holds it)."""
    want, have = _dtype(segment, cast), _MX_DTYPES[segment.dtype]
    if mode == "staged":
        return None
    if want == have:
        return 0
    if mode == "host" and want == mx.float32 and have in (mx.bfloat16, mx.float16):
        return 1 if have == mx.bfloat16 else 2
    return None


def copy_mode() -> str:
    """How records reach MLX arrays: "host" on the CPU and Apple silicon,
    where an array's buffer is host memory and records are copied into it in
    place; "cuda" on a CUDA GPU, where they go by cudaMemcpy from the pinned
    arena into the arrays' device memory; else "staged" (a host array, one
    transfer and a scatter per tensor)."""
    if mx.default_device() == mx.cpu or mx.metal.is_available():
        return "host"
    return "cuda" if native.cuda_available() else "staged"


class LayerStack(Placement):
    """A layer's cached experts, stacked per tensor at fixed positions
    (``Placement`` decides which and where). A stack that can hold every
    expert of its layer keeps expert e at position e, and once full
    (``complete``) runs exactly like the resident model's weights: no
    lookup, no sync."""

    def __init__(self, layout, capacity, cast=None):
        super().__init__(layout.num_experts, capacity)
        self.layout = layout
        self.cast = cast  # dtype of the floating tensors (infer --dtype), None: as stored
        self.arrays = {}
        for s in layout.segments:
            a = mx.zeros((max(capacity, 1), *s.shape), _dtype(s, cast))
            self.arrays[(s.projection, s.tensor)] = a
        mx.eval(list(self.arrays.values()))
        # how each tensor's records reach its array (_copy_kind): straight
        # into the array's memory, or staged through MLX
        self.mode = copy_mode()
        self.kinds = [_copy_kind(s, cast, self.mode) for s in layout.segments]
        self.in_place = all(kind is not None for kind in self.kinds)
        # the arrays' addresses (``regions``), taken here on CUDA: MLX may sync
        # to hand one out, which the device wait's serving thread must not
        self._addr = [native.address(a) for a in self.arrays.values()] \
            if self.mode == "cuda" else None
        self.table_stale = True  # placement changed since the device table was written

    def assign(self, missing, keep):
        self.table_stale = True
        return super().assign(missing, keep)

    def forget(self, experts):
        self.table_stale = True
        super().forget(experts)

    def copy_in(self, batch, positions):
        """Copy ``batch``'s records to ``positions``: in host memory one
        native copy per kind of copy (as stored, or widened to float32); on
        CUDA one queued batch of copies for the tensors that need no cast;
        one transfer (and cast) and one scatter per other tensor."""
        keys = list(self.arrays)
        direct = [i for i, kind in enumerate(self.kinds) if kind is not None]
        if direct and self.mode == "cuda":
            # unpinned (a refused registration, a plain buffer): staged by the native copy
            pinned = batch.source is not None and batch.source.pin_for_cuda()
            native.cuda_copy(batch.buf, self.regions(batch, positions), pinned)
        elif direct:
            rows = {}  # kind -> rows
            for ti in direct:
                s, kind = self.layout.segments[ti], self.kinds[ti]
                out = s.nbytes * (2 if kind else 1)  # widened: twice the bytes
                for src, pos in zip(batch.offsets.tolist(), positions):
                    rows.setdefault(kind, []).append((ti, pos * out, src + s.offset, s.nbytes))
            # views of the tensors' memory for this copy only: none outlives its array
            memory = [memoryview(self.arrays[k]) for k in keys]
            try:
                for kind, plan in rows.items():
                    native.copy_regions(memory, batch.buf, np.array(plan, dtype=np.int64), kind)
            finally:
                for m in memory:
                    m.release()
        if len(direct) < len(keys):
            idx = mx.array(np.array(positions, dtype=np.uint32))
            rest = [s for s, kind in zip(self.layout.segments, self.kinds) if kind is None]
            for key, arr in staged(self.layout, batch, cast=self.cast, segments=rest).items():
                self.arrays[key][idx] = arr

    def regions(self, batch, positions):
        """int64 rows of (address in a stack array, offset in ``batch.buf``,
        bytes): ``batch``'s records, per tensor copied as stored, at
        ``positions``. The addresses stay valid while the stack holds its
        arrays (it never replaces one it writes in place)."""
        if self._addr is None:
            self._addr = [native.address(a) for a in self.arrays.values()]
        rows = []
        for ti, kind in enumerate(self.kinds):
            if kind == 0:
                s = self.layout.segments[ti]
                for src, pos in zip(batch.offsets.tolist(), positions):
                    rows.append((self._addr[ti] + pos * s.nbytes, src + s.offset, s.nbytes))
        return np.array(rows, dtype=np.int64).reshape(-1, 3)

    @property
    def nbytes(self):
        return self.capacity * self.layout.record_bytes


def staged(layout, batch, cast=None, segments=None):
    """{(projection, tensor): MLX array of the batch's records, stacked,
    floats cast to ``cast``}: one native copy into host staging and one
    ``mx.array`` per tensor (of ``segments``, default all)."""
    n = len(batch)
    out = {}
    offsets = batch.offsets.tolist()
    for s in layout.segments if segments is None else segments:
        buf = np.empty((n, s.nbytes), dtype=np.uint8)
        rows = [(0, j * s.nbytes, offsets[j] + s.offset, s.nbytes) for j in range(n)]
        native.copy_regions([buf], batch.buf, np.array(rows, dtype=np.int64))
        a = mx.array(buf.view(NUMPY_DTYPES[s.dtype]).reshape(n, *s.shape))
        dtype = _MX_DTYPES[s.dtype]
        a = a if a.dtype == dtype else a.view(dtype)
        out[(s.projection, s.tensor)] = a.astype(_dtype(s, cast)) if cast is not None else a
    return out


class ExpertStore:
    """The session's expert cache: serves experts to the streaming modules from
    per-layer stacks first, then from the source.

    ``source`` is a ``shared.source.ExpertSource`` (``make_source``).
    ``cache_bytes`` is split over the stacks of the ``cached`` layers
    (default: all) by ``infer.runtime.budget.split_cache``: evenly, or with
    whole layers where a calibration's ``usage`` says they pay; a memory
    plan hands its per-layer ``capacity`` instead. Its
    ``prefetcher`` (``infer.runtime.prefetch``) guesses the next layers'
    experts and hints the source to read them ahead; ``depth`` and
    ``calibration`` are its."""

    def __init__(self, manifest, source, cache_bytes, depth=3, calibration=None, cached=None,
                 usage=None, top_k=8, capacity=None):
        self.manifest = manifest
        self.source = source
        self.cache_bytes = cache_bytes
        self.layouts = {l.layer: l for l in manifest.layers}
        # the layers the cache is shared over (infer.runtime.budget.cached_layers);
        # any other layer streams each call through a compact stack
        self.cached = set(self.layouts) if cached is None else set(cached)
        # layer -> positions: a memory plan's, else the bytes split over the layers
        self.capacity = dict(capacity) if capacity is not None else \
            split_cache([self.layouts[l] for l in sorted(self.cached)], cache_bytes, usage, top_k)
        self.stacks = {}
        self.dtype = None  # an mx.Dtype to cast floating expert tensors to (infer --dtype)
        self.trace = None  # set to a list to record each call's experts (routing_trace)
        self.profiler = None  # an infer.tools.profile.Profiler: per-layer spans
        self._asides = {}  # layout's shape -> the stack one-token calls' bypassed experts go to
        # a token computes its cached experts while its misses are read
        # (StreamingExperts._hits_first), where that pays: on the CPU, where
        # they take milliseconds (iod/resident 0.73 -> 0.84 at 25%); on a GPU
        # they take microseconds, less than the split's own host work
        self.hits_first = mx.default_device() == mx.cpu
        # while set (a forward of the whole model: infer.runtime.loader), a decode
        # call's misses are copied in at the next streamed call's router or
        # at the end of the forward (settle), so the disk reads them while
        # the next layers' graphs are built
        self.deferring = False
        self._pending = []  # (layer, experts, copy, stacks written): reads to settle
        # (output, thread) of the latest streamed call, evaluated by the next
        # call's router sync in that thread: a caller may leave a forward
        # lazy (a speculative rollback does), and its outputs must not read
        # positions the next forward writes (every write comes after a
        # sync). Not across threads: MLX evaluates a graph only with the
        # streams of its own thread (the lockstep passes and a layer-major
        # prefill's chunks are greenlets of one thread)
        self.last_output = None
        # a layer-major prefill (infer.runtime.prefill.Lockstep) while one
        # runs, and the experts its chunks' calls read, kept for the chunks
        # behind: layer -> (compact arrays, {expert: position})
        self.lockstep = None
        self.kept = {}
        # guesses of the next layers' experts and the hints to read them ahead
        self.prefetcher = Prefetcher(self, depth, calibration)
        # decode calls mapped to positions on the GPU, which waits for their
        # misses (infer.runtime.device); None: every streamed call syncs
        self.device = None
        self.reset_stats()

    def reset_stats(self):
        """Zeroed figures and prediction scores (the cache stays)."""
        self.stats = {"hits": 0, "misses": 0, "fetched_bytes": 0, "stall_s": 0.0, "copy_s": 0.0,
                      "prefetched": 0, "prefetched_bytes": 0, "prefetch_used": 0,
                      "prefetch_unused": 0, "prefetch_unused_bytes": 0,
                      # a decode-sized call's misses by how they were found: read
                      # ahead and ready in the arena, hinted and still being read
                      # (a late prefetch), guessed but not hinted, never guessed
                      **{"miss_" + k: 0 for k in MISS_KINDS},
                      "hits_first": 0,  # calls that computed cached experts while reading
                      "aside_calls": 0,  # one-token calls that computed bypassed experts apart
                      # experts a layer-major prefill's chunk found read by a chunk ahead
                      "prefill_kept": 0,
                      "whole_calls": 0,  # calls of whole layers: the resident call, no sync
                      "device_calls": 0,  # calls that found their experts on the GPU, no sync
                      "synced_calls": 0,  # calls that read their ids at a sync at the router
                      # streamed calls' own host work (stall and copy left out), and
                      # the part of it that is prediction: the next layers' guesses,
                      # the prefetch plan and its hints
                      "host_s": 0.0, "predict_s": 0.0}
        self.io_s = 0.0  # seconds spent in fetches (stall and copy)
        self.prefetcher.reset_stats()

    def use(self, source):
        """Serve from ``source`` (an ``ExpertSource``) from now on: a
        benchmark gives each run a fresh one while the model stays loaded."""
        self.source = source
        if self.device is not None:
            self.device.attach(source)

    def reset(self, keep_cache=False):
        """Zeroed figures and a fresh routing trace, same modules and routers;
        a cold cache and a fresh prediction gate unless ``keep_cache`` (a
        long session's steady state). For a benchmark's next run."""
        if not keep_cache:
            self.stacks = {}
            self.prefetcher.gate = PredictionGate(self.prefetcher.gate.mode)
        self.reset_stats()
        self.trace = []

    def stack(self, layer):
        if layer not in self.stacks:
            self.stacks[layer] = LayerStack(self.layouts[layer], self.capacity.get(layer, 0), self.dtype)
        return self.stacks[layer]

    @property
    def all_resident(self) -> bool:
        """Every expert of the model's layers (an MTP head's aside) in its
        layer's stack: plain decoding reads nothing any more."""
        return all(l.layer in self.stacks and self.stacks[l.layer].complete
                   for l in cached_layers(self.manifest))

    def routing_trace(self):
        """[(layer, experts as a sorted tuple)] of the calls since ``trace``
        was set, in call order. A whole layer's calls were kept as their
        routed ids (an MLX array), read here: its call must not sync."""
        return [(l, e if isinstance(e, tuple) else tuple(sorted(set(np.array(e).ravel().tolist()))))
                for l, e in self.trace or []]

    def gather(self, layer, wanted, split=False, decode=False, defer=False):
        """(arrays, positions, aside): tensors holding the wanted experts and
        each expert's position in them; ``decode``: a decode-sized call, whose
        misses are counted by how they are found (``_count_misses``).
        ``defer``: the misses (their reads started) are copied in by
        ``settle``, which must run before the arrays are evaluated; only
        where every tensor is copied in place (an array rebound by a staged
        copy would leave the call's graph on the old one). Experts the stack does not admit
        (``LayerStack.assign``) are read into a stack of their own: with
        ``split`` (a one-token call, which computes them apart) ``aside`` is
        (its arrays, the set of those experts) and their positions are in
        it; else every wanted expert is copied into one compact stack, and
        ``aside`` is None."""
        wanted = [int(e) for e in wanted]
        if self.lockstep is not None and not split:
            return self._gather_kept(layer, wanted, decode)
        return self._gather(layer, wanted, split, decode, defer)

    def _gather(self, layer, wanted, split=False, decode=False, defer=False):
        stack, missing = self._lookup(layer, wanted, decode)
        if not missing:
            return stack.arrays, [stack.position[e] for e in wanted], None
        places = stack.assign(missing, set(wanted))
        bypassed = [e for e in missing if places[e] is None]
        defer = defer and stack.in_place
        if not bypassed:
            self._fill(layer, missing, lambda batch: stack.copy_in(
                batch, [places[e] for e in batch.experts]), [stack], defer)
            return stack.arrays, [stack.position[e] for e in wanted], None
        # an own stack for the bypassed experts, filled by the same copies
        # as the layer's (a cast, a CUDA copy); a one-token call computes
        # them apart, any other runs on a compact stack of every wanted
        # expert (more experts than the stack holds: a long prefill)
        try:
            side = self._aside(layer, stack.layout, len(bypassed)) if split else \
                LayerStack(stack.layout, len(bypassed), self.dtype)
        except BaseException:  # out of memory, an interrupt: the placed misses never come
            stack.forget(missing)
            raise
        where = {e: i for i, e in enumerate(bypassed)}

        def copy(batch):
            for target, at in ((stack, places), (side, where)):
                picked = [i for i, e in enumerate(batch.experts) if at.get(e) is not None]
                if picked:
                    target.copy_in(Batch(batch.buf, [batch.experts[i] for i in picked],
                                         batch.offsets[picked], [batch.sizes[i] for i in picked],
                                         batch.source), [at[batch.experts[i]] for i in picked])

        # (a compact stack is new, a kept aside stack written again only after
        # a later call's router synced: what this call left was evaluated)
        self._fill(layer, missing, copy, [stack, side], defer)
        if split:
            self.stats["aside_calls"] += 1
            return stack.arrays, [where[e] if e in where else stack.position[e] for e in wanted], \
                (side.arrays, set(bypassed))
        cached = [e for e in wanted if e in stack]
        index = mx.array(np.array([stack.position[e] for e in cached], dtype=np.uint32))
        arrays = {key: mx.concatenate([arr[index], side.arrays[key]]) if cached else side.arrays[key]
                  for key, arr in stack.arrays.items()}
        order = {e: i for i, e in enumerate(cached + bypassed)}
        return arrays, [order[e] for e in wanted], None

    def _gather_kept(self, layer, wanted, decode):
        """``gather`` in a layer-major prefill: the experts a chunk ahead read
        for this layer serve this call; the rest are gathered and kept too,
        in arrays of their own (a stack's rows may be written again)."""
        arrays, order = self.kept.get(layer, (None, {}))
        extra = [e for e in wanted if e not in order]
        self.stats["prefill_kept"] += len(wanted) - len(extra)
        if extra:
            got, positions, _ = self._gather(layer, extra, decode=decode)
            index = mx.array(np.array(positions, dtype=np.uint32))
            base = len(order)
            order = {**order, **{e: base + i for i, e in enumerate(extra)}}
            arrays = {key: arr[index] if arrays is None else mx.concatenate([arrays[key], arr[index]])
                      for key, arr in got.items()}
            self.kept[layer] = (arrays, order)
        return arrays, [order[e] for e in wanted], None

    def _lookup(self, layer, wanted, decode):
        """(stack, missing): a call of ``layer`` uses ``wanted`` (sorted,
        once each): traced, scored against its guesses, its hits touched;
        a decode call's misses counted by how they were found."""
        if self.trace is not None:
            self.trace.append((layer, tuple(wanted)))
        guessed, hinted = self.prefetcher.called(layer, wanted)
        stack = self.stack(layer)
        stack.tick()
        missing = [e for e in wanted if e not in stack]
        self.stats["hits"] += len(wanted) - len(missing)
        self.stats["misses"] += len(missing)
        for e in wanted:
            if e in stack:
                stack.touch(e)
        if missing and decode:
            self.prefetcher.count_misses(layer, missing, hinted or set(), guessed)
        return stack, missing

    def serve_device(self, layer, stack, ids, guesses=None):
        """A device-path call's routed ``ids``, read from the mailbox: its
        misses placed and copied into their rows; returns {expert: row}, or
        None with no miss. With misses, their reads start before its
        ``guesses`` (the next layers', numpy ids) are hinted; an all-hit
        call's guesses are left to ``hint``, once the GPU has more
        work queued. The call holds at most its stack's capacity, so every
        miss is placed."""
        stack, missing = self._lookup(layer, sorted(set(ids)), True)
        self.prefetcher.clock(layer, True)
        if not missing:
            return None
        if guesses:
            self.prefetcher.start_reads(layer, missing)
            self.hint(guesses)
        places = stack.assign(missing, set(ids))
        self._fill(layer, missing, lambda batch: self.device.copy_in(
            stack, batch, [places[e] for e in batch.experts]), [stack], defer=False)
        return places

    def hint(self, guesses, misses=None):
        """Plan and hint the reads of the next layers' ``guesses`` (timed as
        prediction), after a call's ``misses`` in the same message."""
        t0 = time.monotonic_ns()
        self.prefetcher.prefetch(guesses, misses)
        self.stats["predict_s"] += (time.monotonic_ns() - t0) / 1e9

    def _fill(self, layer, experts, copy, stacks, defer):
        """Copy ``experts`` in now, or (``defer``) at ``settle``; a failed
        copy leaves none of them cached."""
        if defer:
            self._pending.append((layer, experts, copy, stacks))
            return
        try:
            self._fetch(layer, experts, copy)
        except BaseException:
            for s in stacks:
                s.forget(experts)
            raise

    def settle(self):
        """Copy in the misses calls deferred (``gather``), then serve the
        device-path calls (``infer.runtime.device``), before anything
        evaluates those calls' outputs. In that order: serving queues the
        forward on the GPU, a synced call's experts among it, which must
        find their deferred rows written."""
        try:
            while self._pending:
                self._fetch(*self._pending[0][:3])
                self._pending.pop(0)
        except BaseException:
            for _, missed, _, written in self._pending:
                for s in written:
                    s.forget(missed)
            self._pending = []
            if self.device is not None:
                self.device.abandon()
            raise
        if self.device is not None and self.device.calls:
            self.device.finish(self.serve_device, self.hint)

    def _aside(self, layer, layout, n):
        """A stack of at least ``n`` positions for a one-token call's bypassed
        experts: one per shape of layout, kept. Its last use is evaluated by
        the time it is written again (every call syncs at its router before
        it gathers, and that sync waits for all that came before), so a call
        neither allocates one (nor waits, as a new one's zeros would, for
        what is queued ahead of them) nor keeps more than a top k of records."""
        key = (tuple((s.projection, s.tensor, tuple(s.shape), s.dtype, s.offset)
                     for s in layout.segments), self.dtype)
        side = self._asides.get(key)
        if side is None or side.capacity < n:
            k = self.prefetcher.routers.get(layer, (None, n))[1]
            side = self._asides[key] = LayerStack(layout, max(n, k), self.dtype)
        side.layout = layout  # equal segments: the copies read this layer's records the same way
        return side

    def preload(self, order=None):
        """Fill each layer's stack before the first token: ``order`` maps a
        layer to its experts, most wanted first (a calibration's counts; a
        layer it lacks gets none, unless its stack holds the whole layer);
        without it (None), every expert in index order. A stack that holds
        its whole layer is filled with all of it. Returns the experts loaded."""
        n = 0
        for layer, layout in self.layouts.items():
            stack = self.stack(layer)
            if stack.capacity <= 0:
                continue
            ranked = list(order.get(layer, ())) if order is not None else list(range(layout.num_experts))
            if stack.identity:  # a whole layer: the unused experts too, so it starts complete
                listed = set(ranked)
                ranked += [e for e in range(layout.num_experts) if e not in listed]
            want = [e for e in ranked if e not in stack][: stack.capacity - len(stack.position)]
            if not want:
                continue
            places = stack.assign(want, set(want))
            want = [e for e in want if places[e] is not None]
            self._fill(layer, want, lambda batch: stack.copy_in(
                batch, [places[e] for e in batch.experts]), [stack], defer=False)
            n += len(want)
        return n

    def call_source(self, name, *args):
        """A source call that survives the death of the daemon: the client
        attaches to a fresh one (with ``iod="auto"`` it starts one if none
        runs; with a socket, a daemon restarted there) or raises DaemonDead.
        And one whose pins the daemon took back (the session stood still,
        stopped, while it held more than its share of the arena): BYE, HELLO
        again, and the call once more, its copies made again over whatever
        the expired pins let through. The experts already copied into the
        stacks stay valid, so generation carries on."""
        try:
            return getattr(self.source, name)(*args)
        except (DaemonDead, PinsExpired):
            self.stats["reconnects"] = self.stats.get("reconnects", 0) + 1
            self.source.reconnect()
            return getattr(self.source, name)(*args)

    def _fetch(self, layer, experts, copy):
        """Bring ``experts``' records in through ``copy(batch)``."""
        layout = self.layouts[layer]
        prof = self.profiler
        t0 = time.monotonic_ns()
        copying = [0]

        def sink(batch):
            c0 = time.monotonic_ns()
            copy(batch)
            copying[0] += time.monotonic_ns() - c0

        self.call_source("fetch_into", layer, experts, sink)
        t2 = time.monotonic_ns()
        self.stats["stall_s"] += (t2 - t0 - copying[0]) / 1e9
        self.stats["copy_s"] += copying[0] / 1e9
        self.io_s += (t2 - t0) / 1e9
        nbytes = layout.record_bytes * len(experts)
        self.prefetcher.note_read(nbytes, (t2 - t0 - copying[0]) / 1e9)
        if prof:
            prof.span("stall", layer, t0, t2 - copying[0], len(experts))
            prof.span("copy", layer, t2 - copying[0], t2, nbytes)
            prof.copied(layer, experts, t2, nbytes)
        self.stats["fetched_bytes"] += nbytes


def _projection(layout, proj):
    """An empty mlx-lm switch projection whose tensors are set per call."""
    seg = {s.tensor: s for s in layout.segments if s.projection == proj}
    q = layout.quantization.get(proj)
    has_bias = "bias" in seg
    out_dims = seg["weight"].shape[0]
    if q is None:
        return SwitchLinear(seg["weight"].shape[1], out_dims, 1, bias=has_bias)
    in_dims = seg["scales"].shape[-1] * q["group_size"]
    return QuantizedSwitchLinear(
        in_dims, out_dims, 1, has_bias, q["group_size"], q["bits"], mode=q["mode"]
    )


_SPLIT_EXACT = {}  # (projection classes, shapes, quantization, dtype) -> split_is_exact


def split_is_exact(inner, layout, dtype):
    """Whether the backend computes a token's product with an expert to the
    same bits whatever other experts the call holds: then a one-token call
    may compute its experts in groups (the cached ones first, the bypassed
    ones from their own stack) and stay exact. True on MLX's CPU; not on
    MLX CUDA 0.32, whose gather kernels for one token depend on how many
    experts it has. Probed once per shape, on random weights (drawn with
    their own key: the global random state is left alone) through copies
    of ``inner``'s projections, in the gate/up form (one input for all
    experts) and the down form (an input per expert)."""
    key = (tuple(type(inner[p]) for p in layout.projections),
           tuple((s.projection, s.tensor, tuple(s.shape), s.dtype) for s in layout.segments),
           tuple(sorted((p, tuple(sorted(q.items()))) for p, q in layout.quantization.items())),
           dtype)
    if key not in _SPLIT_EXACT:
        ok = True
        rng = mx.random.key(0)
        idx = mx.array([[[5, 2, 7, 0, 3, 6, 1, 4]]], dtype=mx.uint32)
        for proj in layout.projections:
            seg = {s.tensor: s for s in layout.segments if s.projection == proj}
            q = layout.quantization.get(proj)
            d_out = seg["weight"].shape[0]
            d_in = seg["scales"].shape[-1] * q["group_size"] if q else seg["weight"].shape[1]
            kw, kb, kx, rng = mx.random.split(rng, 4)
            w = mx.random.uniform(-d_in**-0.5, d_in**-0.5, (8, d_out, d_in), key=kw)
            module = copy.copy(inner[proj])  # its class and settings; tensors of its own
            if q:
                module.weight, scales, *biases = mx.quantize(w, q["group_size"], q["bits"], mode=q["mode"])
                floating = mx.issubdtype(scales.dtype, mx.floating)  # mxfp4's are uint8
                module.scales = scales.astype(dtype) if floating else scales
                module.biases = biases[0].astype(dtype) if biases else None
            else:
                module.weight = w.astype(dtype)
            if "bias" in seg:
                module.bias = mx.random.normal((8, d_out), key=kb).astype(dtype)
            for shape in ((1, 1, 1, 1, d_in), (1, 1, 8, 1, d_in)):
                x = mx.random.normal(shape, key=kx).astype(dtype)
                part = (lambda a, b: (x[:, :, a:b], idx[..., a:b])) if shape[2] > 1 else \
                    (lambda a, b: (x, idx[..., a:b]))
                whole = module(x, idx)
                split = mx.concatenate([module(*part(0, 3)), module(*part(3, 8))], axis=2)
                ok = ok and bool(mx.array_equal(whole, split).item())
        _SPLIT_EXACT[key] = ok
    return _SPLIT_EXACT[key]


class StreamingExperts(nn.Module):
    """Drop-in replacement for one expert module (SwitchGLU / SwitchMLP)."""

    def __init__(self, inner, layout, store):
        super().__init__()
        self._inner = inner
        self._layout = layout
        self._store = store
        for proj in layout.projections:
            setattr(inner, proj, _projection(layout, proj))
        self._lut = np.zeros(layout.num_experts, dtype=np.uint32)  # expert -> position
        self._split = {}  # activation dtype -> split_is_exact

    def __call__(self, x, indices):
        """settle -> route (the one sync: ids and guesses) -> start the misses'
        reads and hint the guesses -> gather -> compute."""
        store, layer = self._store, self._layout.layer
        stack = store.stacks.get(layer)
        if stack is not None and stack.complete:
            return self._whole(x, indices, stack)
        rows = indices.size // indices.shape[-1]
        if store.lockstep is not None:  # a layer-major prefill: the chunks ahead go first
            store.lockstep.arrive(layer)
        if store.device is not None and store.deferring and rows == 1:
            stack = store.stack(layer)
            if store.device.fits(stack, indices.size) and not store.device.waiting(layer):
                return self._on_device(x, indices, stack)
        decode = rows <= DECODE_ROWS
        ids, guesses, (t0, t1, t2) = self._route(x, indices, rows)
        io = store.io_s
        unique = sorted(set(ids.ravel().tolist()))
        # a token's experts in groups (the cached first, the bypassed apart)
        # only where the backend computes each the same in any group
        split = self._split.get(x.dtype)
        if split is None:
            split = self._split[x.dtype] = split_is_exact(self._inner, self._layout, x.dtype)
        hint_now = bool(guesses) and decode  # (a prefill's guesses are scored, not read)
        early = self._hits_first(x, ids, unique, split, start=not hint_now)
        if guesses:
            store.stats["predict_s"] += (t1 - t0) / 1e9
        # a decode call in a forward of the whole model does not wait for
        # its misses: they are read while the next layers' graphs are built
        # (host work on MLX CUDA and Metal), and copied in at the next sync
        defer = store.deferring and decode and store.stack(layer).in_place
        if hint_now or (defer and early is None):
            guesses = self._start_misses(unique, guesses, hint_now, early)
        one_token = ids.size == ids.shape[-1]
        arrays, positions, aside = store.gather(layer, unique, split=split and one_token, decode=decode,
                                                defer=defer)
        if store.lockstep is not None:
            store.lockstep.passed(layer)
        y = self._compute(x, ids, unique, arrays, positions, aside, early)
        if guesses:
            # no misses: the experts compute while the next layers' reads are
            # planned and hinted, host work off the path from router to router
            mx.async_eval(y)
            store.hint(guesses)
        t4 = time.monotonic_ns()
        store.stats["host_s"] += (t1 - t0 + t4 - t2) / 1e9 - (store.io_s - io)
        if store.profiler:  # stall and copy spans lie inside: the summary takes them out
            store.profiler.span("host", layer, t2, t4)
        # a compact or bypassed experts' stack: the graph of y holds it until
        # y is evaluated; the module must not keep it alive until the layer's
        # next call (one per layer adds up to several layers' experts)
        self._bind(store.stacks[layer].arrays)
        store.last_output = (y, threading.get_ident())
        return y

    def _whole(self, x, indices, stack):
        """Every expert resident at its own index: the resident model's call
        (bound here too: a stack filled by the cold-start preload is complete
        before the layer's first call), with no sync: a trace keeps the ids
        unread (ExpertStore.routing_trace)."""
        store = self._store
        store.stats["hits"] += indices.size
        store.stats["whole_calls"] += 1
        if store.trace is not None:
            store.trace.append((self._layout.layer, indices))
        self._bind(stack.arrays)
        return self._inner(x, indices)

    def _on_device(self, x, indices, stack):
        """One token in a forward of the whole model, on the device path:
        positions found by the GPU from the layer's table, misses served
        when the forward is queued (``ExpertStore.settle``); no sync."""
        store, layer = self._store, self._layout.layer
        device, ahead = store.device, store.prefetcher
        flat, readback = None, None
        if ahead.begin_call(layer, 1):  # the next layers' guesses, posted with the ids
            t0 = time.monotonic_ns()
            flat, readback = ahead.lazy_ids(ahead.predict(layer, x))
            if flat is not None and flat.size > device.max_guessed:
                flat, readback = None, None
            store.stats["predict_s"] += (time.monotonic_ns() - t0) / 1e9
        pos = device.positions(layer, stack, indices, flat)
        self._bind(stack.arrays)
        y = self._inner(x, pos)
        device.called(layer, stack, indices.size, y, readback, flat.size if flat is not None else 0)
        store.stats["device_calls"] += 1
        return y

    def _route(self, x, indices, rows):
        """The routed ids and the next layers' guesses, read back in one sync:
        (ids, guesses, (start, guesses built, sync ended) in ns).

        Reading the routed ids forces evaluation up to the router: inherent
        to streaming, and the only sync per MoE layer. The next layers'
        guesses are computed right behind the ids and come back in the same
        read (on MLX CUDA each host read of device memory costs); their reads
        are planned while this call's misses are read, or, with none, while
        its experts compute. The sync evaluates the earlier calls' outputs:
        the misses they deferred come in first."""
        store, layer = self._store, self._layout.layer
        ahead = store.prefetcher
        store.stats["synced_calls"] += 1
        store.settle()
        last = store.last_output
        if last is not None and last[1] == threading.get_ident():
            indices = mx.depends(indices, last[0])
        t0 = time.monotonic_ns()
        guesses = ahead.predict(layer, x) if ahead.begin_call(layer, rows) else []
        t1 = time.monotonic_ns()
        ids, guesses = ahead.read_guesses(indices, guesses)
        t2 = time.monotonic_ns()
        if store.profiler:  # the compute since the previous sync, up to this router
            store.profiler.span("host", layer, t0, t1)
            store.profiler.span("compute", layer, t1, t2)
        ahead.clock(layer, rows <= DECODE_ROWS)
        return ids, guesses, (t0, t1, t2)

    def _start_misses(self, unique, guesses, hint_now, early):
        """Start reading the call's misses (unless hits-first did), hinting the
        guesses with them where ``hint_now``; returns the guesses still to
        hint (None once hinted)."""
        store, layer = self._store, self._layout.layer
        misses = [e for e in unique if e not in store.stack(layer)]
        if misses and not hint_now:
            store.prefetcher.start_reads(layer, misses)
        elif misses:
            # the misses are read first (this call or the next sync waits for
            # them): the next layers' guesses are hinted now, a layer earlier
            # than after its compute. While its cached experts compute
            # (hits-first), the plan costs the misses nothing: they go in the
            # hints' message; else their reads start first, and the plan runs
            # while they are read
            if early is None:
                store.prefetcher.start_reads(layer, misses)
                store.hint(guesses)
            else:
                store.hint(guesses, (layer, misses))
            return None
        return guesses

    def _compute(self, x, ids, unique, arrays, positions, aside, early):
        """The experts' output for ``ids`` on the gathered ``arrays``."""
        self._bind(arrays)
        lut = self._lut  # entries of other experts are stale, and unread
        lut[unique] = positions
        if early is None and aside is None:
            return self._inner(x, mx.array(lut[ids]))
        # one token, its experts in groups computed apart (cached early, the
        # rest of the stack, the bypassed ones' own stack), then put back in
        # order: each (token, expert) product is the same either way
        flat = ids.ravel()
        rest = np.ones(flat.size, dtype=bool)
        ys, slots = [], []
        if early is not None:
            hit, y_hit = early
            ys.append(y_hit)
            slots.append(np.flatnonzero(hit))
            rest &= ~hit
        side = np.array([e in aside[1] for e in flat.tolist()]) if aside else np.zeros_like(rest)
        for group, group_arrays in ((rest & ~side, arrays), (rest & side, aside and aside[0])):
            if group.any():
                self._bind(group_arrays)
                sel = np.flatnonzero(group)
                ys.append(self._inner(x, mx.array(lut[ids[..., sel]])))
                slots.append(sel)
        order = np.argsort(np.concatenate(slots))
        return ys[0] if len(ys) == 1 else mx.take(mx.concatenate(ys, axis=-2), mx.array(order), axis=-2)

    def _hits_first(self, x, ids, unique, split, start=True):
        """One token whose experts are partly cached, with ``store.hits_first``
        and ``split`` (split_is_exact): start reading the others (unless not
        ``start``: the caller sends them with its hints), and compute the
        cached ones meanwhile. Returns (hit mask over the token's experts,
        their outputs, being evaluated), or None. Exact: each (token, expert)
        product is computed on its own either way."""
        store = self._store
        stack = store.stacks.get(self._layout.layer)
        if (not (store.hits_first and split) or stack is None or ids.size != ids.shape[-1]
                or len(unique) > stack.capacity):
            return None
        hit = np.array([e in stack for e in ids.ravel().tolist()])
        if hit.all() or not hit.any():
            return None
        if start:
            store.prefetcher.start_reads(self._layout.layer, [e for e in unique if e not in stack])
        store.stats["hits_first"] += 1
        self._bind(stack.arrays)
        pos = np.array([stack.position[e] for e in ids.ravel()[hit].tolist()], dtype=np.uint32)
        y_hit = self._inner(x, mx.array(pos.reshape(*ids.shape[:-1], -1)))
        mx.async_eval(y_hit)
        return hit, y_hit

    def _bind(self, arrays):
        """Point the inner module's tensors at ``arrays``: set only where they
        point elsewhere (a stack's arrays are written in place and stay
        bound from call to call; a cast of the model rebinds them)."""
        inner = self._inner
        for (proj, tensor), arr in arrays.items():
            module = inner[proj]
            if module.get(tensor) is not arr:
                setattr(module, tensor, arr)


def _resolve(model, path):
    """(parent, attribute) of a dotted module path, or None if absent."""
    parts = path.split(".")
    obj = model
    for p in parts[:-1]:
        if isinstance(obj, list):
            if not p.isdigit() or int(p) >= len(obj):
                return None
            obj = obj[int(p)]
        elif isinstance(obj, nn.Module) and p in obj:
            obj = obj[p]
        else:
            return None
    if not isinstance(obj, nn.Module) or parts[-1] not in obj:
        return None
    return obj, parts[-1]


def _router(block):
    """(router, top k) of an MoE block, found by mlx-lm's names. The router
    is looked up in the block at each call: mlx-lm replaces the module when
    it quantizes the model after patch_model ran, and the module seen here
    would keep its random initial weights (guesses no better than chance)."""
    name = "gate" if "gate" in block else "router"
    k = getattr(block, "top_k", None) or getattr(block, "num_experts_per_tok", None)
    if not callable(block.get(name)) or k is None:
        return None
    return (lambda x: block[name](x)), int(k)


def patch_model(model, manifest, store, root=None):
    """Replace every expert module named in the manifest by a streaming one.

    Returns the manifest layers that were patched; layers whose module is not
    part of ``model`` (an MTP head, for instance) are left for their owner.
    """
    patched = []
    routers = dict(store.prefetcher.routers)
    for layout in manifest.layers:
        found = _resolve(root or model, layout.module)
        if found is None:
            continue
        parent, name = found
        parent[name] = StreamingExperts(parent[name], layout, store)
        patched.append(layout.layer)
        router = _router(parent)
        if router is not None:
            routers[layout.layer] = router
    store.prefetcher.set_routers(routers)
    return patched
