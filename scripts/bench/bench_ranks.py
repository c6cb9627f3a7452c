"""Two pipeline ranks with a memory budget B each against one process with
budget B, in the IO-bound regime (a daemon whose reads are capped by
--read-rate). Runs `infer run --json` alternately as one process and as
`--ranks 2`, and prints decode tok/s and expert bytes read per token (median,
min-max), their ratios, and the activations sent between ranks per token.

    python scripts/bench/bench_ranks.py --model PREP --read-rate 0.3 --cache-fraction 0.35

Each run gets a fresh daemon (cold, with a small --arena so that its staging
arena does not cache the model): the two ranks share it and its read rate (one
disk for both, the pessimistic case), or with --daemon-per-rank each rank has
its own daemon and read rate (two hosts with a disk each).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run(model, prompt, max_tokens, budget, ranks, env, iod):
    cmd = [sys.executable, "-m", "infer.cli", "run", "--model", str(model), "--prompt", prompt,
           "--max-tokens", str(max_tokens), "--json", "--dtype", "float32",
           "--ignore-chat-template", "--mem-budget", str(budget), "--ranks", str(ranks),
           "--iod", iod]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    if r.returncode != 0:
        sys.exit(f"bench_ranks: {' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return json.loads(r.stdout)


def spread(xs):
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="prep folder")
    p.add_argument("--read-rate", type=float, required=True, help="MB/s cap on the daemon's reads")
    p.add_argument("--cache-fraction", type=float, default=0.3,
                   help="budget B = the session's minimum + this share of all experts")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt", default="The",
                   help="a short prompt keeps the prompt's reads out of the per-token figures")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--arena", default="2M",
                   help="the daemon's staging arena (small: it caches records too)")
    p.add_argument("--daemon-per-rank", action="store_true",
                   help="each rank its own daemon and read rate (two hosts, a disk each)")
    p.add_argument("--out", default=None, help="write the runs' figures here (JSON)")
    args = p.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from infer.runtime.budget import plan_memory
    from shared.blob import Manifest

    manifest = Manifest.load(args.model)
    minimum = plan_memory(1 << 50, args.model, manifest, private_daemon=False).minimum
    budget = minimum + int(args.cache_fraction * manifest.expert_bytes)
    prompt = args.prompt

    run_dir = Path(tempfile.mkdtemp(prefix="iodbr-", dir="/tmp"))
    os.chmod(run_dir, 0o700)
    env = {**os.environ, "IOD_RUN_DIR": str(run_dir)}
    iod = [sys.executable, "-m", "iod.cli"]
    runs = {1: [], 2: []}
    try:
        for _ in range(args.repeats):
            for ranks in (1, 2):
                daemons = range(ranks if args.daemon_per_rank else 1)
                for d in daemons:
                    subprocess.run(iod + ["start", "--read-rate", str(args.read_rate), "--arena",
                                          args.arena, "--workers", "4", "--socket",
                                          str(run_dir / f"r{d}" / "iod.sock")],
                                   env=env, check=True, capture_output=True)
                sock = str(run_dir / ("r{rank}" if args.daemon_per_rank else "r0") / "iod.sock")
                try:
                    runs[ranks].append(run(args.model, prompt, args.max_tokens, budget, ranks,
                                           env, sock.replace("{rank}", "0") if ranks == 1 else sock))
                finally:
                    for d in daemons:
                        subprocess.run(iod + ["stop", "--socket", str(run_dir / f"r{d}" / "iod.sock")],
                                       env=env, capture_output=True)
    finally:
        subprocess.run(["rm", "-rf", str(run_dir)])

    def per_token(out, key="bytes_read", s=None):
        s = s or out["stats"]
        return s[key] / out["stats"]["generation_tokens"]

    tps = {k: [o["stats"]["decode_tps"] for o in v] for k, v in runs.items()}
    read = {k: [per_token(o) for o in v] for k, v in runs.items()}
    disk = {k: [per_token(o, "daemon_bytes_read") for o in v] for k, v in runs.items()}
    print(f"model {args.model}; read rate {args.read_rate} MB/s; budget B {budget} bytes "
          f"(minimum + {args.cache_fraction:.0%} of {manifest.expert_bytes} expert bytes); "
          f"{args.max_tokens} tokens; {args.repeats} runs each; median (min-max)")
    for k in (1, 2):
        print(f"  {'one process' if k == 1 else 'two ranks  '}: decode {spread(tps[k])} tok/s, "
              f"expert bytes read per generated token {spread(read[k])} (the daemon's disk "
              f"reads: {spread(disk[k])})")
    ranks_read = [[per_token(o, s=r) for r in o["stats"]["ranks"]] for o in runs[2]]
    print("  per rank (two ranks): " + "; ".join(
        f"rank {i} {spread([rr[i] for rr in ranks_read])} B/token" for i in range(2)))
    ratio_read = statistics.median(read[2]) / statistics.median(read[1])
    ratio_disk = statistics.median(disk[2]) / statistics.median(disk[1])
    ratio_tps = statistics.median(tps[2]) / statistics.median(tps[1])
    act = runs[2][0]["stats"]["activation_bytes_per_token"]
    print(f"  two ranks / one process: expert bytes read {ratio_read:.2f}x, decode tok/s "
          f"{ratio_tps:.2f}x (disk reads {ratio_disk:.2f}x); activations between ranks {act:.0f} B per token = "
          f"{act / statistics.median(read[2]):.2%} of the expert bytes read per token")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "budget": budget,
                                              "runs": {str(k): v for k, v in runs.items()}}))


if __name__ == "__main__":
    main()
