"""Two tiers: what the session cache and the daemon's arena hold, and who serves a miss.

    scripts/bench/bench_tiers.py --model PREP [--tokens 128] [--arena SIZE] [--json OUT]

Runs a prompt from heldout.txt and ``--tokens`` teacher-forced steps with
prediction on (depth 2) through the daemon's core in this process, its arena
sized as ``infer run --mem-budget`` sizes a private daemon's (a staging area,
``infer.runtime.budget.staging_arena_bytes``) unless ``--arena``, at 10/25/50% of
the expert bytes. After every step it counts the records ready in the arena
that the session's stacks also hold (the same expert twice) and those only
the arena holds; at the end, how the session's misses were served: from the
arena (no read) or read from disk.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

FRACTIONS = (0.10, 0.25, 0.50)
PROMPT = 32


def run(prep, ids, fraction, tokens, arena):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from infer.runtime.loader import load_streaming
    from infer.runtime.source import make_source

    source = make_source(prep, "inproc", arena=arena)
    try:
        cache_bytes = int(source.manifest.expert_bytes * fraction)
        model, _, store = load_streaming(prep, source, cache_bytes, dtype=mx.float32, preload=False)
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([ids[:PROMPT]]), cache=cache))
        both = only = 0
        for t in ids[PROMPT:PROMPT + tokens]:
            mx.eval(model(mx.array([[t]]), cache=cache))
            for layer, stack in store.stacks.items():
                ready = set(source.ready(layer))
                both += len(ready & set(stack.position))
                only += len(ready - set(stack.position))
        c = source.counters
        return {"cache_records": sum(s.capacity for s in store.stacks.values()),
                "arena_slots": source.layout.slot_count,
                "both_per_step": both / tokens, "arena_only_per_step": only / tokens,
                "misses": store.stats["misses"], "arena_hits": c["arena_hits"],
                "read_from_disk": source.bytes_read // max(l.record_bytes for l in source.manifest.layers)}
    finally:
        source.close()


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="prep folder (with heldout.txt)")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--arena", default=None, help="arena size (default: the staging size)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)

    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from infer.runtime.budget import staging_arena_bytes, top_k
    from shared.blob import Manifest
    from shared.units import parse_size

    prep = Path(args.model)
    manifest = Manifest.load(prep)
    arena = parse_size(args.arena) if args.arena else staging_arena_bytes(manifest, 2, top_k(prep))
    ids = load_tokenizer(prep).encode((prep / "heldout.txt").read_text(), add_special_tokens=False)
    ids = ids[len(ids) // 3:]
    rows = {f"{f * 100:g}%": run(prep, ids, f, args.tokens, arena) for f in FRACTIONS}
    cols = list(next(iter(rows.values())))
    print(f"arena {arena} bytes; {args.tokens} steps")
    print("| cache | " + " | ".join(cols) + " |")
    print("|" + "---|" * (1 + len(cols)))
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(f"{v:.1f}" if isinstance(v, float) else str(v)
                                          for v in row.values()) + " |")
    if args.json:
        args.json.write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
