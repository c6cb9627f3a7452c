"""Cache replacement policies against Belady on recorded routing traces.

    scripts/bench/bench_policies.py --model PREP [--tokens 256] [--trace T.json] [--json OUT]

Records the routing trace of a teacher-forced decode (prompt + fixed text,
and a greedy free run), then simulates each policy with per-layer stacks at
10/25/50% of all expert bytes (the session cache's own structure: the same
capacity per layer) and prints misses, and misses relative to Belady.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from infer.tools.belady import (POLICIES, belady_global, belady_misses, simulate,  # noqa: E402
                          simulate_global)

FRACTIONS = (0.05, 0.10, 0.25, 0.50)
PROMPT_TOKENS = 32


def heldout_ids(model_dir, tokenizer):
    """The text the model never trained on (``heldout.txt`` beside the
    source checkpoint, copied into the prep folder or found by its name)."""
    text = (Path(model_dir) / "heldout.txt")
    return tokenizer.encode(text.read_text(), add_special_tokens=False)


def record(model_dir, tokens, text=None, stretches=2):
    """{name: trace} of ``stretches`` teacher-forced runs over different
    stretches of ``text`` (default heldout.txt) and as many greedy free runs
    from prompts taken there. Each call's entry is (layer, experts,
    [[layer, depth, predicted experts], ...]): the next layers' guesses made
    at that call (their routers on its input, depth 2)."""
    import mlx.core as mx
    import numpy as np

    from infer.tools.bench import decode
    from infer.runtime.gate import PredictionGate
    from infer.runtime.loader import load_streaming
    from infer.runtime.source import make_source
    from shared.blob import Manifest

    manifest = Manifest.load(model_dir)
    source = make_source(model_dir, "inproc")
    model, tok, store = load_streaming(model_dir, source, manifest.expert_bytes, dtype=mx.float32,
                                         preload=False)
    ids = tok.encode(Path(text).read_text(), add_special_tokens=False) if text \
        else heldout_ids(model_dir, tok)
    store.prefetcher.depth = 2
    store.prefetcher.gate = PredictionGate("on")  # every call's guesses, whatever they cost
    guesses = []
    prefetch, begin_call = store.prefetcher.prefetch, store.prefetcher.begin_call
    call = [0]

    def begin(layer, rows):  # the trace entry this call's gather will add
        call[0] = len(store.trace)
        return begin_call(layer, rows)

    def record_guesses(gs, misses=None):  # hinted before or after the call's gather
        guesses.append((call[0], [[int(l), d, np.unique(np.array(g)[..., :breadth]).tolist()]
                                  for l, d, g, _, breadth in gs]))
        prefetch(gs, misses)

    store.prefetcher.begin_call, store.prefetcher.prefetch = begin, record_guesses
    traces = {}
    span = PROMPT_TOKENS + tokens
    for i in range(stretches):
        start = (i * len(ids) // stretches) % max(len(ids) - span, 1)
        prompt, follow = ids[start:start + PROMPT_TOKENS], ids[start + PROMPT_TOKENS:start + span]
        for free in (False, True):
            store.trace, guesses[:] = [], []
            store.stacks = {}
            decode(model, prompt, None if free else follow, tokens, store)
            pred = dict(guesses)
            traces[f"s{i}-{'free' if free else 'forced'}"] = [
                (l, list(map(int, e)), pred.get(n, [])) for n, (l, e) in enumerate(store.routing_trace())]
    source.close()
    return traces


def table(traces, manifest, policies, global_policies=()):
    """{budget: row}: misses summed over ``traces`` at each fraction of all
    expert bytes, per-layer stacks (Belady per layer) and, for
    ``global_policies``, one pool of the same bytes (against global Belady)."""
    layers = len(manifest.layers)
    record_bytes = max(l.record_bytes for l in manifest.layers)
    rows = {}
    for frac in FRACTIONS:
        cap = int(manifest.expert_bytes * frac) // layers // record_bytes
        row = {"capacity_per_layer": cap, "belady": 0, "belady_global": 0,
               **{k: 0 for k in policies}, **{f"global {k}": 0 for k in global_policies}}
        for trace in traces.values():
            row["belady"] += belady_misses(trace, cap)
            for k in policies:
                row[k] += simulate(trace, cap, k)
            if global_policies:
                row["belady_global"] += belady_global(trace, cap * layers)
                for k in global_policies:
                    row[f"global {k}"] += simulate_global(trace, cap * layers, k, layers)
        rows[f"{frac * 100:g}%"] = row
    return rows


def markdown(rows, policies, global_policies=()):
    cols = list(policies) + [f"global {k}" for k in global_policies]
    head = "| cache | experts/layer | Belady | " + " | ".join(cols) + " |"
    lines = [head, "|" + "---|" * (3 + len(cols))]
    for name, row in rows.items():
        cells = [f"{row[k]} ({row[k] / max(row['belady'], 1):.2f}×)" for k in cols]
        lines.append(f"| {name} | {row['capacity_per_layer']} | {row['belady']} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="prep folder")
    p.add_argument("--text", default=None, help="text to follow and prompt from "
                   "(default: heldout.txt in the prep folder)")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--stretches", type=int, default=2)
    p.add_argument("--trace", type=Path, help="reuse (or save) the recorded traces here")
    p.add_argument("--json", type=Path)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--global-policies", default="",
                   help="also simulate one pool shared by all layers with these policies "
                        "(e.g. lru,least-stale,predict); global Belady printed beside")
    args = p.parse_args(argv)

    from shared.blob import Manifest

    manifest = Manifest.load(args.model)
    if args.trace and args.trace.exists():
        traces = json.loads(args.trace.read_text())
    else:
        traces = record(args.model, args.tokens, args.text, args.stretches)
        if args.trace:
            args.trace.write_text(json.dumps(traces))
    policies = args.policies.split(",")
    gpol = [k for k in args.global_policies.split(",") if k]
    rows = table(traces, manifest, policies, gpol)
    print(markdown(rows, policies, gpol))
    if gpol:
        print("global Belady: " + ", ".join(f"{k} {r['belady_global']}" for k, r in rows.items()))
    calls = sum(len(t) for t in traces.values())
    print(f"\n{len(traces)} traces, {calls} calls, {args.tokens} tokens each")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "traces": list(traces), "calls": calls}))


if __name__ == "__main__":
    main()
