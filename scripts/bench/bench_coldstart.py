"""Cold start: misses of the first tokens with and without a calibrated preload.

    scripts/bench/bench_coldstart.py --model PREP [--tokens 64] [--json OUT]

Calibrates on the first ``--calibration`` tokens of the prep folder's
heldout.txt (``infer.prep.calibrate.count_usage``, usage.json written into a copy
of the folder), then runs ``--stretches`` later stretches of the same text
(a 32-token prompt, then ``--tokens`` teacher-forced steps) from a cold
cache at 10/25/50% of the expert bytes, once empty and once preloaded with
each layer's most used experts. Prints the misses of the prefill and of the
first 8 / 32 / all decode steps (summed over stretches), and the experts
the preload read.
"""

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

FRACTIONS = (0.10, 0.25, 0.50)
PROMPT = 32
MARKS = (8, 32)


def run(prep, ids, fraction, tokens, preload):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from infer.runtime import coldstart
    from infer.runtime.loader import load_streaming
    from infer.runtime.source import make_source

    source = make_source(prep, "inproc")
    try:
        cache_bytes = int(source.manifest.expert_bytes * fraction)
        model, _, store = load_streaming(prep, source, cache_bytes, dtype=mx.float32, preload=False)
        store.prefetcher.depth = 0
        loaded = coldstart.preload(store, prep) if preload else 0
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([ids[:PROMPT]]), cache=cache))
        out = {"preloaded": loaded, "prefill": store.stats["misses"]}
        for i, t in enumerate(ids[PROMPT:PROMPT + tokens], 1):
            mx.eval(model(mx.array([[t]]), cache=cache))
            if i in MARKS:
                out[f"first {i}"] = store.stats["misses"] - out["prefill"]
        out[f"first {tokens}"] = store.stats["misses"] - out["prefill"]
        return out
    finally:
        source.close()


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="prep folder (with heldout.txt)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--calibration", type=int, default=512)
    p.add_argument("--stretches", type=int, default=4)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)

    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from infer.prep.calibrate import count_usage

    with tempfile.TemporaryDirectory() as tmp:
        prep = Path(tmp) / "prep"
        shutil.copytree(args.model, prep)
        text = (prep / "heldout.txt").read_text()
        count_usage(prep, text, args.calibration)
        ids = load_tokenizer(prep).encode(text, add_special_tokens=False)
        span = PROMPT + args.tokens
        room = len(ids) - args.calibration - span
        starts = [args.calibration + i * room // max(args.stretches - 1, 1) for i in range(args.stretches)]
        rows = {}
        for frac in FRACTIONS:
            for preload in (False, True):
                total = {}
                for s in starts:
                    for k, v in run(prep, ids[s:s + span], frac, args.tokens, preload).items():
                        total[k] = total.get(k, 0) + v
                rows[f"{frac * 100:g}% {'preloaded' if preload else 'empty'}"] = total
    cols = ["preloaded", "prefill"] + [f"first {m}" for m in MARKS] + [f"first {args.tokens}"]
    print("| cache | " + " | ".join(cols) + " |")
    print("|" + "---|" * (1 + len(cols)))
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(str(row[c]) for c in cols) + " |")
    print(f"\n{args.stretches} stretches of heldout.txt after the {args.calibration} calibration "
          f"tokens: {PROMPT}-token prompt, {args.tokens} teacher-forced steps")
    if args.json:
        args.json.write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
