"""Markdown table of an `infer bench --json` report (for docs/benchmarks.md).

    scripts/bench/bench_table.py REPORT.json
"""

import json
import statistics
import sys


def mb(x):
    return f"{x / 2**20:.0f}"


def main(path):
    r = json.load(open(path))
    print("| mode | decode tok/s (median) | runs | spread | prefill tok/s | stall | hit rate | misses "
          "| Belady | misses/Belady | MB/token | disk MB | recall d1 | precision d1 "
          "| peak RSS infer MiB | peak RSS iod MiB |")
    print("|" + "---|" * 16)
    for name, m in r["modes"].items():
        if "decode_tok_s" not in m:
            print(f"| {name} | {m.get('skipped') or 'failed'} |" + " |" * 14)
            continue
        runs = m["decode_tok_s_runs"]
        spread = (max(runs) - min(runs)) / statistics.median(runs)
        bel = m["belady_misses"]
        ratio = f"{m['misses'] / bel:.2f}" if bel else "-"
        rec = "-" if m["recall"] is None else f"{m['recall']:.2f}"
        pre = "-" if m["precision"] is None else f"{m['precision']:.2f}"
        disk = mb(m["disk_bytes_read"]) if "disk_bytes_read" in m else "-"
        print(f"| {name} | {m['decode_tok_s']:.2f} | {' / '.join(f'{x:.2f}' for x in runs)} "
              f"| ±{spread / 2:.0%} | {m['prefill_tok_s']:.1f} | {m['stall_fraction']:.2f} "
              f"| {m['hit_rate']:.3f} | {m['misses']} | {bel if bel is not None else '-'} | {ratio} "
              f"| {m['bytes_read_per_token'] / 1e6:.1f} | {disk} | {rec} | {pre} "
              f"| {mb(m['peak_rss_infer'])} | {mb(m['peak_rss_iod']) if m['peak_rss_iod'] else '-'} |")
    print(f"\ntokens equal across modes: {r.get('tokens_equal')}; budget {r['budget_bytes'] / 2**20:.0f} MiB "
          f"of {r['expert_bytes'] / 2**20:.0f} MiB experts; read rate "
          f"{r['read_rate'] / 1e6:g} MB/s; {r['max_tokens']} tokens, {r['runs']} runs")
    if "sessions" in r:
        s = r["sessions"]
        print(f"\nsessions: {json.dumps(s)}")


if __name__ == "__main__":
    main(sys.argv[1])
