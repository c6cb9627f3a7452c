#!/usr/bin/env python3
"""Streaming through iod against the resident model, interleaved in one process.

usage: scripts/bench/bench_pair.py PREP [--budget 0.25] [--tokens 96] [--block 4]
                             [--prompt @pycode] [--predict auto|on|off]
                             [--dtype float32|bfloat16|float16] [--json OUT]

On a shared, noisy machine two `infer bench` runs a minute apart can differ
by 20% (this 2-core machine: resident 3.1-4.4 tok/s on the same model), so
the ratio of separate runs says little. Here both models live in one
process and decode the same forced text (--dtype, float32 by default as
MLX's CPU kernels want; bfloat16 on a GPU, as stored; the bench's fixed text
after the prompt) block by block: BLOCK tokens on one, the same BLOCK on
the other, the order reversed every block. Whatever slows the machine for
a while slows both sides of a pair. The iod side has a private daemon and
the budget's cache, started as `infer run` starts it (the cold-start
preload of usage.json, where the folder has one; `infer bench` starts
cold); the prompt is taken raw (as `infer bench --raw-prompt`). Reported:
per pair, iod's speed over resident's; their median and quartiles; stall
per token; and whether both decoded the same ids (they must). On MLX
CUDA the process's graphs setting holds for both sides, and the resident
model is evaluated before the streamed one could turn graphs off (as
infer.runtime.loader does where a layer streams): at a partial budget, set
MLX_USE_CUDA_GRAPHS=0 to time the iod side as `infer bench` does.
"""
import argparse
import json
import statistics
import sys
import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from shared.launch import start_daemon, stop_daemon

from infer.tools import bench

from infer.args import DTYPES, mx_dtype
from infer.tools.bench_draft import resolve_prompt
from infer.runtime.budget import staging_arena_bytes
from infer.runtime.source import make_source
from infer.runtime.gate import PredictionGate
from infer.runtime.loader import cast_model, load_streaming
from infer.run import encode_prompt
from infer.tools.resident import load_resident
from shared.blob import Manifest

def main(argv=None):
    p = argparse.ArgumentParser(prog="bench_pair.py", description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--budget", default="0.25")
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--block", type=int, default=4)
    p.add_argument("--prompt", default="@pycode")
    p.add_argument("--predict", choices=("auto", "on", "off"), default="auto",
                   help="the iod side's prediction gate (infer.runtime.gate)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="both models' activations")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.tokens < 2 * args.block or args.block < 1:
        p.error("--tokens must hold at least two blocks")

    manifest = Manifest.load(args.model)
    resident, tok = load_resident(args.model)
    dtype = mx_dtype(args.dtype)
    cast_model(resident, dtype)
    daemon = start_daemon(staging_arena_bytes(manifest, 3), 0.0)
    client = None
    try:
        client = make_source(args.model, str(daemon[2]))
        cache_bytes = bench.cache_bytes_of(args.budget, manifest, "none", args.model)
        streamed, _, store = load_streaming(args.model, client, cache_bytes, dtype=dtype)
        store.prefetcher.gate = PredictionGate(args.predict)
        result = run(args, tok, {"resident": resident, "iod": streamed}, store)
    finally:
        if client is not None:
            client.close()
        stop_daemon(daemon)
    result.update({"model": args.model, "budget": args.budget, "cache_bytes": cache_bytes,
                   "predict": args.predict, "dtype": args.dtype})
    print(f"iod / resident: median {result['ratio_median']:.3f} "
          f"[quartiles {result['ratio_quartiles'][0]:.3f}-{result['ratio_quartiles'][1]:.3f}, "
          f"{len(result['ratios'])} pairs of {args.block} tokens]; resident "
          f"{result['tok_s']['resident']:.2f}, iod {result['tok_s']['iod']:.2f} tok/s; "
          f"stall {result['stall_ms_per_token']:.1f} ms a token; ids equal: {result['ids_equal']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["ids_equal"] else 1

def run(args, tok, models, store):
    prompt = encode_prompt(tok, resolve_prompt(args.prompt), True)
    follow = bench.forced_ids(tok, args.tokens)
    caches, ids = {}, {}
    for name, model in models.items():  # prefill, untimed
        caches[name] = make_prompt_cache(model)
        logits = model(mx.array(prompt)[None], cache=caches[name])
        ids[name] = [int(mx.argmax(logits[0, -1]).item())]
    store.reset_stats()
    secs = {name: [] for name in models}
    names = list(models)
    for b in range(args.tokens // args.block):
        for name in (names if b % 2 == 0 else names[::-1]):  # the order reversed every block
            model, cache = models[name], caches[name]
            t0 = time.perf_counter()
            for t in range(b * args.block, (b + 1) * args.block):
                logits = model(mx.array([[follow[t]]]), cache=cache)
                ids[name].append(int(mx.argmax(logits[0, -1]).item()))
            secs[name].append(time.perf_counter() - t0)
    ratios = [r / s for r, s in zip(secs["resident"], secs["iod"])]  # iod's speed over resident's
    q = statistics.quantiles(ratios, n=4, method="inclusive")
    n_iod = len(secs["iod"]) * args.block
    return {
        "ratios": ratios,
        "ratio_median": statistics.median(ratios),
        "ratio_quartiles": [q[0], q[2]],
        "tok_s": {name: len(s) * args.block / sum(s) for name, s in secs.items()},
        "stall_ms_per_token": store.stats["stall_s"] / n_iod * 1e3,
        "copy_ms_per_token": store.stats["copy_s"] / n_iod * 1e3,
        # layer calls of the iod side that ran whole (every expert cached: the resident call, no sync)
        "whole_calls": store.stats["whole_calls"],
        "ids_equal": ids["resident"] == ids["iod"],
        "gate": store.prefetcher.gate.stats(),
    }

if __name__ == "__main__":
    sys.exit(main())
