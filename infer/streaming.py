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
(docs/benchmarks.md, `scripts/bench_policies.py`). The experts that find no
place (a long prefill with a small cache, or one-off experts) run from a
temporary compact stack.
"""

import time
from collections import OrderedDict

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

import native
from shared.blob import NUMPY_DTYPES
from shared.source import Batch

from .client import DaemonDead

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


def _dtype(segment, cast=None):
    """The MLX dtype a segment is used in: its own, or ``cast`` for floats."""
    dtype = _MX_DTYPES[segment.dtype]
    return cast if cast is not None and mx.issubdtype(dtype, mx.floating) else dtype


def copy_mode() -> str:
    """How records reach MLX arrays: "host" on the CPU and Apple silicon,
    where an array's buffer is host memory and records are copied into it in
    place; "cuda" on a CUDA GPU, where they go by cudaMemcpy from the pinned
    arena into the arrays' device memory; else "staged" (a host array, one
    transfer and a scatter per tensor)."""
    if mx.default_device() == mx.cpu or mx.metal.is_available():
        return "host"
    return "cuda" if native.cuda_available() else "staged"


_pinned = {}  # address of a mapping -> its length: registered for CUDA copies


def _pin_for_cuda(buf):
    """Register the arena's mapping as pinned memory once (DMA at full speed)."""
    addr = native.address(buf)
    if addr not in _pinned:
        _pinned[addr] = len(buf) if native.cuda_register(buf, True) else 0


class LayerStack:
    """A layer's cached experts, stacked per tensor at fixed positions.

    Replacement: decayed frequency, misses placed best-scored first and
    only over a victim that scores no higher (``infer.belady.FreqDecayRank``
    is the same rule, simulated); ``tick()`` once per call of the layer,
    ``touch`` on each hit, ``assign`` for the misses. A stack that can hold
    every expert of its layer keeps expert e at position e, and once full (``complete``)
    runs exactly like the resident model's weights: no lookup, no sync."""

    HALF_LIFE = 16.0  # calls of the layer (tokens, in decode)

    def __init__(self, layout, capacity, cast=None):
        self.layout = layout
        self.capacity = capacity
        self.cast = cast  # dtype of the floating tensors (infer --dtype), None: as stored
        self.identity = capacity >= layout.num_experts
        self.t = 0
        self._score = {}  # expert -> (decayed access count, at t); also evicted ones
        self._decay = 0.5 ** (1.0 / self.HALF_LIFE)
        self.arrays = {}
        for s in layout.segments:
            a = mx.zeros((max(capacity, 1), *s.shape), _dtype(s, cast))
            self.arrays[(s.projection, s.tensor)] = a
        mx.eval(list(self.arrays.values()))
        # tensors whose records are copied straight into the arrays' memory
        # (host, or device by cudaMemcpy), when no cast is needed on the way
        self.mode = copy_mode()
        self.in_place = [self.mode != "staged" and _dtype(s, cast) == _MX_DTYPES[s.dtype]
                         for s in layout.segments]
        # the arrays' addresses: valid while the stack holds them (it never
        # replaces an array it writes in place)
        self._addr = [native.address(a) for a in self.arrays.values()] \
            if self.mode == "cuda" else None
        self.position = OrderedDict()  # expert -> position, least recent first
        self._free = list(range(capacity - 1, -1, -1))

    def __contains__(self, expert):
        return expert in self.position

    @property
    def complete(self) -> bool:
        return self.identity and len(self.position) == self.layout.num_experts

    def tick(self):
        self.t += 1

    def _now(self, expert):
        s, t = self._score.get(expert, (0.0, self.t))
        return s * self._decay ** (self.t - t)

    def _access(self, expert):
        self._score[expert] = (self._now(expert) + 1.0, self.t)

    def touch(self, expert):
        self.position.move_to_end(expert)
        self._access(expert)

    def victim(self, keep):
        """The cached expert to replace: lowest decayed frequency, not in
        ``keep``; on ties the least recently used (None if all are kept)."""
        best, best_s = None, None
        for e in self.position:  # least recent first: strict < keeps it on ties
            if e not in keep:
                s = self._now(e)
                if best is None or s < best_s:
                    best, best_s = e, s
        return best

    def assign(self, missing, keep):
        """{expert: position} for a call's ``missing`` experts (None: the
        call uses it from a temporary stack). The best-scored go first, each
        to a free position or its victim's, and only while it scores at
        least as high as that victim: when a call needs more experts than
        the stack holds, the stack keeps the ones used most."""
        for e in missing:
            self._access(e)
        places = {}
        for e in sorted(missing, key=lambda e: (-self._now(e), e)):
            if self.identity:
                pos = e
            elif self._free:
                pos = self._free.pop()
            else:
                victim = self.victim(keep)
                if victim is None or self._now(victim) > self._now(e):
                    places[e] = None
                    continue
                pos = self.position.pop(victim)
            self.position[e] = pos
            places[e] = pos
        return places

    def copy_in(self, batch, positions):
        """Copy ``batch``'s records to ``positions``: one native copy for all
        the tensors whose memory is host memory (and need no cast), one
        transfer (and cast) and one scatter per other tensor."""
        keys = list(self.arrays)
        direct = [i for i, ok in enumerate(self.in_place) if ok]
        if direct and self.mode == "cuda":
            _pin_for_cuda(batch.buf)
            rows = []
            for ti in direct:
                s = self.layout.segments[ti]
                for src, pos in zip(batch.offsets.tolist(), positions):
                    rows.append((self._addr[ti] + pos * s.nbytes, src + s.offset, s.nbytes))
            native.cuda_copy(batch.buf, np.array(rows, dtype=np.int64))
        elif direct:
            rows = []
            for ti in direct:
                s = self.layout.segments[ti]
                for src, pos in zip(batch.offsets.tolist(), positions):
                    rows.append((ti, pos * s.nbytes, src + s.offset, s.nbytes))
            # views of the tensors' memory for this copy only: none outlives its array
            memory = [memoryview(self.arrays[k]) for k in keys]
            try:
                native.copy_regions(memory, batch.buf, np.array(rows, dtype=np.int64))
            finally:
                for m in memory:
                    m.release()
        if len(direct) < len(keys):
            idx = mx.array(np.array(positions, dtype=np.uint32))
            rest = [s for s, ok in zip(self.layout.segments, self.in_place) if not ok]
            for key, arr in staged(self.layout, batch, cast=self.cast, segments=rest).items():
                self.arrays[key][idx] = arr

    @property
    def nbytes(self):
        return self.capacity * self.layout.record_bytes


