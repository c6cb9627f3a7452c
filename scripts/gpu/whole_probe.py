#!/usr/bin/env python3
"""Whole layers against the resident model, and where their memory lies.

usage: scripts/gpu/whole_probe.py PREP [--tokens 96] [--block 8] [--dtype bfloat16] [--json OUT]

At a budget of 1.0 every stack holds its whole layer and runs the resident
model's call (no sync), yet a lease measured the iod side at 69.5 tok/s
against the resident model's 118.6 in separate processes. This decodes the
same forced text block by block on both, interleaved (scripts/bench_pair.py's
loop), twice: with the stacks as the session filled them (zeros made by MLX,
records copied in by cudaMemcpy from the pinned arena), then with every stack
array replaced by a copy MLX computes on the device. If the second ratio is
the higher, where the stacks' memory lies costs; if both are ~1, nothing in
the whole call does. bfloat16 by default (as stored), CUDA graphs as the
process has them.
"""
import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_pair  # noqa: E402

from infer import bench  # noqa: E402
from infer.args import DTYPES, mx_dtype  # noqa: E402
from infer.runtime.budget import staging_arena_bytes  # noqa: E402
from infer.runtime.client import IodClient  # noqa: E402
from infer.runtime.gate import PredictionGate  # noqa: E402
from infer.runtime.loader import cast_model, load_streaming  # noqa: E402
from shared.blob import Manifest  # noqa: E402


def main():
    p = argparse.ArgumentParser(prog="whole_probe.py", description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    args.prompt, args.budget = "@pycode", "1.0"
    manifest = Manifest.load(args.model)
    resident, tok = bench.load_resident(args.model)
    cast_model(resident, mx_dtype(args.dtype))
    daemon = bench._start_daemon(staging_arena_bytes(manifest, 3), 0.0)
    client = None
    out = {"model": args.model}
    try:
        client = IodClient(args.model, iod=str(daemon[2]))
        cache_bytes = bench.cache_bytes_of(args.budget, manifest, "none", args.model)
        streamed, _, store = load_streaming(args.model, client, cache_bytes, dtype=mx_dtype(args.dtype))
        store.gate = PredictionGate("off")
        models = {"resident": resident, "iod": streamed}
        out["as_filled"] = bench_pair.run(args, tok, models, store)
        # every stack array replaced by a device copy (a gather MLX computes)
        for stack in store.stacks.values():
            for key, a in stack.arrays.items():
                stack.arrays[key] = mx.take(a, mx.arange(a.shape[0]), axis=0)
            mx.eval(list(stack.arrays.values()))
        out["device_copies"] = bench_pair.run(args, tok, models, store)
    finally:
        if client is not None:
            client.close()
        bench._stop_daemon(daemon)
    for name in ("as_filled", "device_copies"):
        r = out[name]
        print(f"{name}: iod / resident median {r['ratio_median']:.3f} "
              f"[{r['ratio_quartiles'][0]:.3f}-{r['ratio_quartiles'][1]:.3f}]; resident "
              f"{r['tok_s']['resident']:.1f}, iod {r['tok_s']['iod']:.1f} tok/s; whole calls "
              f"{r['whole_calls']}; ids equal {r['ids_equal']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0 if all(out[n]["ids_equal"] for n in ("as_filled", "device_copies")) else 1


if __name__ == "__main__":
    sys.exit(main())
