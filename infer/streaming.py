"""Streaming expert modules: mlx-lm's SwitchGLU / SwitchMLP with on-demand experts.

Each expert module of the mlx-lm model is replaced by ``StreamingExperts``,
which keeps the module's own ``(x, indices) -> y`` contract: it reads the
routed ids, makes sure the selected experts are in the session cache, builds
a compact stack of just those experts and runs the original module's code on
it with the ids remapped into the stack. The math per (token, expert) is the
same ``gather_qmm`` as with the whole stack, so the output is identical.
"""

import time
from collections import OrderedDict

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

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


def record_to_arrays(layout, record):
    """Copy one expert record into MLX arrays, keyed by (projection, tensor)."""
    out = {}
    for (proj, tensor), a in layout.split(record).items():
        seg_dtype = _MX_DTYPES[next(
            s.dtype for s in layout.segments if s.projection == proj and s.tensor == tensor
        )]
        arr = mx.array(a)
        if arr.dtype != seg_dtype:
            arr = arr.view(seg_dtype)
        out[(proj, tensor)] = arr
    mx.eval(list(out.values()))
    return out


class ExpertCache:
    """The session's own expert cache: LRU over (layer, expert), bounded in bytes."""

    def __init__(self, capacity_bytes):
        self.capacity = capacity_bytes
        self.nbytes = 0
        self._entries = OrderedDict()

    def get(self, key):
        arrays = self._entries.get(key)
        if arrays is not None:
            self._entries.move_to_end(key)
        return arrays

    def __contains__(self, key):
        return key in self._entries

    def put(self, key, arrays, nbytes, keep=()):
        """Insert, evicting least recently used entries not in ``keep``."""
        self._entries[key] = (arrays, nbytes)
        self.nbytes += nbytes
        if self.nbytes > self.capacity:
            for old in list(self._entries):
                if self.nbytes <= self.capacity:
                    break
                if old == key or old in keep:
                    continue
                self.nbytes -= self._entries.pop(old)[1]

    def lookup(self, key):
        entry = self.get(key)
        return None if entry is None else entry[0]


class ExpertStore:
    """Serves experts to the streaming modules: cache first, then the source.

    ``source`` is an ``infer.client.IodClient`` (or a local source with the
    same ``fetch / release / prefetch / cancel`` methods, used by benchmarks).
    With ``depth > 0`` each MoE layer also predicts the experts of the next
    ``depth`` layers by applying their routers to its own input, and asks the
    source to prefetch the ones not cached.
    """

    def __init__(self, manifest, source, cache_bytes, depth=2):
        self.manifest = manifest
        self.source = source
        self.cache = ExpertCache(cache_bytes)
        self.layouts = {l.layer: l for l in manifest.layers}
        self.depth = depth
        self.routers = {}  # layer -> (router module, top k)
        self.next_layers = {}  # layer -> the MoE layers after it, in order
        self.stats = {"hits": 0, "misses": 0, "fetched_bytes": 0, "stall_s": 0.0}
        # per depth: [true positives, predicted, actual]
        self.prediction = [[0, 0, 0] for _ in range(depth + 1)]
        self._predicted = {}  # layer -> {depth: set of experts}

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
            self._predicted.setdefault(layer, {})[d] = wanted
            missing = [e for e in sorted(wanted) if (layer, e) not in self.cache]
            if missing:
                self.source.prefetch(layer, missing)

    def _score(self, layer, actual):
        for d, guess in self._predicted.pop(layer, {}).items():
            tp = len(guess & actual)
            row = self.prediction[d]
            row[0] += tp
            row[1] += len(guess)
            row[2] += len(actual)

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

    def experts(self, layer, wanted):
        """Arrays of each wanted expert, in order; fetches the missing ones."""
        keys = [(layer, int(e)) for e in wanted]
        if self._predicted:
            self._score(layer, {k[1] for k in keys})
        missing = [k[1] for k in keys if k not in self.cache]
        self.stats["hits"] += len(keys) - len(missing)
        self.stats["misses"] += len(missing)
        if missing:
            layout = self.layouts[layer]
            tic = time.perf_counter()
            records = self.source.fetch(layer, missing)
            self.stats["stall_s"] += time.perf_counter() - tic
            try:
                for e in missing:
                    arrays = record_to_arrays(layout, records[e])
                    self.cache.put((layer, e), arrays, layout.record_bytes, keep=keys)
                    self.stats["fetched_bytes"] += layout.record_bytes
            finally:
                self.source.release(layer, missing)
        if self.depth:
            # what was prefetched for this layer and not used is dropped now
            self.source.cancel(layer)
        return [self.cache.lookup(k) for k in keys]


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
        self._projections = layout.projections
        for proj in self._projections:
            setattr(inner, proj, _projection(layout, proj))

    def __call__(self, x, indices):
        # Reading the routed ids forces evaluation up to the router: inherent
        # to streaming, and the only sync per MoE layer. The next layers'
        # guesses are evaluated in the same sync.
        guesses = self._store.predict(self._layout.layer, x) if self._store.depth else []
        mx.eval(indices, *[g[2] for g in guesses])
        self._store.prefetch(guesses)
        ids = np.array(indices)
        unique = np.unique(ids)
        arrays = self._store.experts(self._layout.layer, unique)
        for proj in self._projections:
            lin = getattr(self._inner, proj)
            for tensor in ("weight", "scales", "biases", "bias"):
                if (proj, tensor) in arrays[0]:
                    setattr(lin, tensor, mx.stack([a[(proj, tensor)] for a in arrays]))
        lut = np.zeros(self._layout.num_experts, dtype=np.uint32)
        lut[unique] = np.arange(len(unique), dtype=np.uint32)
        return self._inner(x, mx.array(lut[ids]))


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
