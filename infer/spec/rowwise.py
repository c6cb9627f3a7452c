"""A batched forward pass whose rows are computed as one-token passes.

A verify pass over K+1 tokens costs about one token on a GPU when it is one
batched forward, but some of its operations take a different kernel for
several rows than for one, so its logits need not be the bits that plain
one-token decoding gives. ``RowwisePass`` runs the batched forward with the
operations whose result for a row depends on the other rows, or on how many
there are, done row by row exactly as one-token decoding does them:

- attention (``mx.fast.scaled_dot_product_attention``): each query row on
  its own, against the keys up to its own position, with no mask — the call
  one-token decoding makes (one query, ``mask=None``) — unless a probe shows
  that the backend computes every row of a causal batch of that many rows
  bit for bit as it computes the row alone (MLX's CPU, as measured; not
  MLX CUDA 0.32): then the batch is one call, which costs less host time
  than one call a row where a step is host-bound;
- causal convolutions (``nn.Conv1d`` over ``[state | new inputs]``, the
  Gated-DeltaNet layers): one output position per call, over its own window;
- the gated-delta recurrence: one step per call (its state after every
  token is kept, so a rejected draft is rolled back exactly);
- KV buffers grow in the 256-token steps one-token decoding grows them in
  (a batched update would grow them to a length no one-token pass sees).

Everything else stays batched: matrix products whose kernels compute each
row on its own (MLX's quantized matrix-vector kernels take a few rows at a
time, and gather_qmm computes each (row, expert) product separately),
norms, rotary embeddings and element-wise operations. Whether those really
give the same bits for a row in a batch as alone is the backend's business:
``mismatch_rows`` in ``infer.spec.decoder`` measures it (``infer bench
--draft-check``); this module only removes the differences that are certain.

Supported caches: ``KVCache`` (full attention) and the ``ArraysCache`` of
gated-delta layers; with any other (sliding windows, quantized caches, SSM
layers) ``supported`` is False and the caller verifies in lockstep instead.
"""

import sys
import threading

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache

_TLS = threading.local()


class RowwiseUnsupported(RuntimeError):
    pass


def _gated_delta_layers(model):
    """Modules with a causal conv and a gated-delta recurrence (Qwen3-Next's
    linear attention), found by what they use."""
    out = []
    for _, m in model.named_modules():
        mod = sys.modules.get(type(m).__module__)
        if isinstance(getattr(m, "conv1d", None), nn.Conv1d) and hasattr(mod, "gated_delta_update"):
            out.append(m)
    return out


def supported(model, cache):
    """Whether every cache is one this module rolls back and computes exactly."""
    n_arrays = sum(isinstance(c, ArraysCache) for c in cache)
    if any(not isinstance(c, (KVCache, ArraysCache)) for c in cache):
        return False
    if any(type(c).__name__ in ("QuantizedKVCache",) for c in cache):
        return False
    return n_arrays == len(_gated_delta_layers(model))


def grow_kv(cache, n):
    """Grow the KV buffers that ``n`` more tokens would overflow by whole
    steps at their full length, as one-token updates grow them (a batched
    update would cut the buffer at its offset first, to a length one-token
    decoding never has, and some backends choose kernels by that length)."""
    for c in cache:
        if not isinstance(c, KVCache) or c.keys is None:
            continue
        while c.offset + n > c.keys.shape[2]:
            B, H, _, D = c.keys.shape
            k = mx.zeros((B, H, c.step, D), c.keys.dtype)
            v = mx.zeros((B, c.values.shape[1], c.step, c.values.shape[3]), c.values.dtype)
            c.keys = mx.concatenate([c.keys, k], axis=2)
            c.values = mx.concatenate([c.values, v], axis=2)


class RowwisePass:
    """Context in which a model's batched forward computes rows as one-token
    passes do (see the module docstring), confined to the pass: its
    gated-delta layers and their convolutions are switched to row-wise
    subclasses of their own classes for the pass (other objects of those
    classes are untouched), and attention and the gated-delta recurrence go
    row-wise only in the thread that runs the pass, while it runs (a
    dispatcher installed once in front of each; any other forward, in
    another thread or after the pass, calls mlx and mlx-lm's own)."""

    def __init__(self, model):
        self.model = model
        self.layers = _gated_delta_layers(model)
        for mod in {sys.modules[type(m).__module__] for m in self.layers}:
            _dispatch(mod, "gated_delta_update", _stepwise_gdu, lambda: getattr(_TLS, "rec", None) is not None)
        _dispatch(mx.fast, "scaled_dot_product_attention", _rowwise_sdpa,
                  lambda: getattr(_TLS, "active", None) is not None)
        self._swapped = []

    def __enter__(self):
        if getattr(_TLS, "active", None) is not None:
            raise RuntimeError("a row-wise pass is already running in this thread")
        for m in self.layers:
            self._swap(m, _RecordingGDN)
            self._swap(m.conv1d, _RowwiseConv)
        _TLS.active = self
        return self

    def _swap(self, obj, mixin):
        self._swapped.append((obj, type(obj)))
        obj.__class__ = _subclass(type(obj), mixin)

    def __exit__(self, *exc):
        for obj, cls in reversed(self._swapped):
            obj.__class__ = cls
        self._swapped = []
        _TLS.active = None
        _TLS.rec = None
        return False


def _dispatch(owner, name, rowwise, active):
    """Put a dispatcher in front of ``owner.name``, once: it calls
    ``rowwise(original)`` while ``active()`` (a test of this thread's
    state), else the original."""
    orig = getattr(owner, name)
    if getattr(orig, "_rowwise_original", None) is not None:
        return
    alt = rowwise(orig)

    def call(*args, **kw):
        return (alt if active() else orig)(*args, **kw)

    call._rowwise_original = orig
    setattr(owner, name, call)


