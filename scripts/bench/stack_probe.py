#!/usr/bin/env python3
"""Where a compact stack's time goes: made, filled, computed on.

usage: scripts/bench/stack_probe.py PREP [--layer L] [--experts N] [--tokens T] [--rounds R] [--json F]

A long prefill's call of a streamed layer copies its misses into a compact
stack made for that call (``ExpertStore._gather``). On MLX CUDA a stack's
arrays move to managed memory when their address is taken for the copies
(MLX's ``move_to_unified_memory``), so a new stack's pages may first be
touched by the copy engine or by the kernel. This times, for N experts of
layer L (records read from the blob into a buffer, registered as pinned
host memory where CUDA is there), the median over R rounds of:

- ``make``: a new LayerStack (zeros, evaluated, addresses taken);
- ``copy``: its records copied in (``LayerStack.copy_in``);
- ``first`` / ``again``: gather_qmm of T tokens (top k of the layer's
  experts, over the N) on the new stack, then once more;
- ``kept``: the same compute on a stack made once and filled each round;
- ``device``: on a copy of the stack that MLX made (its own memory).

On the CPU (and Apple silicon) stacks are host memory: a baseline for the
same steps. One line per step, and a JSON with every round.
"""
import argparse
import json
import mmap
import statistics
import time

import mlx.core as mx
import numpy as np

import native
from infer.runtime.streaming import LayerStack
from shared.blob import Manifest, read_record
from shared.source import Batch


class _Pinned:
    """The source a Batch names, for a buffer this script registered."""

    def __init__(self, pinned):
        self.pinned = pinned

    def pin_for_cuda(self):
        return self.pinned


def _ms(f):
    mx.synchronize()
    t0 = time.perf_counter()
    out = f()
    mx.synchronize()
    return (time.perf_counter() - t0) * 1e3, out


def _compute(layout, arrays, x, idx):
    """The first projection's gather_qmm of ``x`` over ``arrays`` (mlx-lm's SwitchGLU call)."""
    proj = layout.projections[0]
    q = layout.quantization.get(proj) or {}
    w = arrays[(proj, "weight")]
    if q:
        return mx.gather_qmm(x, w, arrays[(proj, "scales")], arrays.get((proj, "biases")),
                             rhs_indices=idx, transpose=True, group_size=int(q["group_size"]),
                             bits=int(q["bits"]), mode=q.get("mode", "affine"))
    return mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=idx)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prep")
    ap.add_argument("--layer", type=int, default=None, help="default: the first expert layer")
    ap.add_argument("--experts", type=int, default=96)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    manifest = Manifest.load(a.prep)
    layout = manifest.layer(a.layer if a.layer is not None else manifest.layers[0].layer)
    n = min(a.experts, layout.num_experts)
    buf = mmap.mmap(-1, n * layout.stride)
    for e in range(n):
        rec = read_record(a.prep, layout, e)
        buf[e * layout.stride:e * layout.stride + len(rec)] = rec
    pinned = bool(native.cuda_available() and native.cuda_register(buf, True))
    batch = Batch(buf, list(range(n)), [e * layout.stride for e in range(n)],
                  [layout.record_bytes] * n, _Pinned(pinned))
    w = layout.segments[0]
    dtype = mx.bfloat16 if any(s.dtype == "bfloat16" for s in layout.segments) else mx.float32
    hidden = w.shape[-1] * (32 // int((layout.quantization.get(w.projection) or {"bits": 32})["bits"]))
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((a.tokens, 1, 1, hidden)).astype(np.float32)).astype(dtype)
    idx = mx.array(np.stack([rng.choice(n, a.top_k, replace=False) for _ in range(a.tokens)])
                   .astype(np.uint32))
    mx.eval(x, idx)

    kept = LayerStack(layout, n)
    rounds = []
    for r in range(a.rounds + 1):  # round 0 builds the kernels, not kept
        row = {}
        row["make"], stack = _ms(lambda: LayerStack(layout, n))
        row["copy"], _ = _ms(lambda: stack.copy_in(batch, list(range(n))))
        row["first"], _ = _ms(lambda: mx.eval(_compute(layout, stack.arrays, x, idx)))
        row["again"], _ = _ms(lambda: mx.eval(_compute(layout, stack.arrays, x, idx)))
        kept.copy_in(batch, list(range(n)))
        row["kept"], _ = _ms(lambda: mx.eval(_compute(layout, kept.arrays, x, idx)))
        own = {k: v + 0 for k, v in stack.arrays.items()}  # (computed: MLX's memory)
        mx.eval(list(own.values()))
        row["device"], _ = _ms(lambda: mx.eval(_compute(layout, own, x, idx)))
        stack = own = None  # (this round's stack goes before the next is made)
        if r:
            rounds.append(row)
    mb = n * layout.record_bytes / 1e6
    print(f"{mx.default_device()}, copy mode {kept.mode}, pinned {pinned}: layer {layout.layer}, "
          f"{n} experts ({mb:.0f} MB), {a.tokens} tokens, top {a.top_k}; median of {a.rounds} rounds")
    for step in rounds[0]:
        v = [row[step] for row in rounds]
        extra = f"  ({mb / statistics.median(v):.1f} GB/s)" if step == "copy" else ""
        print(f"  {step:7s} {statistics.median(v):9.2f} ms  [{min(v):.2f}-{max(v):.2f}]{extra}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": str(mx.default_device()), "mode": kept.mode, "pinned": pinned,
                       "layer": layout.layer, "experts": n, "mb": mb, "tokens": a.tokens,
                       "rounds": rounds}, f, indent=1)


if __name__ == "__main__":
    main()
