"""`infer run --ranks N`: a pipeline over ranks of mlx.launch (ring backend over
loopback), token-exact against mlx-lm, printed once, each rank streaming only
its own layers' experts."""

import json
import os

import pytest

from shared.blob import Manifest
from tests.test_run import PROMPT, mlx_greedy_ids, run_cli, tiny_budget


@pytest.fixture(autouse=True)
def run_dir(monkeypatch):
    from tests.iod_fixtures import short_dir
    import shutil

    folder = short_dir("iodd-")
    monkeypatch.setenv("IOD_RUN_DIR", str(folder))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _rank_layers(manifest, moe_layers):
    lo, hi = moe_layers
    return [l for l in manifest.layers if lo <= l.layer < hi]


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
def test_two_ranks_give_mlx_lm_greedy_ids(synth_model, prep_model, arch):
    src, prep = synth_model(arch), prep_model(arch)
    args = ["--model", str(prep), "--prompt", PROMPT, "--max-tokens", "24", "--json",
            "--mem-budget", tiny_budget(prep), "--ranks", "2"]
    r = run_cli(args, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)  # one JSON object: rank 1 printed nothing
    assert out["tokens"] == mlx_greedy_ids(src, 24)
    stats = out["stats"]
    manifest = Manifest.load(prep)
    ranks = stats["ranks"]
    # mlx-lm's split: rank 1 runs the first half of the layers, rank 0 the last
    n = json.loads((prep / "config.json").read_text())["num_hidden_layers"]  # (an MTP layer is not one)
    assert [r["moe_layers"] for r in ranks] == [[n // 2, n], [0, n // 2]]
    for rank in ranks:
        own = _rank_layers(manifest, rank["moe_layers"])
        assert len({l.record_bytes for l in own}) == 1
        assert rank["misses"] > 0
        # a rank reads whole records of its own layers only
        assert rank["bytes_read"] == rank["misses"] * own[0].record_bytes
    assert stats["bytes_read"] == sum(r["bytes_read"] for r in ranks)
    assert stats["misses"] == sum(r["misses"] for r in ranks)
    # per decode token: rank 1 sends its hidden state to rank 0, then both
    # all_gather the last one: three float32 vectors of hidden_size
    hidden = json.loads((prep / "config.json").read_text())["hidden_size"]
    assert stats["activation_bytes_per_token"] == 3 * hidden * 4


def test_ranks_print_what_one_process_prints(prep_model):
    prep = prep_model("qwen3_moe")
    base = ["--model", str(prep), "--prompt", PROMPT, "--max-tokens", "12"]
    one = run_cli(base)
    two = run_cli(base + ["--ranks", "2"], timeout=300)
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    text = lambda out: out.split("==========")[1]
    assert two.stdout.count("==========") == 2
    assert text(two.stdout) == text(one.stdout)
    assert "Pipeline: 2 ranks" in two.stdout
    # --verbose False: the text only, once
    quiet = run_cli(base + ["--verbose", "False", "--ranks", "2"], timeout=300)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout == text(one.stdout).strip("\n") + "\n"


def test_ranks_read_the_prompt_from_stdin_once(prep_model):
    import subprocess
    import sys

    prep = prep_model("qwen3_moe")
    base = [sys.executable, "-m", "infer.cli", "run", "--model", str(prep), "--max-tokens", "8",
            "--json", "--prompt", "-"]
    one = subprocess.run(base, input=PROMPT, capture_output=True, text=True, timeout=120)
    two = subprocess.run(base + ["--ranks", "2"], input=PROMPT, capture_output=True, text=True,
                         timeout=300)
    assert two.returncode == 0, two.stderr
    assert json.loads(two.stdout)["tokens"] == json.loads(one.stdout)["tokens"]


def test_a_rank_failure_is_the_exit_status(tmp_path):
    """mlx.launch exits 0 whatever its ranks do: each rank's own status counts."""
    from infer.distributed import launch

    # past the parent's checks, each rank finds no prep folder: exit 2
    assert launch("run", 2, ["--model", str(tmp_path / "nope")]) == 2


def test_ranks_errors_are_one_line_exit_2(synth_model, prep_model):
    prep = prep_model("qwen3_moe")
    r = run_cli(["--model", str(prep), "--ranks", "2", "--draft", "ngram"])
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--ranks" in r.stderr
    mixtral = prep_model("mixtral")  # mlx-lm has no pipeline() for it
    r = run_cli(["--model", str(mixtral), "--ranks", "2"])
    assert r.returncode == 2 and "mixtral" in r.stderr and r.stderr.count("\n") == 1
    r = run_cli(["--model", str(prep), "--ranks", "0"])
    assert r.returncode == 2
