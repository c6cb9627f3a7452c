#!/usr/bin/env python3
"""Row-wise verify with attention in one call (where the probe allows it)
against attention row by row, and both against plain decoding, interleaved
in one process.

usage: scripts/bench/rowwise_ab.py PREP PROMPT KS REPS TOKENS OUT.json [DTYPE]

The resident model (DTYPE, default float32; the folder's own with "model")
generates TOKENS greedy tokens REPS + 1 times per configuration: plain
(mlx-lm's generate_step), and for each K in KS (comma-separated) n-gram
drafting with the row-wise verify, attention batched where
``infer.spec.rowwise.batch_is_rows`` says a batch's rows are the bits of lone
rows ("probed") and attention row by row ("rows"); the order reversed every
round, the first round untimed. Speeds are decode tokens a second (the
prefill's token excluded); ratios are per round, over plain of the same
round: the median and the range. Ids must equal plain's. The probe's
answer for each number of rows is printed and kept.
"""
import json
import statistics
import sys

import mlx.core as mx
from infer.tools import bench_draft as bd
from infer.spec import rowwise
from infer.tools.resident import load_resident
from infer.runtime.loader import cast_model
from infer.run import encode_prompt
from infer.spec.decoder import speculative_generate


def main(argv):
    if len(argv) not in (6, 7):
        print(__doc__.strip().splitlines()[4], file=sys.stderr)
        return 2
    prep, prompt, ks, reps, n, out = argv[0], argv[1], argv[2], int(argv[3]), int(argv[4]), argv[5]
    dtype = argv[6] if len(argv) == 7 else "float32"
    ks = [int(k) for k in ks.split(",")]
    model, tok = load_resident(prep)
    if dtype != "model":
        cast_model(model, getattr(mx, dtype))
    ids = encode_prompt(tok, bd.resolve_prompt(prompt), True)
    probe = rowwise.batch_is_rows

    def plain():
        got, f = bd._plain(model, ids, n, None)
        return got, f["decode_tok_s"], None

    def ngram(k, attention):
        rowwise.batch_is_rows = probe if attention == "probed" else (lambda *a: False)
        got = []
        try:
            for t, stats in speculative_generate(model, ids, draft="ngram", num_draft=k,
                                                 max_tokens=n, verify="rowwise"):
                got.append(int(t))
        finally:
            rowwise.batch_is_rows = probe
        s = stats.summary()
        return got, s["decode_tok_s"], s["accept_len"]

    confs = {"none": plain}
    for k in ks:
        for attention in ("probed", "rows"):
            confs[f"K{k}-{attention}"] = lambda k=k, a=attention: ngram(k, a)
    res = {c: [] for c in confs}
    tok_pass = {}
    ref = None
    for r in range(reps + 1):
        order = list(confs) if r % 2 == 0 else list(confs)[::-1]
        for c in order:
            got, tok_s, per_pass = confs[c]()
            ref = ref or got
            assert got == ref, (c, r)
            if r:  # the first round warms up
                res[c].append(tok_s)
                tok_pass[c] = per_pass
    ratios = {c: [a / b for a, b in zip(res[c], res["none"])] for c in confs if c != "none"}
    batched = {str(key[1]): ok for key, ok in rowwise._BATCH_IS_ROWS.items()}
    summary = {"prompt": prompt, "tokens": n, "reps": reps, "dtype": dtype,
               "device": str(mx.default_device()), "batch_is_rows": batched,
               "tok_s": res, "tokens_per_pass": tok_pass,
               "ratio_median": {c: statistics.median(v) for c, v in ratios.items()},
               "ratio_range": {c: [min(v), max(v)] for c, v in ratios.items()},
               "ratio_runs": ratios}
    with open(out, "w") as f:
        json.dump(summary, f, indent=1)
    print("batch is rows:", batched)
    print("plain tok/s median", f"{statistics.median(res['none']):.1f}")
    for c, v in ratios.items():
        print(f"{c:12s} {statistics.median(v):.3f}x [{min(v):.3f}-{max(v):.3f}]"
              f"  {tok_pass[c]:.2f} tokens a pass")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
