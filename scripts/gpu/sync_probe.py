#!/usr/bin/env python3
"""What a streamed token's per-layer syncs cost by themselves
(scripts/gpu/visit.sh syncprobe).

A streamed MoE layer reads its routed ids to the host before it can fetch
and compute its experts: one sync a layer, with the device idle while the
host decides. Here the resident model decodes the same forced text two ways,
block by block in alternation: as it is, and with each MoE layer first
reading its routed ids to the host (``np.array(indices)``) and nothing else
(no reads, no copies, no cache). The difference is the floor of what the
syncs cost a streamed token; the rest of a streamed token's time over
resident's is the streaming's own work.

usage: scripts/gpu/sync_probe.py PREP [--tokens 96] [--block 8] [--dtype D] [--json OUT]
"""
import argparse
import json
import statistics
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models import switch_layers
from mlx_lm.models.cache import make_prompt_cache

from infer.tools import bench
from infer.args import mx_dtype
from infer.tools.bench_draft import resolve_prompt
from infer.runtime.loader import cast_model
from infer.run import encode_prompt


class Syncs:
    """SwitchGLU's call, reading the routed ids to the host first while on."""

    def __init__(self):
        self.on = False
        self.count = 0
        self._call = switch_layers.SwitchGLU.__call__
        probe = self

        def call(module, x, indices):
            if probe.on:
                np.array(indices)
                probe.count += 1
            return probe._call(module, x, indices)

        switch_layers.SwitchGLU.__call__ = call


def main(argv=None):
    p = argparse.ArgumentParser(prog="sync_probe.py", description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--dtype", default=None)
    p.add_argument("--prompt", default="@pycode")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    syncs = Syncs()
    model, tok = bench.load_resident(args.model)
    if args.dtype:
        cast_model(model, mx_dtype(args.dtype))
    prompt = encode_prompt(tok, resolve_prompt(args.prompt), True)
    follow = bench.forced_ids(tok, args.tokens + 8)
    caches = {}
    for arm in ("plain", "synced"):
        caches[arm] = make_prompt_cache(model)
        mx.eval(model(mx.array(prompt)[None], cache=caches[arm]))
    times = {"plain": [], "synced": []}
    ids = {"plain": [], "synced": []}
    pos = 0
    for b in range(args.tokens // args.block):
        order = ("plain", "synced") if b % 2 == 0 else ("synced", "plain")
        for arm in order:
            syncs.on = arm == "synced"
            t0 = time.perf_counter()
            for t in range(pos, pos + args.block):
                logits = model(mx.array([[follow[t]]]), cache=caches[arm])
                ids[arm].append(int(mx.argmax(logits[0, -1]).item()))
            times[arm].append((time.perf_counter() - t0) / args.block)
        pos += args.block
    syncs.on = False
    per_token = syncs.count / (len(times["synced"]) * args.block)
    # the first pair warms both (kernels, caches): left out
    ms = {arm: statistics.median(v[1:]) * 1e3 for arm, v in times.items()}
    ratios = sorted(s / p for p, s in zip(times["plain"][1:], times["synced"][1:]))
    out = {
        "model": args.model, "device": str(mx.default_device()), "tokens": args.tokens,
        "block": args.block, "ms_per_token": ms, "syncs_per_token": per_token,
        "synced_over_plain": statistics.median(ratios),
        "synced_over_plain_quartiles": [ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]],
        "ms_per_sync": (ms["synced"] - ms["plain"]) / per_token if per_token else None,
        "ids_equal": ids["plain"] == ids["synced"],
    }
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
