"""The memory budget: refusal below the minimum, and the cache follows the budget."""

import pytest

from infer.budget import (DAEMON_OVERHEAD, top_k, plan_memory, resident_bytes,
                          staging_arena_bytes)
from infer.loader import load_streaming
from iod.inproc import InprocSource
from shared.blob import Manifest


def test_refuses_a_budget_below_the_minimum_and_names_it(prep_model):
    prep = prep_model("qwen3_moe")
    manifest = Manifest.load(prep)
    minimum = plan_memory(1 << 40, prep, manifest).minimum
    assert minimum > resident_bytes(prep)
    with pytest.raises(ValueError) as e:
        plan_memory(minimum - 1, prep, manifest)
    msg = str(e.value)
    assert "minimum" in msg and "resident weights" in msg and "arena" in msg
    from shared.units import format_size

    assert format_size(minimum) in msg
    assert plan_memory(minimum, prep, manifest).cache_bytes == 0


def test_private_daemon_and_its_staging_arena_are_part_of_the_budget(prep_model):
    prep = prep_model("qwen3_moe")
    manifest = Manifest.load(prep)
    private = plan_memory(1 << 30, prep, manifest, private_daemon=True)
    shared = plan_memory(1 << 30, prep, manifest, private_daemon=False)
    assert private.arena_bytes == staging_arena_bytes(manifest, 2, top_k(prep))
    assert private.daemon_bytes == DAEMON_OVERHEAD and shared.arena_bytes == 0
    assert shared.cache_bytes - private.cache_bytes == private.arena_bytes + DAEMON_OVERHEAD
    # the staging arena holds a whole layer's experts (a prefill call) and more
    most = max(l.num_experts for l in manifest.layers)
    assert private.arena_bytes >= most * manifest.max_stride


def test_cache_size_follows_the_budget(prep_model):
    prep = prep_model("qwen3_moe")
    manifest = Manifest.load(prep)
    minimum = plan_memory(1 << 40, prep, manifest).minimum
    record = max(l.record_bytes for l in manifest.layers)
    n_layers = len(manifest.layers)
    caps = []
    for extra_experts in (0, 3, 7):
        budget = minimum + extra_experts * n_layers * record
        plan = plan_memory(budget, prep, manifest)
        assert plan.cache_bytes == budget - minimum
        source = InprocSource(prep, arena=64 << 20)
        _, _, store = load_streaming(prep, source, plan.cache_bytes)
        caps.append({store.stack(l.layer).capacity for l in manifest.layers})
        source.close()
    assert caps == [{0}, {3}, {7}]


def test_infer_run_sizes_the_private_arena_from_the_budget(prep_model, monkeypatch, tmp_path):
    import infer.client
    from infer import run

    monkeypatch.setenv("IOD_RUN_DIR", str(tmp_path))  # no shared daemon here
    seen = {}

    class Probe:
        def __init__(self, model_dir, iod="auto", **kw):
            seen.update(kw, iod=iod)
            raise infer.client.IodError("probe")

    monkeypatch.setattr(infer.client, "IodClient", Probe)
    prep = prep_model("qwen3_moe")
    manifest = Manifest.load(prep)
    plan = plan_memory(1 << 30, prep, manifest)
    assert run.main(["--model", str(prep), "--mem-budget", "1G"]) == 2
    assert seen == {"iod": "auto", "arena": plan.arena_bytes, "working_set": 2, "profile": False}
    seen.clear()
    # attaching to a given daemon: its arena is not the session's to size
    assert run.main(["--model", str(prep), "--mem-budget", "1G", "--iod", "/x.sock"]) == 2
    assert seen == {"iod": "/x.sock", "working_set": 2, "profile": False}


def test_infer_run_refuses_with_the_minimum(prep_model, capsys, monkeypatch, tmp_path):
    from infer import run

    monkeypatch.setenv("IOD_RUN_DIR", str(tmp_path))
    prep = prep_model("qwen3_moe")
    assert run.main(["--model", str(prep), "--mem-budget", "1M"]) == 2
    err = capsys.readouterr().err
    minimum = plan_memory(1 << 40, prep, Manifest.load(prep)).minimum
    from shared.units import format_size

    assert f"below the minimum {format_size(minimum)}" in err