_SUBCLASSES = {}  # (class, mixin) -> the row-wise subclass


def _subclass(cls, mixin):
    """``cls`` with ``mixin``'s call in front (made once per class)."""
    key = (cls, mixin)
    if key not in _SUBCLASSES:
        _SUBCLASSES[key] = type(cls.__name__, (mixin, cls), {})
    return _SUBCLASSES[key]


# (function, rows, dtype, heads, kv heads, head dim, scale) -> whether a
# causal batch's rows are the bits of lone rows (batch_is_rows)
_BATCH_IS_ROWS = {}


def _rows_alone(orig, q, k, v, *args, scale, **kw):
    """Each query row against the keys up to its position, as one-token decoding calls it."""
    L, S = q.shape[2], k.shape[2]
    return mx.concatenate([orig(qj, k[:, :, : S - L + j + 1], v[:, :, : S - L + j + 1],
                                *args, scale=scale, mask=None, **kw)
                           for j, qj in enumerate(mx.split(q, L, axis=2))], axis=2)


def batch_is_rows(orig, L, dtype, heads, kv_heads, head_dim, scale):
    """Whether ``orig`` computes each row of a causal batch of ``L`` query rows
    bit for bit as a lone query over the keys up to its position. Probed once
    per shape on random inputs, over key lengths on both sides of where
    kernels change (MLX splits the keys in two passes past 1024)."""
    key = (orig, L, dtype, heads, kv_heads, head_dim, scale)
    if key not in _BATCH_IS_ROWS:
        ok = True
        rng = mx.random.key(0)
        for S in (L, L + 5, 127, 300, 1024, 1025, 1024 + L, 2049, 4096 + L, 8192 + L):
            kq, kk, kv_, rng = mx.random.split(rng, 4)
            q = mx.random.normal((1, heads, L, head_dim), key=kq).astype(dtype)
            k = mx.random.normal((1, kv_heads, S, head_dim), key=kk).astype(dtype)
            v = mx.random.normal((1, kv_heads, S, head_dim), key=kv_).astype(dtype)
            batch = orig(q, k, v, scale=scale, mask="causal")
            same = mx.array_equal(batch, _rows_alone(orig, q, k, v, scale=scale))
            if not same.item():
                ok = False
                break
        _BATCH_IS_ROWS[key] = ok
    return _BATCH_IS_ROWS[key]


def _rowwise_sdpa(orig):
    def sdpa(q, k, v, *args, scale, mask=None, **kw):
        L = q.shape[2]
        if L == 1:
            return orig(q, k, v, *args, scale=scale, mask=mask, **kw)
        if not (mask is None or (isinstance(mask, str) and mask == "causal")):
            raise RowwiseUnsupported("attention with an explicit mask")
        plain = not args and all(v is None for v in kw.values())  # no sinks
        if plain and batch_is_rows(orig, L, q.dtype, q.shape[1], k.shape[1], q.shape[3], scale):
            return orig(q, k, v, scale=scale, mask="causal")
        return _rows_alone(orig, q, k, v, *args, scale=scale, **kw)

    return sdpa


class _RowwiseConv:
    """A causal convolution of the pass: one output position per call."""

    def __call__(self, x):
        orig = super().__call__
        rec = getattr(_TLS, "rec", None)
        if rec is not None:
            rec["conv_input"] = x
        K = self.weight.shape[1]
        L = x.shape[1]
        if L <= K:
            return orig(x)
        if self.padding != 0 or self.stride != 1 or self.dilation != 1:
            raise RowwiseUnsupported("a convolution with padding, stride or dilation")
        outs = [orig(mx.contiguous(x[:, j : j + K, :])) for j in range(L - K + 1)]
        return mx.concatenate(outs, axis=1)


def _stepwise_gdu(orig):
    def gdu(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, **kw):
        T = q.shape[1]
        if T == 1:
            return orig(q, k, v, a, b, A_log, dt_bias, state, mask, **kw)
        ys, states = [], []
        for t in range(T):
            y, state = orig(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1],
                            a[:, t : t + 1], b[:, t : t + 1], A_log, dt_bias, state,
                            None if mask is None else mask[:, t : t + 1], **kw)
            ys.append(y)
            states.append(state)
        rec = getattr(_TLS, "rec", None)
        if rec is not None:
            rec["states"] = states
        return mx.concatenate(ys, axis=1), state

    return gdu


class _RecordingGDN:
    """A gated-delta layer of the pass: it leaves one recorded state per
    token in a recording cache (``infer.spec.decoder``), instead of one for
    all; the recurrence runs a step a call meanwhile (``_stepwise_gdu``)."""

    def __call__(self, inputs, mask=None, cache=None):
        _TLS.rec = rec = {}
        try:
            out = super().__call__(inputs, mask=mask, cache=cache)
        finally:
            _TLS.rec = None
        S = inputs.shape[1]
        history = getattr(cache, "history", None)
        if history is not None and S > 1:
            states, x = rec.get("states"), rec.get("conv_input")
            if states is None or x is None or len(states) != S or not history:
                raise RowwiseUnsupported("a gated-delta layer that did not run as expected")
            n, _ = history.pop()  # the state after all S tokens, from advance(S)
            keep = x.shape[1] - S  # the conv state's length
            for j in range(S):
                history.append((1, [x[:, j + 1 : j + 1 + keep, :], states[j]]))
        return out
