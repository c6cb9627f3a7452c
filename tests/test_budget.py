"""The memory budget: refusal below the minimum, and the cache follows the budget."""

import json
import os
import subprocess
import sys

import pytest

from infer.runtime.budget import (DAEMON_OVERHEAD, PREFILL_STEP, minimum_budget, plan_memory,
                          resident_bytes, stack_record_bytes, staging_arena_bytes, top_k)
from infer.runtime.loader import load_streaming
from iod.inproc import InprocSource
from shared.blob import Manifest
from shared import cgroup
from shared.cgroup import drop_page_cache


def test_refuses_a_budget_below_the_minimum_and_names_it(prep_model):
    prep = prep_model("qwen3_moe")
    manifest = Manifest.load(prep)
    minimum = minimum_budget(prep, manifest)
    assert minimum > resident_bytes(prep)
    with pytest.raises(ValueError) as e:
        plan_memory(minimum - 1, prep, manifest)
    msg = str(e.value)
    assert "minimum" in msg and "resident weights" in msg and "arena" in msg
    from shared.units import format_size

    assert format_size(minimum) in msg
    # at the minimum every stack holds the one expert a stack always has room for
    plan = plan_memory(minimum, prep, manifest)
    assert set(plan.capacity.values()) == {1} and plan.prefill_step == 1


def test_private_daemon_and_its_staging_arena_are_part_of_the_budget(prep_model):
    prep = prep_model("qwen3_moe")
    manifest = Manifest.load(prep)
    private = plan_memory(1 << 30, prep, manifest, private_daemon=True)
    shared = plan_memory(1 << 30, prep, manifest, private_daemon=False)
    assert private.arena_bytes == staging_arena_bytes(manifest, 2, top_k(prep), prefill=False)
    assert private.daemon_bytes == DAEMON_OVERHEAD and shared.arena_bytes == 0
    assert private.minimum - shared.minimum == private.arena_bytes + DAEMON_OVERHEAD
    # a staging area: one decode call's records and the prefetches of two layers
    # (a prefill's larger calls come in waves), not a second cache
    assert private.arena_bytes == 3 * top_k(prep) * manifest.max_stride + (1 << 20)


def test_stacks_are_planned_at_the_compute_dtype():
    """A bfloat16 folder run in float32: the stacks' scales and biases (and
    the resident floats) take twice their stored bytes."""
    from shared.blob import LayerLayout, Segment

    segs = [Segment("up_proj", "weight", "uint32", [64, 16], 0, 4096),
            Segment("up_proj", "scales", "bfloat16", [64, 2], 4096, 256),
            Segment("up_proj", "biases", "bfloat16", [64, 2], 4416, 256)]
    layout = LayerLayout(0, "m", "f", 8, 4672, 8192, segs, {})
    assert stack_record_bytes(layout) == 4096 + 2 * 256
    assert stack_record_bytes(layout, "float32") == 4096 + 2 * 512


def test_cache_size_follows_the_budget_and_the_store_gets_the_planned_stacks(prep_model):
    prep = prep_model("qwen3_moe")
    manifest = Manifest.load(prep)
    minimum = minimum_budget(prep, manifest, dtype="float32", context=256)
    record = max(stack_record_bytes(l, "float32") for l in manifest.layers)
    n_layers = len(manifest.layers)
    caps, steps = [], []
    for extra_experts in (0, 3, 7, 10 ** 6):
        budget = minimum + extra_experts * n_layers * record
        plan = plan_memory(budget, prep, manifest, dtype="float32", context=256)
        assert plan.minimum + plan.stack_bytes <= budget
        source = InprocSource(prep, arena=64 << 20)
        _, _, store = load_streaming(prep, source, plan.cache_bytes)
        got = {l.layer: store.stack(l.layer).capacity for l in manifest.layers}
        source.close()
        assert got == plan.capacity
        caps.append(min(got.values()))
        steps.append(plan.prefill_step)
    assert caps == sorted(caps) and caps[0] == 1
    assert caps[-1] == min(l.num_experts for l in manifest.layers)
    assert steps[0] == 1 and steps[-1] == PREFILL_STEP  # everything cached: mlx-lm's own step


def test_infer_run_sizes_the_private_arena_from_the_budget(prep_model, monkeypatch, tmp_path):
    import infer.runtime.client
    from infer import run

    monkeypatch.setenv("IOD_RUN_DIR", str(tmp_path))  # no shared daemon here
    seen = {}

    class Probe:
        def __init__(self, model_dir, iod="auto", **kw):
            seen.update(kw, iod=iod)
            raise infer.runtime.client.IodError("probe")

    monkeypatch.setattr(infer.runtime.client, "IodClient", Probe)
    prep = prep_model("qwen3_moe")
    manifest = Manifest.load(prep)
    plan = plan_memory(1 << 30, prep, manifest)
    assert run.main(["--model", str(prep), "--mem-budget", "1G"]) == 2
    assert seen == {"iod": "auto", "arena": plan.arena_bytes, "working_set": 2, "profile": False,
                    "timeout": 10.0}
    seen.clear()
    # attaching to a given daemon: its arena is not the session's to size
    assert run.main(["--model", str(prep), "--mem-budget", "1G", "--iod", "/x.sock"]) == 2
    assert seen == {"iod": "/x.sock", "working_set": 2, "profile": False, "timeout": 10.0}


