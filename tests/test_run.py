"""`infer run` and `infer.load`: token-exact through the real daemon, clean exits."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from mlx_lm import generate as mlx_generate
from mlx_lm import load as mlx_load
from mlx_lm import stream_generate

import infer
from infer.run import encode_prompt
from tests.iod_fixtures import LiveDaemon, shm_entries, short_dir

PROMPT = "Write a list of colors: red, green, blue"


def run_cli(args, env=None, timeout=120):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "infer.cli", "run", *args],
        capture_output=True,
        text=True,
        env=e,
        timeout=timeout,
    )


def tiny_budget(prep):
    """Just above the minimum: the expert cache holds almost nothing."""
    from infer.budget import plan_memory
    from shared.blob import Manifest

    return str(plan_memory(1 << 40, prep, Manifest.load(prep)).minimum + 4096)


def mlx_greedy_ids(src, max_tokens):
    model, tokenizer = mlx_load(str(src))
    ids = encode_prompt(tokenizer, PROMPT)
    out = []
    for r in stream_generate(model, tokenizer, ids, max_tokens=max_tokens):
        out.append(r.token)
    if r.finish_reason == "stop":
        out.pop()
    return out


@pytest.fixture
def run_dir(monkeypatch):
    folder = short_dir("iodr-")
    monkeypatch.setenv("IOD_RUN_DIR", str(folder))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


CASES = [("qwen3_moe", None)] + [
    (arch, "tiny") for arch in ("qwen3_moe", "qwen3_next", "mixtral", "gpt_oss", "deepseek_v3")
]


@pytest.mark.parametrize("arch,budget", CASES)
def test_run_json_matches_mlx_lm_on_embedded_daemon(synth_model, prep_model, run_dir, arch, budget):
    src, prep = synth_model(arch), prep_model(arch)
    args = ["--model", str(prep), "--prompt", PROMPT, "--max-tokens", "64", "--json"]
    if budget == "tiny":
        args += ["--mem-budget", tiny_budget(prep)]
    r = run_cli(args)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["tokens"] == mlx_greedy_ids(src, 64)
    stats = out["stats"]
    assert stats["misses"] > 0 and stats["bytes_read"] > 0
    if budget == "tiny":
        assert stats["misses"] > stats["hits"]
    # the private daemon is gone, with its shared memory and socket
    pid = stats["daemon_pid"]
    assert pid > 0 and not shm_entries(pid)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not list(run_dir.rglob("*.sock"))


def test_run_prints_text_and_summary(prep_model, run_dir):
    r = run_cli(["--model", str(prep_model("qwen3_moe")), "--prompt", PROMPT, "--max-tokens", "8"])
    assert r.returncode == 0, r.stderr
    summary = r.stderr.strip().splitlines()[-1]
    for word in ("prompt:", "tok/s", "decode:", "peak memory", "hits", "misses", "read"):
        assert word in summary


def test_python_api_works_with_mlx_lm_generate(synth_model, prep_model, run_dir):
    src, prep = synth_model("qwen3_moe"), prep_model("qwen3_moe")
    ref_model, ref_tok = mlx_load(str(src))
    expected = mlx_generate(ref_model, ref_tok, PROMPT, max_tokens=24)
    model, tokenizer = infer.load(prep, iod="auto")
    assert mlx_generate(model, tokenizer, PROMPT, max_tokens=24) == expected
    streamed = "".join(r.text for r in stream_generate(model, tokenizer, PROMPT, max_tokens=24))
    assert streamed == expected


def test_run_uses_a_shared_daemon(prep_model, run_dir):
    daemon = LiveDaemon(run_dir)
    try:
        r = run_cli(["--model", str(prep_model("qwen3_moe")), "--max-tokens", "8", "--json"])
        assert r.returncode == 0, r.stderr
        status = subprocess.run(
            [sys.executable, "-m", "iod.cli", "status", "--json"],
            capture_output=True, text=True, env=dict(os.environ),
        )
        stats = json.loads(status.stdout)
        assert stats["counters"]["bytes_read"] > 0  # the session's reads went through this daemon
        assert daemon.proc.poll() is None
    finally:
        daemon.stop()


def _one_line_exit_2(r):
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("infer run: "), r.stderr
    return lines[0]


def test_errors_are_one_line_exit_2(prep_model, tmp_path, run_dir):
    prep = prep_model("qwen3_moe")
    assert "manifest" in _one_line_exit_2(run_cli(["--model", str(tmp_path)]))

    bad = tmp_path / "old"
    shutil.copytree(prep, bad)
    m = json.loads((bad / "manifest.json").read_text())
    m["version"] = 99
    (bad / "manifest.json").write_text(json.dumps(m))
    assert "version" in _one_line_exit_2(run_cli(["--model", str(bad)]))

    missing = tmp_path / "missing"
    shutil.copytree(prep, missing)
    next(missing.glob("layer*.blob")).unlink()
    assert "missing blob" in _one_line_exit_2(run_cli(["--model", str(missing)]))

    line = _one_line_exit_2(run_cli(["--model", str(prep), "--iod", str(tmp_path / "nope.sock")]))
    assert "no iod daemon" in line

    line = _one_line_exit_2(run_cli(["--model", str(prep), "--mem-budget", "1M"]))
    assert "minimum" in line

    r = run_cli(["--model"])
    assert r.returncode == 2


def test_daemon_death_stops_session_quickly(prep_model, run_dir):
    daemon = LiveDaemon(run_dir)
    prep = prep_model("qwen3_moe")
    proc = subprocess.Popen(
        [sys.executable, "-m", "infer.cli", "run", "--model", str(prep),
         "--iod", str(daemon.socket), "--max-tokens", "100000", "--ignore-chat-template",
         "--mem-budget", tiny_budget(prep)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        proc.stdout.read(1)  # generation has started
        daemon.kill()
        t0 = time.monotonic()
        rc = proc.wait(timeout=30)
        elapsed = time.monotonic() - t0
        err = proc.stderr.read()
        assert rc == 1 and "iod" in err, err
        print(json.dumps({"daemon_death_to_exit_s": round(elapsed, 3)}))
        assert elapsed < 5.0 + 1.0  # the promise is "within 5 s"; 1 s for process exit
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)


def test_dropped_models_are_collected_without_hanging(prep_model, run_dir):
    """A model dropped without closing its client is garbage-collected: its
    socket and the process-wide ZeroMQ context never block the collector."""
    code = (
        "import gc, sys, infer\n"
        "from mlx_lm import generate\n"
        "for _ in range(3):\n"
        "    model, tok = infer.load(sys.argv[1])\n"
        "    generate(model, tok, 'hi', max_tokens=3)\n"
        "    del model, tok\n"
        "    gc.collect()\n"
        "print('collected')\n"
    )
    r = subprocess.run([sys.executable, "-c", code, str(prep_model("qwen3_moe"))],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "collected" in r.stdout, r.stderr[-2000:]
