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
    from shared.fixtures import short_dir
    import shutil

    folder = short_dir("iodd-")
    monkeypatch.setenv("IOD_RUN_DIR", str(folder))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _rank_layers(manifest, moe_layers):
    lo, hi = moe_layers
    return [l for l in manifest.layers if lo <= l.layer < hi]


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next", "deepseek_v3"])
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
    # mlx-lm's split: rank 1 runs the first half of the decoder layers, rank 0
    # the last; a rank's MoE layers are those among its decoder layers (an MTP
    # layer is not one; deepseek_v3's first layer is dense)
    n = json.loads((prep / "config.json").read_text())["num_hidden_layers"]
    for rank, (lo, hi) in zip(ranks, [(n // 2, n), (0, n // 2)]):
        own = [l.layer for l in manifest.layers if lo <= l.layer < hi]
        assert rank["moe_layers"] == [own[0], own[-1] + 1]
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


def test_ranks_print_what_one_process_prints(prep_model, tmp_path):
    prep = prep_model("qwen3_moe")
    base = ["--model", str(prep), "--prompt", PROMPT, "--max-tokens", "12"]
    one = run_cli(base)
    # mlx.launch's rank scripts once left their pid and host files in TMPDIR
    two = run_cli(base + ["--ranks", "2"], env={"TMPDIR": str(tmp_path)}, timeout=300)
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    assert not list(tmp_path.iterdir())
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
    from infer.runtime.distributed import launch

    # past the parent's checks, each rank finds no prep folder: exit 2
    assert launch("run", 2, ["--model", str(tmp_path / "nope")]) == 2


def test_a_rank_terminated_after_another_failed_does_not_hide_the_failure():
    """mlx.launch sends SIGTERM to the other ranks when one fails: the 143 of
    a rank caught before its own check ran must not stand for the 2."""
    from infer.runtime.distributed import TERMINATED, worst

    assert worst([TERMINATED, 2, 0]) == 2 and worst([2, TERMINATED]) == 2
    assert worst([TERMINATED, TERMINATED, 0]) == TERMINATED  # a user's SIGTERM
    assert worst([0, 0, 0]) == 0 and worst([1, 0, 2]) == 2 and worst([0, 1]) == 1


def test_ranks_errors_are_one_line_exit_2(synth_model, prep_model):
    prep = prep_model("qwen3_moe")
    r = run_cli(["--model", str(prep), "--ranks", "2", "--draft", "ngram"])
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--ranks" in r.stderr
    mixtral = prep_model("mixtral")  # mlx-lm has no pipeline() for it
    r = run_cli(["--model", str(mixtral), "--ranks", "2"])
    assert r.returncode == 2 and "mixtral" in r.stderr and r.stderr.count("\n") == 1
    r = run_cli(["--model", str(prep), "--ranks", "0"])
    assert r.returncode == 2
    # more ranks than layers: refused before any rank is launched
    layers = json.loads((prep / "config.json").read_text())["num_hidden_layers"]
    r = run_cli(["--model", str(prep), "--ranks", str(layers + 1)])
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"infer run: --ranks {layers + 1}: the model has {layers} decoder layers to split"]


def _daemon_bytes(daemon):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "iod.cli", "status", "--json", "--socket",
                        str(daemon.socket)], capture_output=True, text=True, check=True)
    return json.loads(r.stdout)["counters"]["bytes_read"]


def test_each_rank_streams_through_its_own_hosts_daemon(synth_model, prep_model, tmp_path):
    """One daemon per host: '{rank}' in --iod gives each local rank its own."""
    from shared.fixtures import LiveDaemon, short_dir

    src, prep = synth_model("qwen3_moe"), prep_model("qwen3_moe")
    root = short_dir("iodh-")
    for r in range(2):
        (root / f"r{r}").mkdir(mode=0o700)
    daemons = [LiveDaemon(root / f"r{r}") for r in range(2)]
    try:
        r = run_cli(["--model", str(prep), "--prompt", PROMPT, "--max-tokens", "16", "--json",
                     "--mem-budget", tiny_budget(prep), "--ranks", "2",
                     "--iod", str(root / "r{rank}" / "iod.sock")], timeout=300)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["tokens"] == mlx_greedy_ids(src, 16)
        for daemon, rank in zip(daemons, out["stats"]["ranks"]):
            assert _daemon_bytes(daemon) > 0 and rank["bytes_read"] > 0
        assert out["stats"]["daemon_pid"] == daemons[0].pid  # rank 0 reports its own daemon
    finally:
        for d in daemons:
            d.stop()
        import shutil

        shutil.rmtree(root, ignore_errors=True)


