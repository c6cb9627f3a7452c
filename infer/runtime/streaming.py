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
import math
import threading
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

import native
from shared.blob import NUMPY_DTYPES
from shared.source import Batch

from infer.runtime import predict
from infer.runtime.placement import Placement
from infer.runtime.budget import cached_layers, split_cache
from infer.runtime.client import DaemonDead
from infer.runtime.gate import PredictionGate

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


# the highest use a guess past its predictor's breadth is planned with: below
# predict.MIN_USE, so such guesses are read in spare disk time only
SPARE_ONLY = math.nextafter(predict.MIN_USE, 0.0)


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
        # the arrays' addresses: valid while the stack holds them (it never
        # replaces an array it writes in place)
        self._addr = [native.address(a) for a in self.arrays.values()] \
            if self.mode == "cuda" else None

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
            rows = []
            for ti in direct:
                s = self.layout.segments[ti]
                for src, pos in zip(batch.offsets.tolist(), positions):
                    rows.append((self._addr[ti] + pos * s.nbytes, src + s.offset, s.nbytes))
            native.cuda_copy(batch.buf, np.array(rows, dtype=np.int64), pinned)
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
    """Serves experts to the streaming modules: layer stacks first, then the source.

    ``source`` is a ``shared.source.ExpertSource``: ``infer.runtime.client.IodClient``
    (through the user's daemon) or ``iod.inproc.InprocSource`` (the same core
    in this process). ``cache_bytes`` is split over the stacks of the
    ``cached`` layers (default: all) by ``infer.runtime.budget.split_cache``: evenly,
    or with whole layers where a calibration's ``usage`` says they pay. With
    ``depth > 0`` each MoE layer also guesses the experts of the next
    ``depth`` layers from its own input, and hints the source to prefetch
    the guesses worth reading (``plan``). The guesses are the next layers'
    routers applied to that input, or with a ``calibration``
    (``infer.runtime.predict``, from ``infer prep --calibrate``) the predictor and
    breadth it chose per layer and depth. ``gate`` (``infer.runtime.gate``) turns
    prediction off while decode passes run faster without it.
    """

    # rows (tokens) of a decode-sized call: one token, or a verify pass of up
    # to 7 drafts; a longer call is a prefill, whose next layers need most
    # experts anyway (reading them all ahead would crowd out demand)
    DECODE_ROWS = 8
    MIN_PRECISION = 0.25  # of guesses, for prefetch to go on (see prefetch_pays)
    PREFETCH_WARMUP = 64  # guessed experts scored before the precision decides
    PRECISION_DECAY = 0.99  # per scored guess set: prefetch_pays follows the last ~100
    CLOCK_DECAY = 0.9  # per decode-sized layer call: the compute time follows the last ~10

    def __init__(self, manifest, source, cache_bytes, depth=3, calibration=None, cached=None,
                 usage=None, top_k=8):
        self.manifest = manifest
        self.source = source
        self.cache_bytes = cache_bytes
        self.layouts = {l.layer: l for l in manifest.layers}
        # the layers the cache is shared over (infer.runtime.budget.cached_layers);
        # any other layer streams each call through a compact stack
        self.cached = set(self.layouts) if cached is None else set(cached)
        self.capacity = split_cache([self.layouts[l] for l in sorted(self.cached)], cache_bytes,
                                    usage, top_k)  # layer -> positions
        self.stacks = {}
        self.depth = depth
        self.calibration = calibration  # an infer.runtime.predict.Calibration, or None
        # (layer, next layers) -> their linear maps side by side (W, b), as
        # MLX arrays, made on first use
        self._maps = {}
        self.routers = {}  # layer -> (router module, top k)
        self.next_layers = {}  # layer -> the MoE layers after it, in order
        self._order = {}  # layer -> its place among them
        self.dtype = None  # an mx.Dtype to cast floating expert tensors to (infer --dtype)
        self.trace = None  # set to a list to record each call's experts (routing_trace)
        self.profiler = None  # an infer.tools.profile.Profiler: per-layer spans
        # bytes/s the source reads at: set from the `iod doctor` profile
        # (set_disk) or by the caller; else measured on demand reads
        self.disk_rate = None
        self.disk_ceiling = None  # iod doctor's best rate for that disk (bytes/s)
        self.layer_s = None  # decayed time per MoE layer less its IO waits (decode-sized calls)
        self._recent = {}  # layer -> the experts of its last call of one token's size (<= 2 top-k)
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
        # streams of its own thread (the lockstep's threads take turns)
        self.last_output = None
        self.gate = PredictionGate()  # whether prediction pays its host time (measured)
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
                      "whole_calls": 0,  # calls of whole layers: the resident call, no sync
                      # streamed calls' own host work (stall and copy left out), and
                      # the part of it that is prediction: the next layers' guesses,
                      # the prefetch plan and its hints
                      "host_s": 0.0, "predict_s": 0.0}
        # per depth: [true positives, predicted, actual]
        self.prediction = [[0, 0, 0] for _ in range(max(self.depth, 3) + 1)]
        self._predicted = {}  # layer -> {depth: (set of experts, prefetchable)}
        # per depth: decayed [right, guessed] of prefetchable (decode-sized)
        # guesses, which decide whether prefetch pays (prefill's are left out:
        # guessing most of a layer is always right and says nothing)
        self._precision = [[0.0, 0.0] for _ in range(max(self.depth, 3) + 1)]
        self._hinted = {}  # layer -> experts hinted for its next call
        self._mark = None  # (time, IO seconds, layer) at the last streamed call's router
        self.io_s = 0.0  # seconds spent in fetches (stall and copy)
        self._read = [0.0, 0.0]  # decayed [bytes, seconds] of demand reads
        self._last_layer = None  # the layer of the last streamed call

    def use(self, source):
        """Serve from ``source`` (an ``ExpertSource``) from now on: a
        benchmark gives each run a fresh one while the model stays loaded."""
        self.source = source

    def reset(self, keep_cache=False):
        """Zeroed figures and a fresh routing trace, same modules and routers;
        a cold cache and a fresh prediction gate unless ``keep_cache`` (a
        long session's steady state). For a benchmark's next run."""
        if not keep_cache:
            self.stacks = {}
            self.gate = PredictionGate(self.gate.mode)
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

    def set_routers(self, routers):
        self.routers = routers
        order = sorted(routers)
        self.next_layers = {l: order[i + 1 :] for i, l in enumerate(order)}
        self._order = {l: i for i, l in enumerate(order)}

    def set_disk(self, folder):
        """The read rate of the disk ``folder``'s blobs lie on, as `iod doctor`
        measured it at the daemon's queue depth (its knee); None if unprofiled."""
        from shared import disk

        layout = next(iter(self.layouts.values()), None)
        prof = disk.for_path(Path(folder) / layout.file) if layout is not None else None
        self.disk_rate = prof.rate(prof.knee) if prof is not None else None
        self.disk_ceiling = prof.ceiling if prof is not None else None
        return self.disk_rate

    def routing_trace(self):
        """[(layer, experts as a sorted tuple)] of the calls since ``trace``
        was set, in call order. A whole layer's calls were kept as their
        routed ids (an MLX array), read here: its call must not sync."""
        return [(l, e if isinstance(e, tuple) else tuple(sorted(set(np.array(e).ravel().tolist()))))
                for l, e in self.trace or []]

    def predict(self, layer, x):
        """Lazy guesses for the next layers: [(layer, depth, ids, use per rank
        or None, breadth)]. The predictor's guess is the first ``breadth`` ids;
        where the calibration measured how often each rank is used, the ids go
        on to its last measured rank (reads for spare disk time:
        ``predict.plan``). ``ids``, best first, are numpy (the recent
        experts) or lazy, (MLX array [rows, guesses, ranks], j, n): the first
        n ranks of its guess j, read back by ``read_guesses``. The linear maps
        of one call go as one matmul and one sort: on MLX CUDA each op is a
        kernel launch, and a call guesses up to ``depth`` layers."""
        out, linear = [], {}  # linear: experts -> [(place in out, next layer, ranks)]
        cal = self.calibration
        module = self.layouts[layer].module if layer in self.layouts else None
        rows = x.size // x.shape[-1]
        for d, nxt in enumerate(self.next_layers.get(layer, [])[: self.depth], 1):
            if nxt in self.stacks and self.stacks[nxt].complete:
                continue  # a whole layer: nothing to read, nothing to score
            router, k = self.routers[nxt]
            name, breadth = cal.choice.get((module, d), ("router", k)) if cal else ("router", k)
            use = cal.use.get((module, d, name)) if cal else None
            recent = self._recent.get(nxt) if name == "temporal" else None
            if name == "temporal" and recent is None:
                name, use = "router", None
            if name == "linear" and (module, self.layouts[nxt].module) not in cal.maps:
                name, use, breadth = "router", None, k  # fitted for other layers (an MTP head's)
            wide = max(breadth, len(use)) if use is not None else breadth
            if name == "linear":
                linear.setdefault(self.layouts[nxt].num_experts, []).append((len(out), nxt, wide))
                ids = None
            elif name == "temporal":
                ids = np.array(recent)[None]
                breadth = len(recent)  # the recent experts are the guess, all of them
            else:
                scores = router(x)
                if isinstance(scores, tuple):  # routers that select, e.g. DeepSeek's
                    ids, use = scores[0], None
                    ids = (ids.reshape(rows, 1, ids.shape[-1]), 0, ids.shape[-1])
                else:
                    ids = (predict.ranked(scores, wide).reshape(rows, 1, wide), 0, wide)
            out.append((nxt, d, ids, use, breadth))
        for n_experts, group in linear.items():
            key = (layer, tuple(nxt for _, nxt, _ in group))
            if key not in self._maps:
                wbs = [cal.maps[(module, self.layouts[nxt].module)] for _, nxt, _ in group]
                self._maps[key] = (mx.array(np.concatenate([w for w, _ in wbs], axis=1)),
                                   mx.array(np.concatenate([b for _, b in wbs])))
            w, b = self._maps[key]
            scores = predict.linear_scores(x.reshape(rows, x.shape[-1]), w, b)
            order = predict.ranked(scores.reshape(rows, len(group), n_experts), max(g[2] for g in group))
            for j, (i, _, wide) in enumerate(group):
                out[i] = (*out[i][:2], (order, j, wide), *out[i][3:])
        return out

    @staticmethod
    def read_guesses(indices, guesses):
        """A call's routed ``indices`` and its ``guesses``' lazy ids read back
        in one sync (on MLX CUDA each host read of device memory costs):
        (ids, the guesses with numpy ids)."""
        lazy, place = [indices], {}
        for g in guesses:
            if isinstance(g[2], tuple) and id(g[2][0]) not in place:
                place[id(g[2][0])] = len(lazy)
                lazy.append(g[2][0])
        if len(lazy) == 1:
            return np.array(indices), guesses
        flat = np.array(mx.concatenate([a.reshape(-1).astype(mx.uint32) for a in lazy]))
        ends = np.cumsum([0] + [a.size for a in lazy])
        host = [flat[a:b].reshape(arr.shape) for arr, a, b in zip(lazy, ends, ends[1:])]
        out = []
        for g in guesses:
            ids = g[2]
            if isinstance(ids, tuple):
                arr, j, n = ids
                ids = host[place[id(arr)]][:, j, :n]
            out.append((*g[:2], ids, *g[3:]))
        return host[0], out

    def prefetch(self, guesses, misses=None):
        """Score ``guesses`` when their layers are called, and hint the source
        to read the ones ``plan`` finds worth reading in time. ``misses``,
        (layer, experts) the calling layer waits for, go first in the same
        message (due now: the daemon reads them as demand reads)."""
        candidates = []
        for layer, d, ids, use, breadth in guesses:
            rows = np.array(ids).reshape(-1, ids.shape[-1])
            small = rows.shape[0] <= self.DECODE_ROWS
            # scored: the predictor's guess, not the ranks past it
            self._predicted.setdefault(layer, {})[d] = (set(rows[:, :breadth].ravel().tolist()), small)
            if not small or not self.prefetch_pays(d):
                continue  # still scored: prefetch resumes if guesses improve
            right, guessed = self._precision[d] if d < len(self._precision) else (1.0, 1.0)
            online = right / guessed if guessed >= self.PREFETCH_WARMUP else 1.0
            # each expert's best rank over the rows: the first it takes in
            # rank order (built from the end: a dict keeps the last value)
            n, width = rows.shape
            rank = dict(zip(rows.T.ravel()[::-1].tolist(), np.repeat(np.arange(width), n)[::-1].tolist()))
            # what a read would bring: not cached, not hinted, not ready in the arena
            fresh = rank.keys() - self.stack(layer).position.keys() - self._hinted.get(layer, set())
            if fresh and self.source is not None:
                fresh = self._call("not_ready", layer, fresh)
            for e in sorted(fresh, key=lambda e: (rank[e], e)):  # plan breaks ties in this order
                r = rank[e]
                p = float(use[r]) if use is not None and r < len(use) else online
                if r >= breadth:  # past the predictor's guess: read in spare disk time only
                    p = min(p, SPARE_ONLY)
                candidates.append((p, d, layer, e))
        if not candidates:
            if misses:
                self.start_reads(*misses)
            return
        rec = self.layouts[candidates[0][2]].record_bytes
        # hints outstanding for the layers planned (the calling layer's own
        # are being used now, and may not be counted off yet)
        pending = sum(len(self._hinted.get(g[0], ())) for g in guesses)
        chosen = predict.plan(candidates, self.reads_in, rec, pending)
        by_layer = {}
        for _, d, layer, e in chosen:
            by_layer.setdefault((layer, d), []).append(e)
        hints = [(layer, sorted(experts), d) for (layer, d), experts in sorted(by_layer.items())]
        first = [(misses[0], list(misses[1]), 0)] if misses else []
        sent = self._call("prefetch_many", first + hints)
        for (layer, _, _), hinted in zip(hints, sent[len(first):]):
            self._hinted.setdefault(layer, set()).update(hinted)
            self.stats["prefetched"] += len(hinted)
            self.stats["prefetched_bytes"] += len(hinted) * self.layouts[layer].record_bytes

    def start_reads(self, layer, experts):
        """Have the source start reading ``experts`` (a call's misses) now, so
        they arrive while the call computes its cached experts."""
        self._call("prefetch", layer, experts, 0)

    def read_rate(self):
        """Bytes/s reads are planned with: the profiled disk's, else the rate
        measured on demand reads, else None (unknown: no limit)."""
        if self.disk_rate:
            return self.disk_rate
        nbytes, secs = self._read
        return nbytes / secs if secs > 0 else None

    def reads_in(self, depth, record_bytes):
        """Records the source can read before the layer ``depth`` calls ahead
        asks for them (inf while the rate or the compute time is unmeasured)."""
        rate = self.read_rate()
        if rate is None or self.layer_s is None:
            return float("inf")
        return depth * self.layer_s * rate / record_bytes

    def begin_call(self, layer, rows):
        """At a streamed call's router, before its guesses: whether this call
        of ``rows`` tokens predicts. A decode-sized call at a layer before the
        last streamed call's starts a pass for the gate (timed if one token);
        a larger call's pass is not timed. (A model with one streamed layer
        starts no pass: its gate stays as it began.)"""
        if self.depth == 0:
            return False
        if rows > self.DECODE_ROWS:
            self.gate.discard()
        elif self._last_layer is not None and layer < self._last_layer:
            self.gate.start_pass(time.monotonic(), timed=rows == 1)
        self._last_layer = layer
        return self.gate.on

    def clock(self, layer, small):
        """At a streamed call's router, after its sync: the time since the
        previous streamed call's router in the same pass, less the IO waited
        for in between, per layer passed, updates ``layer_s`` for
        decode-sized calls. That is the time the disk has for reads ahead
        while a layer runs: its attention, its experts and the calls' host
        work (hints go out at a call, before its own host work is done)."""
        now = time.monotonic()
        if self._mark is not None and small:
            t, io, prev = self._mark
            passed = self._order.get(layer, 0) - self._order.get(prev, 0)
            if passed > 0:  # a later layer of the same pass
                dt = max(now - t - (self.io_s - io), 0.0) / passed
                a = self.CLOCK_DECAY
                self.layer_s = dt if self.layer_s is None else a * self.layer_s + (1 - a) * dt
        self._mark = (now, self.io_s, layer)

    def prefetch_pays(self, depth):
        """Whether guesses at ``depth`` are right often enough to be read
        ahead: a wrong guess costs a read (and, when reads are the bottleneck,
        a demand read's turn), a right one saves a stall. Measured, not
        assumed: prefetch runs until ``PREFETCH_WARMUP`` guesses are scored,
        then only while their recent precision (decode-sized guesses, decayed
        by ``PRECISION_DECAY`` per guess) is at least ``MIN_PRECISION``."""
        if depth >= len(self._precision):
            return True
        right, guessed = self._precision[depth]
        return guessed < self.PREFETCH_WARMUP or right >= self.MIN_PRECISION * guessed

    def _score(self, layer, actual):
        """Score the guesses made for this call; returns their union."""
        guessed = set()
        for d, (guess, small) in self._predicted.pop(layer, {}).items():
            guessed |= guess
            if d >= len(self.prediction):
                continue
            row = self.prediction[d]
            right = len(guess & actual)
            row[0] += right
            row[1] += len(guess)
            row[2] += len(actual)
            if small and d < len(self._precision):
                g = self._precision[d]
                g[0] = g[0] * self.PRECISION_DECAY + right
                g[1] = g[1] * self.PRECISION_DECAY + len(guess)
        return guessed

    def _count_prefetch(self, layer, actual):
        """Hinted records this call did not use: read (or queued) for nothing.
        Returns the experts hinted for this call."""
        hinted = self._hinted.pop(layer, None)
        if hinted:
            unused = len(hinted - actual)
            self.stats["prefetch_used"] += len(hinted) - unused
            self.stats["prefetch_unused"] += unused
            self.stats["prefetch_unused_bytes"] += unused * self.layouts[layer].record_bytes
        return hinted

    def _count_misses(self, layer, missing, hinted, guessed):
        """A call's misses: ready in the arena (read ahead, or left by an
        earlier read), hinted but not read yet (late), guessed but not hinted
        (the plan or the precision gate left them out), or never guessed."""
        if self.source is None:
            return
        waiting = set(self._call("not_ready", layer, missing))
        unhinted = waiting - hinted
        self.stats["miss_ready"] += len(missing) - len(waiting)
        self.stats["miss_late"] += len(waiting & hinted)
        self.stats["miss_unplanned"] += len(unhinted & guessed)
        self.stats["miss_cold"] += len(unhinted - guessed)

    def prediction_stats(self):
        """Recall and precision of the prediction, per depth."""
        out = {}
        for d, (tp, predicted, actual) in enumerate(self.prediction):
            if actual:
                out[d] = {
                    "recall": tp / actual,
                    "precision": tp / predicted if predicted else 0.0,
                }
        return out

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
        if self.trace is not None:
            self.trace.append((layer, tuple(wanted)))
        guessed = self._score(layer, set(wanted)) if self._predicted else set()
        hinted = self._count_prefetch(layer, set(wanted)) if self._hinted else None
        if len(wanted) <= 2 * self.routers.get(layer, (None, len(wanted)))[1]:
            self._recent[layer] = wanted
        stack = self.stack(layer)
        stack.tick()
        missing = [e for e in wanted if e not in stack]
        self.stats["hits"] += len(wanted) - len(missing)
        self.stats["misses"] += len(missing)
        for e in wanted:
            if e in stack:
                stack.touch(e)
        if not missing:
            return stack.arrays, [stack.position[e] for e in wanted], None
        if decode:
            self._count_misses(layer, missing, hinted or set(), guessed)
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
        """Copy in the misses calls deferred (``gather``), before anything
        evaluates those calls' outputs."""
        try:
            while self._pending:
                self._fetch(*self._pending[0][:3])
                self._pending.pop(0)
        except BaseException:
            for _, missed, _, written in self._pending:
                for s in written:
                    s.forget(missed)
            self._pending = []
            raise

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
            k = self.routers.get(layer, (None, n))[1]
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

    def _call(self, name, *args):
        """A source call that survives the death of the daemon: the client
        attaches to a fresh one (with ``iod="auto"`` it starts one if none
        runs; with a socket, a daemon restarted there) or raises DaemonDead.
        The experts already copied into the stacks stay valid, so generation
        carries on."""
        try:
            return getattr(self.source, name)(*args)
        except DaemonDead:
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

        self._call("fetch_into", layer, experts, sink)
        t2 = time.monotonic_ns()
        self.stats["stall_s"] += (t2 - t0 - copying[0]) / 1e9
        self.stats["copy_s"] += copying[0] / 1e9
        self.io_s += (t2 - t0) / 1e9
        nbytes = layout.record_bytes * len(experts)
        # the read rate seen by demand (decayed): arena hits make it look
        # faster, so a profiled disk (set_disk) is preferred
        a = self.CLOCK_DECAY
        self._read = [a * self._read[0] + nbytes, a * self._read[1] + (t2 - t0 - copying[0]) / 1e9]
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
        store = self._store
        stack = store.stacks.get(self._layout.layer)
        if stack is not None and stack.complete:
            # every expert resident at its own index: the resident model's
            # call (bound here too: a stack filled by the cold-start preload
            # is complete before the layer's first call), with no sync: a
            # trace keeps the ids unread (ExpertStore.routing_trace)
            store.stats["hits"] += indices.size
            store.stats["whole_calls"] += 1
            if store.trace is not None:
                store.trace.append((self._layout.layer, indices))
            self._bind(stack.arrays)
            return self._inner(x, indices)
        # Reading the routed ids forces evaluation up to the router: inherent
        # to streaming, and the only sync per MoE layer. The next layers'
        # guesses are computed right behind the ids and come back in the
        # same read (on MLX CUDA each host read of device memory costs);
        # their reads are planned while this call's misses are read, or,
        # with none, while its experts compute (below). The sync evaluates
        # the earlier calls' outputs: the misses they deferred come in first.
        store.settle()
        last = store.last_output
        if last is not None and last[1] == threading.get_ident():
            indices = mx.depends(indices, last[0])
        prof, layer = store.profiler, self._layout.layer
        t0 = time.monotonic_ns()
        rows = indices.size // indices.shape[-1]
        guesses = store.predict(layer, x) if store.begin_call(layer, rows) else []
        t1 = time.monotonic_ns()
        ids, guesses = store.read_guesses(indices, guesses)
        t2 = time.monotonic_ns()
        io = store.io_s
        if prof:  # the compute since the previous sync, up to this router
            prof.span("host", layer, t0, t1)
            prof.span("compute", layer, t1, t2)
        unique = sorted(set(ids.ravel().tolist()))
        store.clock(layer, rows <= store.DECODE_ROWS)
        # a token's experts in groups (the cached first, the bypassed apart)
        # only where the backend computes each the same in any group
        split = self._split.get(x.dtype)
        if split is None:
            split = self._split[x.dtype] = split_is_exact(self._inner, self._layout, x.dtype)
        decode = rows <= store.DECODE_ROWS
        hint_now = bool(guesses) and decode  # (a prefill's guesses are scored, not read)
        early = self._hits_first(x, ids, unique, split, start=not hint_now)
        if guesses:
            store.stats["predict_s"] += (t1 - t0) / 1e9
        # a decode call in a forward of the whole model does not wait for
        # its misses: they are read while the next layers' graphs are built
        # (host work on MLX CUDA and Metal), and copied in at the next sync
        stack = store.stack(layer)
        defer = store.deferring and decode and stack.in_place
        started = early is not None  # hits-first started the misses' reads
        if hint_now or (defer and not started):
            misses = [e for e in unique if e not in stack]
            if misses and not hint_now:
                store.start_reads(layer, misses)
            elif misses:
                # the misses are read first (this call or the next sync
                # waits for them): the next layers' guesses are hinted now,
                # a layer earlier than after its compute.
                # While its cached experts compute (hits-first), the plan
                # costs the misses nothing: they go in the hints' message;
                # else their reads start first, and the plan runs while
                # they are read
                if early is None:
                    store.start_reads(layer, misses)
                    self._hint(guesses)
                else:
                    self._hint(guesses, (layer, misses))
                guesses = None
        one_token = ids.size == ids.shape[-1]
        arrays, positions, aside = store.gather(layer, unique, split=split and one_token, decode=decode,
                                                defer=defer)
        self._bind(arrays)
        lut = self._lut  # entries of other experts are stale, and unread
        lut[unique] = positions
        if early is None and aside is None:
            y = self._inner(x, mx.array(lut[ids]))
        else:
            # one token, its experts in groups computed apart (cached early,
            # the rest of the stack, the bypassed ones' own stack), then put
            # back in order: each (token, expert) product is the same either way
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
            y = ys[0] if len(ys) == 1 else \
                mx.take(mx.concatenate(ys, axis=-2), mx.array(order), axis=-2)
        if guesses:
            # no misses: the experts compute while the next layers' reads are
            # planned and hinted, host work off the path from router to router
            mx.async_eval(y)
            self._hint(guesses)
        t4 = time.monotonic_ns()
        store.stats["host_s"] += (t1 - t0 + t4 - t2) / 1e9 - (store.io_s - io)
        if prof:  # stall and copy spans lie inside: the summary takes them out
            prof.span("host", layer, t2, t4)
        # a compact or bypassed experts' stack: the graph of y holds it until
        # y is evaluated; the module must not keep it alive until the layer's
        # next call (one per layer adds up to several layers' experts)
        self._bind(store.stacks[layer].arrays)
        store.last_output = (y, threading.get_ident())
        return y

    def _hint(self, guesses, misses=None):
        """Plan and hint the reads of the next layers' guesses (timed as
        prediction), after this call's ``misses`` in the same message."""
        t0 = time.monotonic_ns()
        self._store.prefetch(guesses, misses)
        self._store.stats["predict_s"] += (time.monotonic_ns() - t0) / 1e9

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
            store.start_reads(self._layout.layer, [e for e in unique if e not in stack])
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
    routers = dict(store.routers)
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
    store.set_routers(routers)
    return patched
