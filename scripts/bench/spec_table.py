#!/usr/bin/env python3
"""Markdown rows of `infer bench --draft` results (docs/speculative.md).

usage: scripts/bench/spec_table.py BENCH.json [...]    (one row per configuration)
       scripts/bench/spec_table.py --check BENCH.json [...]   (the --draft-check figures)
"""

import json
import sys
from pathlib import Path


def rows(path):
    r = json.loads(Path(path).read_text())
    budget = r.get("budget_bytes", 0) / max(r.get("expert_bytes", 1), 1)
    for mode, m in r["modes"].items():
        d = m.get("draft")
        if not d:
            continue
        where = "resident" if mode == "resident" else f"{mode} {budget:.2f}"
        for c in d["configs"]:
            if "error" in c:
                yield f"| {Path(path).stem} | {where} | {c['kind']} | {c['verify']} | {c['k']} | failed: {c['error'][:80]} |"
                continue
            runs = c["speedup_runs"]
            union = c["union"]
            saved = f"{union['saved_fraction']:.2f}" if union["layer_calls"] else "-"
            yield (f"| {Path(path).stem} | {where} | {c['kind']} | {c['verify']} | {c['k']} "
                   f"| {c['accept_len']:.2f} | {c['acceptance_rate']:.2f} "
                   f"| {c['decode_tok_s']:.1f} | {c['baseline_decode_tok_s']:.1f} "
                   f"| **{c['speedup']:.2f}** [{min(runs):.2f}–{max(runs):.2f}] "
                   f"| {c['bytes_read_per_token'] / 1e6:.3f} | {c['baseline_bytes_read_per_token'] / 1e6:.3f} "
                   f"| {saved} | {'yes' if c['exact'] else 'NO'} |")


def checks(path):
    r = json.loads(Path(path).read_text())
    for mode, m in r["modes"].items():
        for k, v in m.get("draft", {}).get("check", {}).items():
            for verify, f in v.items():
                diff = "-" if f["rows_bitwise_different"] is None else f["rows_bitwise_different"]
                ids = "-" if f["greedy_ids_different"] is None else f["greedy_ids_different"]
                md = "-" if f["max_abs_diff"] is None else f"{f['max_abs_diff']:.3g}"
                yield f"| {Path(path).stem} | {verify} | {k} | {f['rows']} | {diff} | {ids} | {md} |"


def main(argv):
    if argv and argv[0] == "--check":
        print("| run | pass | K | rows | rows bitwise different | greedy ids different | max abs diff |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for p in argv[1:]:
            print("\n".join(checks(p)))
        return 0
    print("| run | where | draft | verify | K | tokens/pass | acceptance | tok/s | plain tok/s "
          "| speedup [runs] | MB/token | plain MB/token | union saved | ids = plain |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for p in argv:
        print("\n".join(rows(p)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
