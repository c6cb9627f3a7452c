"""A recorded trace's routing forced onto a model (`infer bench --routing-trace`).

A random-weight model routes without structure; a real model reuses its
experts from token to token. To give a benchmark a real model's IO pattern,
each MoE block's router is wrapped: it still computes its logits (their
cost stays in the step), but the top k it picks are the trace's experts of
that layer for that token. Token p of a generation takes the trace's token
p (cycling through the trace's first session), so every mode of a bench
(the resident one too) routes the same and their ids stay comparable.

Only the block's own call of its router is forced. A streamed layer also
applies the next layers' routers to guess their experts (prediction); those
calls come while an expert module runs, and get the router's own logits: a
guess must not see the trace, or it would be an oracle.
"""

from typing import Dict, List

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from infer.runtime.taps import expert_paths, module_at
from infer.tools.trace import Trace, TraceError

FORCED = 30.0  # a trace expert's logit: past any other the router gives after its softmax


def token_rows(trace: Trace) -> List[Dict[int, tuple]]:
    """The first session's tokens in order, each {layer index: experts}, the
    layers renumbered 0.. in the trace's order."""
    order = {layer: i for i, layer in enumerate(trace.layers)}
    rows = []
    for call in trace.sessions[0]:
        for tok in call.tokens:
            if len(tok) == len(order):
                rows.append({order[l]: tuple(e) for l, e in tok.items()})
    if not rows:
        raise TraceError(f"{trace.path}: no token with every layer's experts to replay")
    return rows


class _ForcedGate(nn.Module):
    """A router whose choice is the trace's: its own logits, then the trace's
    experts lifted above every other."""

    def __init__(self, inner, table: mx.array, routing):
        super().__init__()
        self.inner = inner
        self._table = table  # [trace tokens, experts]: FORCED at the trace's experts, else 0
        self._routing = routing

    def __call__(self, x):
        logits = self.inner(x)
        if self._routing.inside:  # a guess made from an earlier layer
            return logits
        rows = x.shape[-2] if x.ndim > 1 else 1
        at = self._routing.take(self, rows)
        forced = self._table[mx.array(at)].astype(logits.dtype)
        # the router's own logits stay in the graph (their compute is the
        # model's), but only the trace's choice reaches the softmax
        return mx.depends(forced.reshape(logits.shape), logits)


class _Inside(nn.Module):
    """Wraps an expert module: marks the time it runs (see the module docstring)."""

    def __init__(self, inner, routing):
        super().__init__()
        self.inner = inner
        self._routing = routing

    def __call__(self, x, indices):
        self._routing.inside += 1
        try:
            return self.inner(x, indices)
        finally:
            self._routing.inside -= 1


class ForcedRouting:
    """Installed on a model's MoE blocks; ``reset()`` before each generation."""

    def __init__(self, trace: Trace):
        self.trace = trace
        self.rows = token_rows(trace)
        self._next = {}  # gate -> the next token position it routes
        self.inside = 0  # expert modules running now

    def install(self, model, paths=None) -> int:
        """Wrap the router beside each expert module (``paths``, in layer
        order; default: mlx-lm's SwitchGLU / SwitchMLP modules of ``model``);
        returns the MoE layers wrapped."""
        paths = expert_paths(model) if paths is None else paths
        if len(paths) != len(self.trace.layers):
            raise TraceError(f"{self.trace.path}: the trace routes {len(self.trace.layers)} MoE layers; "
                             f"the model has {len(paths)}")
        for i, path in enumerate(paths):
            block = module_at(model, path.rpartition(".")[0])
            name = "gate" if "gate" in block else "router"
            gate = block[name]
            experts = _num_experts(block, gate)
            if experts != self.trace.num_experts:
                raise TraceError(f"{self.trace.path}: the trace routes over {self.trace.num_experts} "
                                 f"experts; the model's layers have {experts}")
            table = np.zeros((len(self.rows), experts), np.float32)
            for t, row in enumerate(self.rows):
                table[t, list(row[i])] = FORCED
            for key in ("top_k", "num_experts_per_tok"):  # the trace's k, as the block reads it
                if isinstance(getattr(block, key, None), int):
                    setattr(block, key, self.trace.top_k)
            block[name] = _ForcedGate(gate, mx.array(table), self)
            expert_name = path.rpartition(".")[2]
            block[expert_name] = _Inside(block[expert_name], self)
        self.reset()
        return len(paths)

    def check(self, manifest) -> dict:
        """Refuse a prep folder whose MoE layers or experts the trace does not
        fit (before any model loads); returns ``describe()``."""
        layers = [l for l in manifest.layers if not l.module.startswith("mtp.")]
        t = self.trace
        if len(layers) != len(t.layers):
            raise TraceError(f"{t.path}: the trace routes {len(t.layers)} MoE layers; "
                             f"the model has {len(layers)}")
        other = {l.num_experts for l in layers} - {t.num_experts}
        if other:
            raise TraceError(f"{t.path}: the trace routes over {t.num_experts} experts; "
                             f"the model's layers have {min(other)}")
        return self.describe()

    def reset(self):
        self._next = {}
        self.inside = 0

    def take(self, gate, rows: int) -> np.ndarray:
        """The trace tokens of a call of ``rows`` tokens at ``gate``'s layer."""
        start = self._next.get(id(gate), 0)
        self._next[id(gate)] = start + rows
        return np.arange(start, start + rows) % len(self.rows)

    def describe(self) -> dict:
        t = self.trace
        return {"path": t.path, "format": t.format, "sha256": t.sha256, "top_k": t.top_k,
                "layers": len(t.layers), "experts": t.num_experts, "tokens": len(self.rows)}


def _num_experts(block, gate) -> int:
    n = getattr(block, "num_experts", None)
    if isinstance(n, int):
        return n
    w = getattr(gate, "weight", None)
    if w is None:
        raise TraceError("a router without a weight: its experts cannot be counted")
    return w.shape[0]
