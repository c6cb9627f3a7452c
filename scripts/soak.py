#!/usr/bin/env python
"""Soak: the long versions of the reliability checks (issue 8, docs/reliability.md).

    python scripts/soak.py                      # everything, full sizes (~15-20 min)
    python scripts/soak.py --only hostile,load  # some checks
    python scripts/soak.py --quick              # the CI sizes

Prints one JSON line per check ({"check": ..., "ok": ..., "elapsed_s": ...,
figures}) and exits 1 if any check failed. The checks are the tests of
tests/test_reliability.py, which the CI runs at small sizes; this runs each
of them through pytest with the sizes below (RELIABILITY_SIZES).
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# check -> the test that runs it
CHECKS = {"session_crash": "test_session_crash", "daemon_crash": "test_daemon_crash",
          "corruption": "test_corruption", "disk_errors": "test_disk_errors",
          "hostile": "test_hostile_input", "other_users": "test_other_users", "load": "test_load"}


def run_check(name, sizes) -> dict:
    """One check's test at ``sizes``: its figures and whether it passed."""
    env = {**os.environ, "RELIABILITY_SIZES": json.dumps(sizes)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                           f"tests/test_reliability.py::{CHECKS[name]}"],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    line = {"check": name}
    for text in proc.stdout.splitlines():
        if text.startswith('{"check"'):
            figures = json.loads(text)
            figures.pop("check", None)
            line.update(figures)
    line["ok"] = proc.returncode == 0
    if not line["ok"]:
        failure = [t for t in proc.stdout.splitlines() if t.startswith("E ")]
        line["error"] = "\n".join(failure[:20])[:2000] or proc.stdout[-2000:]
    return line


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(CHECKS), help="comma-separated: " + ",".join(CHECKS))
    ap.add_argument("--quick", action="store_true", help="the CI sizes")
    ap.add_argument("--rounds", type=int, default=100, help="session-crash rounds")
    ap.add_argument("--kill-points", default="-1,0,3,8,20,50",
                    help="daemon crash: kill after these tokens (-1: at once)")
    ap.add_argument("--messages", type=int, default=100_000, help="generated hostile messages")
    ap.add_argument("--load-seconds", type=float, default=60.0)
    ap.add_argument("--base-seconds", type=float, default=30.0, help="single-session baseline")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--rate", type=float, default=20.0, help="requests/s per load session")
    ap.add_argument("--no-ratio", action="store_true", help="report the load p99 ratio, don't assert it")
    ap.add_argument("--disk-rounds", type=int, default=8, help="eio + short faults each")
    ap.add_argument("--probes", type=int, default=20,
                    help="other users: connect-and-ask attempts per request kind")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    only = [c.strip() for c in args.only.split(",") if c.strip()]
    bad = set(only) - set(CHECKS)
    if bad:
        ap.error(f"unknown checks: {sorted(bad)}")
    sizes = {"rounds": args.rounds, "kill_points": args.kill_points, "messages": args.messages,
             "load_seconds": args.load_seconds, "base_seconds": args.base_seconds,
             "sessions": args.sessions, "rate": args.rate, "assert_ratio": not args.no_ratio,
             "disk_rounds": args.disk_rounds, "probes": args.probes, "seed": args.seed}
    if args.quick:
        sizes = {"seed": args.seed}  # the tests' own sizes
    failed = 0
    for name in only:
        t0 = time.monotonic()
        line = run_check(name, sizes)
        failed += not line["ok"]
        line["elapsed_s"] = round(time.monotonic() - t0, 1)
        print(json.dumps(line), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