def staged(layout, batch, order=None, cast=None, segments=None):
    """{(projection, tensor): MLX array of the batch's records (those at
    ``order``), stacked, floats cast to ``cast``}: one native copy into host
    staging and one ``mx.array`` per tensor (of ``segments``, default all)."""
    order = range(len(batch)) if order is None else order
    n = len(order)
    out = {}
    offsets = batch.offsets.tolist()
    for s in layout.segments if segments is None else segments:
        buf = np.empty((n, s.nbytes), dtype=np.uint8)
        rows = [(0, j * s.nbytes, offsets[i] + s.offset, s.nbytes) for j, i in enumerate(order)]
        native.copy_regions([buf], batch.buf, np.array(rows, dtype=np.int64))
        a = mx.array(buf.view(NUMPY_DTYPES[s.dtype]).reshape(n, *s.shape))
        dtype = _MX_DTYPES[s.dtype]
        a = a if a.dtype == dtype else a.view(dtype)
        out[(s.projection, s.tensor)] = a.astype(_dtype(s, cast)) if cast is not None else a
    return out


class ExpertStore:
    """Serves experts to the streaming modules: layer stacks first, then the source.

    ``source`` is a ``shared.source.ExpertSource``: ``infer.client.IodClient``
    (through the user's daemon) or ``iod.inproc.InprocSource`` (the same core
    in this process). ``cache_bytes`` is split evenly over the layers' stacks.
    With ``depth > 0`` each MoE layer also predicts the experts of the next
    ``depth`` layers by applying their routers to its own input, and hints
    the source to prefetch the ones not cached.
    """

    MIN_PRECISION = 0.25  # of guesses, for prefetch to go on (see prefetch_pays)
    PREFETCH_WARMUP = 64  # guessed experts scored before the precision decides
    GATE_DECAY = 0.99  # per scored guess set: the gate follows the last ~100

    def __init__(self, manifest, source, cache_bytes, depth=2):
        self.manifest = manifest
        self.source = source
        self.cache_bytes = cache_bytes
        self.layouts = {l.layer: l for l in manifest.layers}
        self.stacks = {}
        self.depth = depth
        self.routers = {}  # layer -> (router module, top k)
        self.next_layers = {}  # layer -> the MoE layers after it, in order
        self.stats = {"hits": 0, "misses": 0, "fetched_bytes": 0, "stall_s": 0.0}
        self.dtype = None  # an mx.Dtype to cast floating expert tensors to (infer --dtype)
        self.trace = None  # set to a list to record (layer, experts) per call
        self.profiler = None  # an infer.profile.Profiler: per-layer spans
        # per depth: [true positives, predicted, actual]
        self.prediction = [[0, 0, 0] for _ in range(depth + 1)]
        self._predicted = {}  # layer -> {depth: (set of experts, prefetchable)}
        # per depth: decayed [right, guessed] of prefetchable (decode-sized)
        # guesses, which decide whether prefetch pays (prefill's are left out:
        # guessing most of a layer is always right and says nothing)
        self._gate = [[0.0, 0.0] for _ in range(depth + 1)]

    def stack(self, layer):
        if layer not in self.stacks:
            layout = self.layouts[layer]
            share = self.cache_bytes // len(self.layouts)
            capacity = min(share // layout.record_bytes, layout.num_experts)
            self.stacks[layer] = LayerStack(layout, capacity, self.dtype)
        return self.stacks[layer]

    def set_routers(self, routers):
        self.routers = routers
        order = sorted(routers)
        self.next_layers = {l: order[i + 1 :] for i, l in enumerate(order)}

    def predict(self, layer, x):
        """Lazy top-k guesses for the next layers: [(layer, depth, ids)]."""
        out = []
        for d, nxt in enumerate(self.next_layers.get(layer, [])[: self.depth], 1):
            router, k = self.routers[nxt]
            scores = router(x)
            if isinstance(scores, tuple):  # routers that select, e.g. DeepSeek's
                ids = scores[0]
            else:
                ids = mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]
            out.append((nxt, d, ids))
        return out

    def prefetch(self, guesses):
        for layer, d, ids in guesses:
            wanted = set(np.unique(np.array(ids)).tolist())
            # a prefill-sized call: its next layers need most experts anyway,
            # and reading them all ahead would crowd out demand
            small = len(wanted) <= 2 * self.routers[layer][1]
            self._predicted.setdefault(layer, {})[d] = (wanted, small)
            if not small:
                continue
            if not self.prefetch_pays(d):
                continue  # still scored: prefetch resumes if guesses improve
            stack = self.stack(layer)
            missing = [e for e in sorted(wanted) if e not in stack]
            if missing:
                self._call("prefetch", layer, missing, d)

    def prefetch_pays(self, depth):
        """Whether guesses at ``depth`` are right often enough to be read
        ahead: a wrong guess costs a read (and, when reads are the bottleneck,
        a demand read's turn), a right one saves a stall. Measured, not
        assumed: prefetch runs until ``PREFETCH_WARMUP`` guesses are scored,
        then only while their recent precision (decode-sized guesses, decayed
        by ``GATE_DECAY`` per guess) is at least ``MIN_PRECISION``."""
        if depth >= len(self._gate):
            return True
        right, guessed = self._gate[depth]
        return guessed < self.PREFETCH_WARMUP or right >= self.MIN_PRECISION * guessed

    def _score(self, layer, actual):
        for d, (guess, small) in self._predicted.pop(layer, {}).items():
            row = self.prediction[d]
            right = len(guess & actual)
            row[0] += right
            row[1] += len(guess)
            row[2] += len(actual)
            if small and d < len(self._gate):
                g = self._gate[d]
                g[0] = g[0] * self.GATE_DECAY + right
                g[1] = g[1] * self.GATE_DECAY + len(guess)

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

    def gather(self, layer, wanted):
        """(arrays, positions): tensors holding every wanted expert, and each
        expert's position in them."""
        wanted = [int(e) for e in wanted]
        if self.trace is not None:
            self.trace.append((layer, tuple(wanted)))
        if self._predicted:
            self._score(layer, set(wanted))
        stack = self.stack(layer)
        stack.tick()
        missing = [e for e in wanted if e not in stack]
        self.stats["hits"] += len(wanted) - len(missing)
        self.stats["misses"] += len(missing)
        for e in wanted:
            if e in stack:
                stack.touch(e)
        if not missing:
            return stack.arrays, [stack.position[e] for e in wanted]
        keep = set(wanted)
        places = stack.assign(missing, keep)
        if all(p is not None for p in places.values()):
            self._fetch(layer, missing, lambda batch: stack.copy_in(
                batch, [places[e] for e in batch.experts]))
            return stack.arrays, [stack.position[e] for e in wanted]
        # more experts than the stack holds (a long prefill with a small
        # cache): the ones that found a place are copied in, and the call
        # runs on a temporary compact stack of every wanted expert
        parts = []

        def copy(batch):
            placed = [i for i, e in enumerate(batch.experts) if places[e] is not None]
            if placed:
                sub = Batch(batch.buf, [batch.experts[i] for i in placed],
                            batch.offsets[placed], [batch.sizes[i] for i in placed])
                stack.copy_in(sub, [places[e] for e in sub.experts])
            rest = [i for i, e in enumerate(batch.experts) if places[e] is None]
            if rest:
                parts.append(([batch.experts[i] for i in rest],
                              staged(stack.layout, batch, rest, cast=self.dtype)))

        self._fetch(layer, missing, copy)
        cached = [e for e in wanted if e in stack]
        order = cached + [e for experts, _ in parts for e in experts]
        index = mx.array(np.array([stack.position[e] for e in cached], dtype=np.uint32))
        arrays = {}
        for key, arr in stack.arrays.items():
            pieces = ([arr[index]] if cached else []) + [p[key] for _, p in parts]
            arrays[key] = mx.concatenate(pieces) if len(pieces) > 1 else pieces[0]
        where = {e: i for i, e in enumerate(order)}
        return arrays, [where[e] for e in wanted]

    def preload(self, order=None):
        """Fill each layer's stack before the first token: ``order`` maps a
        layer to its experts, most wanted first (a calibration's counts);
        without it, every expert in index order. Returns the experts loaded."""
        n = 0
        for layer, layout in self.layouts.items():
            stack = self.stack(layer)
            if stack.capacity <= 0:
                continue
            ranked = list(order.get(layer, ())) if order else list(range(layout.num_experts))
            want = [e for e in ranked if e not in stack][: stack.capacity - len(stack.position)]
            if not want:
                continue
            places = stack.assign(want, set(want))
            want = [e for e in want if places[e] is not None]
            self._fetch(layer, want, lambda batch: stack.copy_in(
                batch, [places[e] for e in batch.experts]))
            n += len(want)
        return n

    def _call(self, name, *args):
        """A source call that survives the death of an embedded daemon: with
        ``iod="auto"`` the client starts or attaches a fresh one; the experts
        already copied into the stacks stay valid, so generation carries on."""
        try:
            return getattr(self.source, name)(*args)
        except DaemonDead:
            if getattr(self.source, "iod", None) != "auto":
                raise
            self.stats["reconnects"] = self.stats.get("reconnects", 0) + 1
            self.source.reconnect()
            return getattr(self.source, name)(*args) if name == "fetch_into" else None

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
        nbytes = layout.record_bytes * len(experts)
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


