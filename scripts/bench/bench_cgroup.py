"""`infer run --mem-budget B` inside a memory cgroup of B bytes, and llama.cpp in the same cap.

    scripts/bench/bench_cgroup.py --model PREP [--budgets min,0.25x,0.5x,979M,1x] [--runs 3]
        [--max-tokens 32] [--prompt TEXT] [--dtype float32]
        [--gguf MODEL.gguf --llama-bench BIN [--llama-caps 0.25x,0.5x] [--threads 2]]
        [--json OUT]

Each run is a fresh nested memory cgroup of exactly the budget (cgroup v1 or
v2, ``shared/cgroup.py``) holding the whole process tree: ``infer run`` with a
fresh run dir (so it starts its private daemon, whose arena is charged
there), MLX's buffers, and the page cache it causes. Before each run the
model's files are dropped from the page cache (``posix_fadvise``), so a run
is charged for what it reads instead of finding pages someone else paid for.
Reported per run: exit status, the cgroup's peak usage (page cache
included), failcnt (times the cap was hit: reclaim), OOM kills, decode and
prompt tok/s, the expert cache's hit rate.

Budgets: a size (``979M``: MiB), ``min`` (the plan's minimum), or ``Fx``
(F × the prep folder's size: ``0.5x`` is half the model).

With ``--gguf`` the same caps also run llama.cpp's ``llama-bench`` on the
same weights (converted from the same Hugging Face folder): decode only
(``-p 0 -n N``) at a depth of the prompt's tokens, the same threads, and by
default the settings that let it fit (``-lm mmap --repack 0``: the weights
stay file pages the kernel can drop; with its default repacking they are
copied into anonymous memory, and it is OOM-killed at a quarter of the
model's size). Rounds interleave the two
programs (order alternating), and each figure is the median of the rounds
with its range.

Build the benchmark's model (hidden 1024, 24 layers × 64 experts of 512,
top-8: a 1.4 GB 4-bit prep folder) and its GGUF:

    scripts/bench/bench_cgroup.py --make-model /tmp/i15          # i15/hf, i15/prep
    python scripts/bench/convert_gguf.py LLAMA_CPP /tmp/i15/hf --outtype bf16 --outfile /tmp/i15/bf16.gguf
    llama-quantize --pure /tmp/i15/bf16.gguf /tmp/i15/q4_k.gguf Q4_K
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from shared.units import format_size, parse_size  # noqa: E402
from shared.cgroup import MemoryCgroup, drop_page_cache, usable  # noqa: E402

PROMPT = "The lighthouse keeper counted the ships that passed"
# the benchmark model of issue 15: the small preset's widths, 24 layers of 64 experts
BENCH_SIZES = dict(hidden=1024, layers=24, experts=64, top_k=8, moe_inter=512, inter=2048,
                   heads=16, kv_heads=4, head_dim=64, vocab=4096)


def folder_bytes(folder) -> int:
    return sum(p.stat().st_size for p in Path(folder).iterdir() if p.is_file())


def resolve_budget(text, model, dtype, context):
    """Bytes of a budget token: a size, ``min``, or ``Fx`` (× model size)."""
    if text == "min":
        return minimum_of(model, dtype, context)
    if text.endswith("x"):
        return int(float(text[:-1]) * folder_bytes(model))
    return parse_size(text)


def minimum_of(model, dtype, context):
    """The smallest budget ``infer run`` accepts for this model (private daemon)."""
    from infer.runtime.budget import minimum_budget
    from shared.blob import Manifest

    return minimum_budget(model, Manifest.load(model), dtype=dtype, context=context)


def run_in_cgroup(program, budget, cmd, **popen_kw):
    """``cmd`` in a fresh memory cgroup of ``budget`` bytes: (figures, stdout, stderr)."""
    with MemoryCgroup(budget) as cg:
        t0 = time.monotonic()
        proc = cg.popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen_kw)
        out, err = proc.communicate()
        wall = time.monotonic() - t0
        s = cg.stats()
    r = {"program": program, "budget": budget, "rc": proc.returncode, "wall_s": wall,
         "peak": s["peak"], "failcnt": s["failcnt"], "oom_kill": s["oom_kill"]}
    return r, out, err


def run_ours(model, budget, args):
    """One ``infer run`` in a fresh cgroup of ``budget`` bytes."""
    drop_page_cache([model])
    env = dict(os.environ, IOD_RUN_DIR=tempfile.mkdtemp(prefix="iodcg-", dir="/tmp"))
    cmd = [sys.executable, "-m", "infer.cli", "run", "--model", str(model),
           "--mem-budget", str(budget), "--max-tokens", str(args.max_tokens),
           "--prompt", args.prompt, "--json"]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    r, out, err = run_in_cgroup("infer", budget, cmd, env=env, cwd=ROOT)
    if r["rc"] == 0:
        st = json.loads(out)["stats"]
        r.update(decode_tps=st["decode_tps"], prompt_tps=st["prompt_tps"],
                 hits=st["hits"], misses=st["misses"], tokens=len(json.loads(out)["tokens"]))
    else:
        r["error"] = (err.strip().splitlines() or ["killed"])[-1]
    return r


def run_llama(gguf, budget, args, depth):
    """One ``llama-bench`` decode run in a fresh cgroup of ``budget`` bytes."""
    drop_page_cache([gguf])
    cmd = [args.llama_bench, "-m", str(gguf), "-p", "0", "-n", str(args.max_tokens),
           "-d", str(depth), "-t", str(args.threads), "-r", "1", "-o", "json",
           *args.llama_args.split()]
    r, out, err = run_in_cgroup("llama.cpp", budget, cmd)
    if r["rc"] == 0:
        rows = json.loads(out)
        r["decode_tps"] = rows[-1]["avg_ts"]
        r["type"] = rows[-1].get("model_type", "")
    else:
        r["error"] = (err.strip().splitlines() or ["killed"])[-1]
    return r


def summary(rows, key="decode_tps"):
    vals = [r[key] for r in rows if r.get(key) is not None]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def fmt_tps(s):
    return "—" if s is None else f"{s['median']:.2f} [{s['min']:.2f}–{s['max']:.2f}]"


def make_model(out: Path, seed=0):
    """The benchmark model: a Hugging Face folder (bf16, for llama.cpp's
    converter and for `infer prep`) and its prep folder."""
    from infer.prep import prep
    from infer.synth import synth
    from infer.synth import presets as synth_presets

    synth_presets.SIZES["cgroup-bench"] = BENCH_SIZES
    synth.PRESETS = synth_presets.PRESETS = tuple(synth_presets.SIZES) + tuple(synth_presets.REAL)
    out.mkdir(parents=True, exist_ok=True)
    hf = out / "hf"
    if not (hf / "config.json").exists():
        assert synth.main(["--arch", "qwen3_moe", "--preset", "cgroup-bench", "--layout", "hf",
                           "--seed", str(seed), "--out", str(hf), "--force"]) == 0
    if not (out / "prep" / "manifest.json").exists():
        assert prep.main(["--model", str(hf), "--out", str(out / "prep"), "--force"]) == 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="prep folder")
    p.add_argument("--budgets", default="min,0.25x,0.5x,979M,1x")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--gguf", type=Path, help="the same weights as GGUF, for llama.cpp")
    p.add_argument("--llama-bench", default="llama-bench")
    p.add_argument("--llama-caps", default="0.25x,0.5x")
    p.add_argument("--llama-args", default="-lm mmap --repack 0", help="more llama-bench flags")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--skip-ours", action="store_true", help="llama.cpp only")
    p.add_argument("--json", type=Path)
    p.add_argument("--make-model", type=Path, metavar="DIR",
                   help="build the benchmark model into DIR/hf and DIR/prep, then exit")
    args = p.parse_args(argv)
    if args.make_model:
        make_model(args.make_model)
        return 0
    if args.model is None:
        p.error("--model is required")
    why = usable()
    if why:
        print(f"bench_cgroup: no memory cgroup: {why}", file=sys.stderr)
        return 2
    from infer.runtime.budget import context_tokens, plan_memory
    from shared.blob import Manifest

    context = context_tokens(args.prompt, args.max_tokens)
    manifest = Manifest.load(args.model)
    model_bytes = folder_bytes(args.model)
    budgets = [resolve_budget(b, args.model, args.dtype, context) for b in args.budgets.split(",")]
    caps = ([resolve_budget(b, args.model, args.dtype, context) for b in args.llama_caps.split(",")]
            if args.gguf else [])
    depth = 0
    if args.gguf:
        from mlx_lm.tokenizer_utils import load as load_tokenizer

        from infer.run import encode_prompt

        # llama.cpp decodes after as many tokens as infer run's prompt has
        depth = len(encode_prompt(load_tokenizer(args.model), args.prompt))
    print(f"model {args.model}: {format_size(model_bytes)}; budgets "
          f"{', '.join(format_size(b) for b in budgets)}; {args.runs} rounds", flush=True)
    rows = []
    for rnd in range(args.runs):
        order = [("infer", b) for b in budgets if not args.skip_ours]
        for c in caps:
            pair = [("llama.cpp", c), ("infer", c)] if rnd % 2 else [("infer", c), ("llama.cpp", c)]
            order += [x for x in pair if x[0] == "llama.cpp" or (c not in budgets and not args.skip_ours)]
        for prog, b in order:
            r = run_ours(args.model, b, args) if prog == "infer" else run_llama(args.gguf, b, args, depth)
            r["round"] = rnd
            rows.append(r)
            peak = format_size(r["peak"]) if r["peak"] is not None else "?"
            tps = f"{r['decode_tps']:.2f} tok/s" if "decode_tps" in r else r.get("error", "")
            print(f"round {rnd} {prog:9s} cap {format_size(b):>10s}: rc {r['rc']}, peak {peak}, "
                  f"failcnt {r['failcnt']}, oom_kill {r['oom_kill']}, {tps}", flush=True)
            if args.json:
                args.json.write_text(json.dumps(rows, indent=1))

    print("\n| program | cap | plan: cache, prefill step | peak cgroup usage (max of runs) | "
          "peak / cap | failcnt | OOM kills | exit | decode tok/s median [range] | hit rate |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for prog, b in sorted({(r["program"], r["budget"]) for r in rows}, key=lambda x: (x[1], x[0])):
        rs = [r for r in rows if r["program"] == prog and r["budget"] == b]
        plan = ""
        if prog == "infer":
            try:
                pl = plan_memory(b, args.model, manifest, dtype=args.dtype, context=context)
                plan = f"{format_size(pl.stack_bytes)}, {pl.prefill_step}"
            except ValueError:
                plan = "refused"
        peak = max((r["peak"] or 0) for r in rs)
        hits = sum(r.get("hits", 0) for r in rs)
        misses = sum(r.get("misses", 0) for r in rs)
        hit = f"{hits / (hits + misses):.2f}" if hits + misses else ""
        print(f"| {prog} | {format_size(b)} ({b / model_bytes:.2f}×) | {plan} | {format_size(peak)} | "
              f"{peak / b:.2f} | {max(r['failcnt'] for r in rs)} | {sum(r['oom_kill'] for r in rs)} | "
              f"{','.join(str(r['rc']) for r in rs)} | {fmt_tps(summary(rs))} | {hit} |")
    for c in caps:
        ours = summary([r for r in rows if r["program"] == "infer" and r["budget"] == c])
        theirs = summary([r for r in rows if r["program"] == "llama.cpp" and r["budget"] == c])
        if ours and theirs:
            print(f"cap {format_size(c)} ({c / model_bytes:.2f}× the model): infer / llama.cpp = "
                  f"{ours['median'] / theirs['median']:.2f}× (medians)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
