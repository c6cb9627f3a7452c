"""Time `infer train`'s optimizer step per MoE kernel before a long run.

    python scripts/gpu/train_probe.py --preset small --steps 6 --json probe.json \
        qwen3_moe:grouped qwen3_moe:gather qwen3_moe:gather+compile qwen3_next:gather+compile

Random token windows (no corpus needed); qwen3_next's linear attention as
`infer train` runs it by default there (in chunks on a GPU). Each variant's first step (kernel
compilation, tracing) is reported apart from the median of the others.
The JSON names the fastest variant per architecture.
"""

import argparse
import json
import statistics
import time

import mlx.core as mx
import numpy as np

from infer.train import train


def probe(arch, experts, compiled, preset, steps, dtype, seq=None, batch=None):
    p = train.PRESETS[preset]
    config = train.make_config(arch, preset)
    recipe = train.Recipe(seq=seq or p["seq"], batch=batch or p["batch"], steps=steps, lr=p["lr"],
                          eval_every=steps)
    mx.random.seed(0)
    trainee = train.Trainee(config, experts, train.default_delta())
    train.init_weights(trainee, config["num_hidden_layers"])
    trainer = train.Trainer(trainee, recipe, train.DTYPES[dtype], compiled)
    extra = 2 if trainee.num_mtp else 1
    rng = np.random.default_rng(0)
    times = []
    for _ in range(steps):
        window = rng.integers(0, config["vocab_size"], (recipe.batch, recipe.seq + extra)).astype(np.int32)
        t = time.perf_counter()
        loss, _ = trainer.step(window, recipe.lr)
        times.append(time.perf_counter() - t)
    tokens = recipe.batch * recipe.seq
    med = statistics.median(times[1:])
    return {"arch": arch, "experts": experts, "compiled": compiled, "delta": trainee.delta,
            "first_step_s": round(times[0], 2),
            "step_s": round(med, 4), "step_s_runs": [round(x, 4) for x in times[1:]],
            "tokens_per_s": round(tokens / med), "loss": round(loss, 4),
            "peak_memory_gb": round(mx.get_peak_memory() / 1e9, 1)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("variants", nargs="+", help="arch:grouped | arch:gather | arch:gather+compile")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seq", type=int)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--json")
    a = ap.parse_args()
    results = []
    for v in a.variants:
        arch, kernel = v.split(":")
        experts, _, comp = kernel.partition("+")
        try:
            r = probe(arch, experts, comp == "compile", a.preset, a.steps, a.dtype, a.seq, a.batch)
        except Exception as e:  # noqa: BLE001 - a variant that fails is reported, the rest still run
            r = {"arch": arch, "experts": experts, "compiled": comp == "compile", "error": f"{type(e).__name__}: {e}"[:500]}
        print(json.dumps(r), flush=True)
        results.append(r)
        mx.clear_cache()
        mx.reset_peak_memory()
    best = {}
    for r in results:
        if "error" not in r and (r["arch"] not in best or r["step_s"] < best[r["arch"]]["step_s"]):
            best[r["arch"]] = r
    report = {"preset": a.preset, "dtype": a.dtype, "device": str(mx.default_device()), "results": results,
              "best": {k: {"experts": v["experts"], "compile": v["compiled"]} for k, v in best.items()}}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    print(json.dumps(report["best"]))


if __name__ == "__main__":
    main()