def test_a_rank_streams_only_its_own_layers(prep_model):
    """The rank's manifest (its store, cache and budget) holds the layers of
    mlx-lm's split only; an MTP head's layer belongs to no rank."""
    from types import SimpleNamespace

    from infer.runtime.distributed import layer_range, rank_manifest

    prep = prep_model("qwen3_next")  # 4 decoder layers and the MTP head's layer 4
    manifest = Manifest.load(prep)
    assert [l.layer for l in manifest.layers] == [0, 1, 2, 3, 4]
    got = {}
    for r in range(2):
        g = SimpleNamespace(rank=lambda r=r: r, size=lambda: 2)
        got[r] = [l.layer for l in rank_manifest(manifest, prep, g).layers]
    assert got == {0: [2, 3], 1: [0, 1]}  # rank size-1 runs the first layers
    three = {r: layer_range(5, SimpleNamespace(rank=lambda r=r: r, size=lambda: 3)) for r in range(3)}
    assert three == {2: (0, 1), 1: (1, 3), 0: (3, 5)}  # the low ranks take the extra layers


def test_serve_with_two_ranks_answers_like_mlx_lm(synth_model, prep_model, run_dir):
    """`infer serve --ranks 2`: rank 0 serves HTTP, both ranks generate (each
    streams its own layers through the shared daemon); the completion is
    mlx-lm's greedy text, and SIGTERM ends every rank."""
    import signal
    import subprocess
    import time

    import openai
    from mlx_lm import generate as mlx_generate
    from mlx_lm import load as mlx_load

    from shared.fixtures import LiveDaemon
    from tests.test_serve import start_server

    src, prep = synth_model("qwen3_moe"), prep_model("qwen3_moe")
    model, tokenizer = mlx_load(str(src))
    expected = mlx_generate(model, tokenizer, tokenizer.encode(PROMPT), max_tokens=12)
    env = dict(os.environ, IOD_RUN_DIR=str(run_dir))
    daemon = LiveDaemon(run_dir, env=env)
    proc, hostport = start_server(prep, daemon.socket, env, "--ranks", "2")
    try:
        client = openai.OpenAI(base_url=f"http://{hostport}/v1", api_key="none", timeout=240,
                               max_retries=0)
        for _ in range(2):  # the second request reuses the loaded pipeline
            r = client.completions.create(model="default_model", prompt=PROMPT, max_tokens=12,
                                          temperature=0.0)
            assert r.choices[0].text == expected
        from infer.runtime.client import IodClient

        with IodClient(prep, iod=str(daemon.socket)) as probe:
            ranks = {x["pid"] for x in probe.stats()["sessions"]} - {os.getpid()}
        assert len(ranks) == 2  # one session per rank, on the one daemon
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
        time.sleep(0.5)
        left = subprocess.run(["pgrep", "-f", f"infer.cli serve --model {prep}"], capture_output=True, text=True)
        assert left.stdout.strip() == "", left.stdout  # no rank left behind
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        daemon.stop()


def test_bench_with_two_ranks(prep_model, tmp_path, run_dir):
    """`infer bench --ranks 2`: the streaming modes run as two ranks (each
    over its own layers), resident as one process; the tokens are equal and
    the mode's misses are the ranks' sums."""
    import subprocess
    import sys

    prep = prep_model("qwen3_moe")
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "infer.cli", "bench", "--model", str(prep), "--modes",
                        "resident,sync,iod", "--ranks", "2", "--runs", "1", "--max-tokens", "8",
                        "--dtype", "float32", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert report["tokens_equal"]
    manifest = Manifest.load(prep)
    for mode in ("sync", "iod"):
        m = report["modes"][mode]
        ranks = m["ranks"]
        assert [x["rank"] for x in ranks] == [0, 1]
        assert m["misses"] == sum(x["misses"] for x in ranks) and all(x["misses"] > 0 for x in ranks)
        own = [l.layer for x in ranks for l in _rank_layers(manifest, x["moe_layers"])]
        assert sorted(own) == sorted(l.layer for l in manifest.layers)  # each layer on one rank
    assert "ranks" not in report["modes"]["resident"]
