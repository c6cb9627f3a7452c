#!/usr/bin/env python
"""Soak: the long versions of the reliability checks (issue 8, docs/reliability.md).

    python scripts/soak.py                      # everything, full sizes (~15-20 min)
    python scripts/soak.py --only hostile,load  # some checks
    python scripts/soak.py --quick              # the CI sizes

Prints one JSON line per check ({"check": ..., "ok": ..., "elapsed_s": ...,
figures}) and exits 1 if any check failed. The checks themselves live in
tests/test_reliability.py, where the CI runs them at small sizes.
"""

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHECKS = ("session_crash", "daemon_crash", "corruption", "disk_errors", "hostile",
          "other_users", "load")


def build_models(work: Path):
    """The tiny qwen3_moe synthetic model, its prep folder, and a fake prep folder."""
    from infer.prep.prep import prep
    from infer.synth.synth import main as synth_main
    from tests.iod_fixtures import make_prep

    src, dst, fake = work / "src", work / "prep", work / "fake"
    with contextlib.redirect_stdout(sys.stderr):  # stdout is for the JSON lines
        rc = synth_main(["--arch", "qwen3_moe", "--preset", "tiny", "--quant", "affine4",
                         "--dtype", "float32", "--out", str(src)])
    if rc != 0:
        raise SystemExit(f"infer synth failed ({rc})")
    prep(src, dst, progress=False)
    make_prep(fake, num_experts=32)
    return src, dst, fake


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
    ap.add_argument("--workdir", help="keep models here (default: a temporary folder)")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.kill_points, args.messages = 20, "8", 5000
        args.load_seconds, args.base_seconds, args.disk_rounds = 10.0, 6.0, 2
        args.no_ratio, args.probes = True, 5
    only = [c.strip() for c in args.only.split(",") if c.strip()]
    bad = set(only) - set(CHECKS)
    if bad:
        ap.error(f"unknown checks: {sorted(bad)}")

    import tests.test_reliability as R

    R.QUIET = True
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="soak-"))
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "prep" / "manifest.json").exists():
        for p in ("src", "prep", "fake"):
            shutil.rmtree(work / p, ignore_errors=True)
        src, prep, fake = build_models(work)
    else:
        src, prep, fake = work / "src", work / "prep", work / "fake"
    kill_points = tuple(int(k) for k in args.kill_points.split(","))

    runs = {
        "session_crash": lambda: R.check_session_crash(src, prep, rounds=args.rounds,
                                                       seed=args.seed),
        "daemon_crash": lambda: R.check_daemon_crash(src, prep, kill_points=kill_points),
        "corruption": lambda: R.check_corruption(src, prep, tempfile.mkdtemp(dir=work)),
        "disk_errors": lambda: {**R.check_disk_errors(work, rounds=args.disk_rounds),
                                "session": R.check_disk_error_session(src, prep)},
        "hostile": lambda: R.check_hostile(fake, messages=args.messages, seed=args.seed),
        "other_users": lambda: R.check_other_users(fake, probes=args.probes),
        "load": lambda: R.check_load(fake, seconds=args.load_seconds,
                                     base_seconds=args.base_seconds, sessions=args.sessions,
                                     rate=args.rate, seed=args.seed,
                                     assert_ratio=not args.no_ratio),
    }
    failed = 0
    for name in only:
        t0 = time.monotonic()
        line = {"check": name}
        try:
            if name == "other_users" and os.getuid() != 0:
                raise RuntimeError("needs root (useradd, setuid)")
            figures = runs[name]()
            figures.pop("check", None)
            line.update(ok=True, **figures)
        except Exception as e:  # noqa: BLE001  (a failed check is a line, not the end)
            failed += 1
            last = dict(R.LAST.get(name, {}))
            last.pop("check", None)
            frames = [f"{Path(f.filename).name}:{f.lineno} {f.name}"
                      for f in traceback.extract_tb(e.__traceback__)
                      if Path(f.filename).parent.name in ("tests", "scripts")]
            line.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000], **last,
                        where=frames[-5:])
        line["elapsed_s"] = round(time.monotonic() - t0, 1)
        print(json.dumps(line), flush=True)
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
