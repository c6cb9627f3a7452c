"""Cache replacement policies against Belady on recorded routing traces.

    scripts/bench_policies.py --model PREP [--tokens 256] [--trace T.json] [--json OUT]

Records the routing trace of a teacher-forced decode (prompt + fixed text,
and a greedy free run), then simulates each policy with per-layer stacks at
10/25/50% of all expert bytes (the session cache's own structure: the same
capacity per layer) and prints misses, and misses relative to Belady.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from infer.belady import (POLICIES, belady_global, belady_misses, simulate,  # noqa: E402
                          simulate_global)

FRACTIONS = (0.10, 0.25, 0.50)
PROMPTS = [
    "The lighthouse keeper counted the ships that passed in the night",
    "Write a short story about a market town in autumn",
]


def record(model_dir, tokens):
    from infer.bench import decode, forced_ids
    from infer.loader import load_streaming
    from infer.run import encode_prompt
    from iod.inproc import InprocSource
    from shared.blob import Manifest

    manifest = Manifest.load(model_dir)
    source = InprocSource(model_dir)
    model, tok, store = load_streaming(model_dir, source, manifest.expert_bytes)
    store.depth = 0
    traces = {}
    for i, prompt in enumerate(PROMPTS):
        for free in (False, True):
            store.trace = []
            follow = None if free else forced_ids(tok, tokens)
            if follow is not None:
                follow = follow[i * 37:] + follow[: i * 37]  # another stretch of the text
            decode(model, encode_prompt(tok, prompt), follow, tokens, store)
            traces[f"p{i}-{'free' if free else 'forced'}"] = [
                (l, list(map(int, e))) for l, e in store.trace]
    source.close()
    return traces


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--trace", type=Path, help="reuse (or save) the recorded traces here")
    p.add_argument("--json", type=Path)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--global-pool", action="store_true",
                   help="also simulate one pool shared by all layers (Belady of that pool too)")
    args = p.parse_args(argv)

    from shared.blob import Manifest

    manifest = Manifest.load(args.model)
    if args.trace and args.trace.exists():
        traces = json.loads(args.trace.read_text())
    else:
        traces = record(args.model, args.tokens)
        if args.trace:
            args.trace.write_text(json.dumps(traces))
    layers = len(manifest.layers)
    record_bytes = max(l.record_bytes for l in manifest.layers)
    policies = args.policies.split(",")
    rows = {}
    for frac in FRACTIONS:
        cap = int(manifest.expert_bytes * frac) // layers // record_bytes
        row = {"capacity_per_layer": cap, "belady": 0, **{k: 0 for k in policies}}
        for trace in traces.values():
            row["belady"] += belady_misses(trace, cap)
            for k in policies:
                row[k] += simulate(trace, cap, k)
        rows[f"{int(frac * 100)}%"] = row
        if args.global_pool:
            g = {"capacity_per_layer": cap, "belady": 0, **{k: 0 for k in policies}}
            for trace in traces.values():
                g["belady"] += belady_global(trace, cap * layers)
                for k in policies:
                    g[k] += simulate_global(trace, cap * layers, k, layers)
            rows[f"{int(frac * 100)}% global"] = g
    head = "| cache | experts/layer | Belady | " + " | ".join(policies) + " |"
    print(head)
    print("|" + "---|" * (3 + len(policies)))
    for name, row in rows.items():
        cells = [f"{row[k]} ({row[k] / row['belady']:.2f}×)" for k in policies]
        print(f"| {name} | {row['capacity_per_layer']} | {row['belady']} | " + " | ".join(cells) + " |")
    calls = sum(len(t) for t in traces.values())
    print(f"\n{len(traces)} traces, {calls} calls, {args.tokens} tokens each")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "traces": list(traces), "calls": calls}))


if __name__ == "__main__":
    main()
