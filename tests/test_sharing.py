"""Several sessions on one daemon: one read serves them all, per-session
figures in ``iod status``, and a session that dies mid-stream harms nobody.

The proof of sharing is the daemon's own read counter: records are read
from disk at most once however many sessions ask for them."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from infer.runtime.client import IodClient
from shared import protocol as P
from shared.blob import Manifest
from shared.fixtures import LiveDaemon, Raw, record_bytes, short_dir, wait_for
from tests.test_run import PROMPT, mlx_greedy_ids

N_TOKENS = 32


@pytest.fixture
def daemon(monkeypatch):
    folder = short_dir("iods-")
    monkeypatch.setenv("IOD_RUN_DIR", str(folder))
    d = LiveDaemon(folder, args=["--arena", "64M"])
    yield d
    d.stop()
    shutil.rmtree(folder, ignore_errors=True)


def stats(daemon):
    r = Raw(daemon.socket)
    try:
        return r.rt(P.Stats(r.req())).stats
    finally:
        r.close()


def infer_run(daemon, prep, *args, **kw):
    cmd = [sys.executable, "-m", "infer.cli", "run", "--model", str(prep),
           "--iod", str(daemon.socket), "--prompt", PROMPT, *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_second_client_is_served_from_the_arena(daemon, prep_model):
    prep = prep_model("qwen3_moe")
    layout = Manifest.load(prep).layers[0]
    a = IodClient(prep, iod=str(daemon.socket))
    b = IodClient(prep, iod=str(daemon.socket))
    try:
        got_a = a.read(0, range(8))
        reads = a.stats()["counters"]["reads"]
        assert reads == 8
        got_b = b.read(0, range(8))
        st = b.stats()
        assert st["counters"]["reads"] == reads  # nothing read again
        assert b.counters["arena_hits"] == 8 and b.counters["demanded"] == 0  # no message
        for e in range(8):
            assert got_a[e] == got_b[e] == record_bytes(prep, layout, e)
        # per-session figures: b never had to ask the daemon
        by_id = {s["id"]: s for s in st["sessions"]}
        assert by_id[a.session_id]["misses"] == 8 and by_id[a.session_id]["demands"] == 1
        assert by_id[b.session_id]["demands"] == 0 and by_id[b.session_id]["bytes"] == 0
        # and `iod status` prints a line per session with its figures
        text = subprocess.run([sys.executable, "-m", "iod.cli", "status"], capture_output=True,
                              text=True, env=dict(os.environ), timeout=30).stdout
        lines = [l for l in text.splitlines() if l.strip().startswith(("#1 pid", "#2 pid"))]
        assert len(lines) == 2 and all("demands" in l and "pins" in l for l in lines), text
        assert "latency (us)" in text
    finally:
        a.close()
        b.close()


def test_two_live_sessions_share_reads(daemon, synth_model, prep_model):
    prep = prep_model("qwen3_moe")
    manifest = Manifest.load(prep)
    procs = [infer_run(daemon, prep, "--max-tokens", str(N_TOKENS), "--json") for _ in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(json.loads(out))
    expected = mlx_greedy_ids(synth_model("qwen3_moe"), N_TOKENS)
    assert [o["tokens"] for o in outs] == [expected, expected]
    c = stats(daemon)["counters"]
    records = sum(l.num_experts for l in manifest.layers)
    # every record read at most once, though each session fetched many
    assert 0 < c["reads"] <= records
    fetched = [o["stats"]["bytes_read"] for o in outs]
    assert all(f > 0 for f in fetched)
    assert c["bytes_read"] < sum(fetched)


def test_killed_session_mid_stream_leaves_others_and_daemon_unharmed(daemon, synth_model, prep_model):
    prep = prep_model("qwen3_moe")
    # a long stream that is killed once it has printed some text
    victim = infer_run(daemon, prep, "--max-tokens", "100000", "--ignore-chat-template")
    try:
        assert victim.stdout.read(8), victim.stderr.read()
        other = infer_run(daemon, prep, "--max-tokens", str(N_TOKENS), "--json")
        wait_for(lambda: len(stats(daemon)["sessions"]) == 2 or other.poll() is not None,
                 timeout=60, what="two sessions at once")
        st = stats(daemon)
        assert victim.poll() is None, "the victim finished before it could be killed"
        pids = {s["pid"] for s in st["sessions"]}
        assert victim.pid in pids
        for s in st["sessions"]:
            assert {"requests", "demands", "hits", "misses", "bytes", "pins", "awaiting"} <= set(s)
        victim.kill()
        victim.wait()
        out, err = other.communicate(timeout=120)
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()
    assert other.returncode == 0, err
    assert json.loads(out)["tokens"] == mlx_greedy_ids(synth_model("qwen3_moe"), N_TOKENS)
    assert daemon.proc.poll() is None
    wait_for(lambda: not stats(daemon)["sessions"], what="both sessions gone")
    st = stats(daemon)
    assert st["arena"]["slots"].get("ready_pinned", 0) == 0
    assert st["counters"]["internal_errors"] == 0
    # and a new session is served
    layout = Manifest.load(prep).layers[1]
    with IodClient(prep, iod=str(daemon.socket)) as c:
        assert c.read(1, [3])[3] == record_bytes(prep, layout, 3)
