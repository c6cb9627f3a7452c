#!/usr/bin/env python3
"""`--draft auto` against plain decoding, interleaved in one process.

usage: scripts/spec_ab.py PREP PROMPT REPS TOKENS OUT.json

The resident model (float32) generates TOKENS greedy tokens REPS + 1 times
per configuration: plain (mlx-lm's generate_step), auto with the lockstep
verify, auto with the row-wise verify (K = 3), the order reversed every
round, the first round untimed. Ratios are per round (auto over plain of
the same round); ids must be equal to the first plain run's.
"""
import json
import statistics
import sys
import types

import mlx.core as mx
from infer import bench_draft as bd
from infer.bench import load_resident
from infer.loader import cast_model
from infer.run import encode_prompt
from shared.blob import Manifest



def main(argv):
    if len(argv) != 5:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    prep, prompt, reps, n, out = argv[0], argv[1], int(argv[2]), int(argv[3]), argv[4]
    model, tok = load_resident(prep)
    cast_model(model, mx.float32)
    args = types.SimpleNamespace(draft="auto", model=prep, dtype="float32")
    head = bd.load_head(args, model, None, Manifest.load(prep))
    ids = encode_prompt(tok, bd.resolve_prompt(prompt), True)
    confs = ["none", "exact", "rowwise"]
    res = {c: [] for c in confs}
    ref = None
    for r in range(reps + 1):
        order = confs if r % 2 == 0 else confs[::-1]
        for c in order:
            if c == "none":
                got, f = bd._plain(model, ids, n, None)
            else:
                got, f = bd._drafted(model, ids, n, None, head, "auto", 3, c)
            ref = ref or got
            assert got == ref, (c, r)
            if r:  # the first round warms up
                res[c].append(f["decode_tok_s"])
    ratios = {c: [a / b for a, b in zip(res[c], res["none"])] for c in confs[1:]}
    summary = {"prompt": prompt, "tokens": n, "reps": reps, "tok_s": res,
               "ratio_median": {c: statistics.median(v) for c, v in ratios.items()},
               "ratio_runs": ratios}
    json.dump(summary, open(out, "w"), indent=1)
    print(prompt, {c: round(statistics.median(v), 3) for c, v in ratios.items()},
          {c: [round(x, 2) for x in v] for c, v in ratios.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