def test_infer_run_refuses_with_the_minimum(prep_model, capsys, monkeypatch, tmp_path):
    from infer import run

    monkeypatch.setenv("IOD_RUN_DIR", str(tmp_path))
    prep = prep_model("qwen3_moe")
    assert run.main(["--model", str(prep), "--mem-budget", "1M"]) == 2
    err = capsys.readouterr().err
    from infer.runtime.budget import context_tokens

    minimum = minimum_budget(prep, Manifest.load(prep), context=context_tokens("Hello", 100))
    from shared.units import format_size

    assert f"below the minimum {format_size(minimum)}" in err


# ---- the budget holds inside a memory cgroup of its size --------------------------

PROMPT = "Write a list of colors: red, green, blue, and then some more"
NO_CGROUP = cgroup.usable()


def _infer_json(args, env, cg=None, timeout=300):
    cmd = [sys.executable, "-m", "infer.cli", "run", *args, "--json"]
    kw = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    proc = cg.popen(cmd, **kw) if cg is not None else subprocess.Popen(cmd, **kw)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return proc.returncode, out, err


def _mlx_greedy_ids(src, prompt, n):
    """mlx-lm's greedy ids on the model folder itself (float32 weights)."""
    import mlx.core as mx
    from mlx_lm import load as mlx_load
    from mlx_lm.generate import generate_step

    from infer.run import encode_prompt

    model, tokenizer = mlx_load(str(src))
    ids = mx.array(encode_prompt(tokenizer, prompt))
    out = []
    for t, _ in generate_step(ids, model, max_tokens=n):
        if int(t) in tokenizer.eos_token_ids:
            break
        out.append(int(t))
    return out


@pytest.mark.skipif(NO_CGROUP is not None, reason=f"no memory cgroup here: {NO_CGROUP}")
def test_infer_run_fits_in_a_memory_cgroup_of_its_budget(synth_model, prep_model, tmp_path):
    """`infer run --mem-budget B` (its private daemon and arena, MLX's buffers
    and the page cache it causes) runs in a fresh memory cgroup of exactly B,
    at the minimum budget, a middle one and the model's size: no OOM kill,
    exit 0, mlx-lm's greedy ids; one byte below the minimum is refused."""
    from infer.runtime.budget import context_tokens

    src, prep = synth_model("qwen3_moe"), prep_model("qwen3_moe")
    manifest = Manifest.load(prep)
    n = 12
    want = _mlx_greedy_ids(src, PROMPT, n)
    assert len(want) == n

    common = ["--model", str(prep), "-p", PROMPT, "-m", str(n), "--dtype", "float32"]
    context = context_tokens(PROMPT, n)
    minimum = minimum_budget(prep, manifest, dtype="float32", context=context)
    experts = sum(l.num_experts * stack_record_bytes(l, "float32") for l in manifest.layers)
    middle = minimum + experts // 2
    model_size = sum(p.stat().st_size for p in prep.iterdir() if p.is_file())
    budgets = (minimum, middle, max(model_size, middle))
    plans = [plan_memory(b, prep, manifest, dtype="float32", context=context) for b in budgets]
    # the minimum runs every call on a compact stack of one token's experts;
    # the middle one caches about half of them
    assert set(plans[0].capacity.values()) == {1} and plans[0].prefill_step == 1
    assert 1 < min(plans[1].capacity.values()) < max(l.num_experts for l in manifest.layers)
    for i, budget in enumerate(budgets):
        drop_page_cache([prep])  # charged for what it reads, not found cached
        env = dict(os.environ, IOD_RUN_DIR=str(tmp_path / f"run{i}"))
        with cgroup.MemoryCgroup(budget) as cg:
            rc, out, err = _infer_json(common + ["--mem-budget", str(budget)], env, cg)
            stats = cg.stats()
            path = cg.path
        assert not path.exists()  # removed, with nothing left inside
        assert stats["oom_kill"] == 0, f"OOM-killed in a {budget}-byte cgroup: {stats}"
        assert rc == 0, err
        assert stats["peak"] is None or stats["peak"] <= budget
        assert json.loads(out)["tokens"] == want, f"budget {budget}"
    # below the minimum: one line naming it, exit 2, before anything loads
    env = dict(os.environ, IOD_RUN_DIR=str(tmp_path / "below"))
    rc, out, err = _infer_json(common + ["--mem-budget", str(minimum - 1)], env)
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
    from shared.units import format_size

    assert f"below the minimum {format_size(minimum)}" in err
