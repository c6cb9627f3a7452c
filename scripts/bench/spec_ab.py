#!/usr/bin/env python3
"""`--draft auto` against plain decoding, interleaved in one process.

usage: scripts/bench/spec_ab.py PREP PROMPT REPS TOKENS OUT.json

The resident model (float32) generates TOKENS greedy tokens REPS + 1 times
per configuration: plain (mlx-lm's generate_step), auto with the lockstep
verify, auto with the row-wise verify (K = 3, the MTP head where the model
has one), the order reversed every round, the first round untimed. Speeds
are wall clock from the first token to the last (what a user waits for,
auto's own bookkeeping included); ratios are per round (auto over plain of
the same round), reported as the median and the quartiles. Ids must be
equal to the first plain run's.
"""
import json
import statistics
import sys
import time
import types

import mlx.core as mx
from infer.tools import bench_draft as bd
from infer.tools.resident import load_resident
from infer.runtime.loader import cast_model
from infer.spec.mtp import MTPDrafter
from infer.run import encode_prompt
from infer.spec.decoder import speculative_generate
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

    def plain():
        got, f = bd._plain(model, ids, n, None)
        return got, f["decode_tok_s"]

    def auto(verify):
        got, t0 = [], None
        mtp = MTPDrafter(head, model) if head is not None else None
        for t, _ in speculative_generate(model, ids, draft="auto", num_draft=3, max_tokens=n,
                                         mtp=mtp, verify=verify, store=None):
            if t0 is None:
                t0 = time.perf_counter()
            got.append(int(t))
        return got, (n - 1) / (time.perf_counter() - t0)

    confs = {"none": plain, "exact": lambda: auto("exact"), "rowwise": lambda: auto("rowwise")}
    res = {c: [] for c in confs}
    ref = None
    for r in range(reps + 1):
        order = list(confs) if r % 2 == 0 else list(confs)[::-1]
        for c in order:
            got, tok_s = confs[c]()
            ref = ref or got
            assert got == ref, (c, r)
            if r:  # the first round warms up
                res[c].append(tok_s)
    ratios = {c: [a / b for a, b in zip(res[c], res["none"])] for c in ("exact", "rowwise")}
    quartiles = {c: statistics.quantiles(v, n=4) for c, v in ratios.items()}
    summary = {"prompt": prompt, "tokens": n, "reps": reps, "tok_s": res,
               "ratio_median": {c: statistics.median(v) for c, v in ratios.items()},
               "ratio_quartiles": {c: [q[0], q[2]] for c, q in quartiles.items()},
               "ratio_runs": ratios}
    json.dump(summary, open(out, "w"), indent=1)
    print(prompt, {c: f"{statistics.median(v):.3f} [{quartiles[c][0]:.3f}-{quartiles[c][2]:.3f}]"
                   for c, v in ratios.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
