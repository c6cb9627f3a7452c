"""Peak memory of `infer run --mem-budget` (infer + its private iod) against the budget.

    scripts/bench/bench_budget.py --model PREP --budgets 800M,1G,1.5G [--max-tokens 32] [--json OUT]

Each budget runs `infer run` in a fresh run dir (so it starts a private
daemon) while /proc is sampled every 10 ms: the session's anonymous and file
pages (its mapping of the arena left out) plus the daemon's whole resident
set (its arena included), so shared memory is counted once. Linux only.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from infer.tools.bench import proc_status  # noqa: E402
from shared.units import format_size, parse_size  # noqa: E402


def children(pid):
    """The session's daemon children. A child between fork and exec shows the
    parent's pages as its own (copy-on-write, not new memory): skip it."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            pids = [int(x) for x in f.read().split()]
    except OSError:
        return []
    out = []
    for c in pids:
        try:
            with open(f"/proc/{c}/cmdline", "rb") as f:
                if b"iod.cli" in f.read():
                    out.append(c)
        except OSError:
            pass
    return out


def measure(model, budget, max_tokens, prompt):
    env = dict(os.environ, IOD_RUN_DIR=tempfile.mkdtemp(prefix="iodm-", dir="/tmp"))
    cmd = [sys.executable, "-m", "infer.cli", "run", "--model", model, "--mem-budget", budget,
           "--max-tokens", str(max_tokens), "--prompt", prompt, "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    peak_sum = peak_infer = peak_iod = 0
    hwm = {}
    while proc.poll() is None:
        s = proc_status(proc.pid)
        infer_b = s.get("RssAnon", 0) + s.get("RssFile", 0)
        iod_b = 0
        for c in children(proc.pid):
            cs = proc_status(c)
            iod_b += cs.get("VmRSS", 0)
            hwm[c] = max(hwm.get(c, 0), cs.get("VmHWM", 0))
        peak_infer, peak_iod = max(peak_infer, infer_b), max(peak_iod, iod_b)
        peak_sum = max(peak_sum, infer_b + iod_b)
        time.sleep(0.01)
    out, err = proc.communicate()
    if proc.returncode != 0:
        return {"budget": parse_size(budget), "error": err.strip().splitlines()[-1]}
    stats = json.loads(out)["stats"]
    return {"budget": parse_size(budget), "peak_total": peak_sum, "peak_infer": peak_infer,
            "peak_iod": max([peak_iod, *hwm.values()]),
            "ratio": peak_sum / parse_size(budget), "misses": stats["misses"],
            "hits": stats["hits"], "decode_tps": stats["decode_tps"]}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--budgets", default="800M,1G,1.5G")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt", default="The lighthouse keeper counted the ships that passed")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    from infer.runtime.budget import plan_memory
    from shared.blob import Manifest

    manifest = Manifest.load(args.model)
    rows = []
    print("| budget | cache | peak infer | peak iod | peak total | total / budget | hit rate |")
    print("|---|---|---|---|---|---|---|")
    for b in args.budgets.split(","):
        r = measure(args.model, b, args.max_tokens, args.prompt)
        try:
            r["cache_bytes"] = plan_memory(parse_size(b), args.model, manifest).cache_bytes
        except ValueError:
            r["cache_bytes"] = None
        rows.append(r)
        if "error" in r:
            print(f"| {b} | refused: {r['error']} |||||")
            continue
        hit = r["hits"] / max(r["hits"] + r["misses"], 1)
        print(f"| {b} | {format_size(r['cache_bytes'])} | {format_size(r['peak_infer'])} | "
              f"{format_size(r['peak_iod'])} | {format_size(r['peak_total'])} | "
              f"{r['ratio']:.3f} | {hit:.2f} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