class StreamingExperts(nn.Module):
    """Drop-in replacement for one expert module (SwitchGLU / SwitchMLP)."""

    def __init__(self, inner, layout, store):
        super().__init__()
        self._inner = inner
        self._layout = layout
        self._store = store
        for proj in layout.projections:
            setattr(inner, proj, _projection(layout, proj))

    def __call__(self, x, indices):
        store = self._store
        stack = store.stacks.get(self._layout.layer)
        if stack is not None and stack.complete and store.trace is None:
            # every expert resident at its own index: the resident model's call
            store.stats["hits"] += indices.size
            return self._inner(x, indices)
        # Reading the routed ids forces evaluation up to the router: inherent
        # to streaming, and the only sync per MoE layer. The next layers'
        # guesses are evaluated in the same sync.
        guesses = store.predict(self._layout.layer, x) if store.depth else []
        t0 = time.monotonic_ns() if store.profiler else 0
        mx.eval(indices, *[g[2] for g in guesses])
        if store.profiler:  # the compute since the previous sync, up to this router
            store.profiler.span("compute", self._layout.layer, t0, time.monotonic_ns())
        store.prefetch(guesses)
        ids = np.array(indices)
        unique = np.unique(ids)
        arrays, positions = store.gather(self._layout.layer, unique)
        for (proj, tensor), arr in arrays.items():
            setattr(getattr(self._inner, proj), tensor, arr)
        lut = np.zeros(self._layout.num_experts, dtype=np.uint32)
        lut[unique] = positions
        y = self._inner(x, mx.array(lut[ids]))
        stack = store.stacks[self._layout.layer]
        if arrays is not stack.arrays:
            # a temporary compact stack: the graph of y holds it until y is
            # evaluated; the module must not keep it alive until the layer's
            # next call (one per layer adds up to several layers' experts)
            for key, arr in stack.arrays.items():
                setattr(getattr(self._inner, key[0]), key[1], arr)
        return y


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
    """(router module, top k) of an MoE block, found by mlx-lm's names."""
    router = block.get("gate") if "gate" in block else block.get("router")
    k = getattr(block, "top_k", None) or getattr(block, "num_experts_per_tok", None)
    if router is None or k is None or not callable(router):
        return None
    return router, int(k)


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
