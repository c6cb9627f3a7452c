"""`infer bench` end to end on a tiny model, and the offline cache simulations."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from infer.tools.belady import belady_layer, belady_misses, simulate
from infer.tools.bench import cache_bytes_of
from infer.runtime.coldstart import write_usage
from shared.blob import Manifest

KEYS = ("decode_tok_s", "decode_tok_s_runs", "prefill_tok_s", "stall_fraction", "hit_rate",
        "misses", "belady_misses", "bytes_read_per_token", "recall", "precision",
        "peak_rss_infer", "peak_rss_iod", "tokens")


def test_bench_runs_every_mode_with_equal_tokens(prep_model, tmp_path):
    prep = prep_model("qwen3_moe")
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "infer.cli", "bench", "--model", str(prep),
                        "--runs", "1", "--max-tokens", "8", "--dtype", "float32", "--hits-first", "on",
                        "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert set(report) >= {"model", "budget_bytes", "read_rate", "modes"}
    assert list(report["modes"]) == ["resident", "sync", "inproc", "iod"]
    tokens = None
    for name, mode in report["modes"].items():
        for key in KEYS:
            assert key in mode, (name, key)
        assert len(mode["tokens"]) == 8 and len(mode["decode_tok_s_runs"]) == 1
        tokens = tokens or mode["tokens"]
        assert mode["tokens"] == tokens, name
        assert mode["belady_misses"] <= mode["misses"]
    assert report["tokens_equal"] is True
    assert report["modes"]["iod"]["peak_rss_iod"] > 0
    assert report["modes"]["sync"]["misses"] > 0
    assert report["modes"]["iod"]["recall"] is not None
    assert report["modes"]["sync"]["recall"] is None  # no prediction in mode (b)
    assert report["modes"]["sync"]["prefetched_bytes"] == 0
    for name in ("inproc", "iod"):
        m = report["modes"][name]
        assert set(m["prediction"]) >= {"1", "2"}
        assert m["stall_s_per_token"] >= 0
        assert 0 <= m["prefetch_unused_bytes"] <= m["prefetched_bytes"]
        assert "prefetch_reads" in m["source_counters"]
        # the decode misses, each found ready, late, unplanned or cold
        assert 0 < sum(m["miss_split"].values()) <= m["decode_misses"]
    assert "iod" in r.stdout and "belady" in r.stdout and "unused MB" in r.stdout
    assert report["modes"]["sync"]["hits_first"] is True
    assert report["modes"]["sync"]["hits_first_calls"] > 0
    for name in ("sync", "inproc", "iod"):  # records copied in place on the CPU
        m = report["modes"][name]
        assert m["copy_mode"] == "host" and m["arena_pinned"] is None
        assert m["cuda_graphs"] is None  # a CUDA figure
        assert m["copy_s_per_token"] > 0 and m["copy_gb_s"] > 0
        assert 0 <= m["aside_calls"] <= m["misses"]
        # the streamed calls' own host work, of it the prediction's: none without it
        assert 0 < m["host_s_per_token"] < m["decode_s_per_token"]
        assert 0 <= m["predict_s_per_token"] <= m["host_s_per_token"]
        assert (m["predict_s_per_token"] > 0) == (name != "sync")
    assert "resident" in report["modes"] and "host_s_per_token" not in report["modes"]["resident"]
    assert "host ms/tok (predict, on)" in r.stdout
    # 8 tokens: all within the gate's warm-up, every pass predicted (the
    # prompt's last token, a one-token pass as in mlx-lm, and 7 decode steps)
    gate = report["modes"]["iod"]["gate"]
    assert gate["mode"] == "auto" and gate["on"] and gate["passes_off"] == 0
    assert gate["passes_on"] == 8 and gate["probes"] == []


def short_bench(prep, tmp_path, modes, *flags):
    """`infer bench` of 8 tokens, one run, float32: its JSON report."""
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "infer.cli", "bench", "--model", str(prep),
                        "--runs", "1", "--max-tokens", "8", "--dtype", "float32", "--modes", modes,
                        *flags, "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text())


def test_bench_without_hits_first(prep_model, tmp_path):
    """--hits-first off: no call computes its cached experts before its
    reads; the ids stay the same."""
    report = short_bench(prep_model("qwen3_moe"), tmp_path, "resident,sync", "--hits-first", "off")
    assert report["tokens_equal"] is True
    sync = report["modes"]["sync"]
    assert sync["hits_first"] is False and sync["hits_first_calls"] == 0 and sync["misses"] > 0


def test_bench_without_prediction(prep_model, tmp_path):
    """--predict off: the streamed modes guess nothing and hint nothing at
    any depth; the ids stay the same."""
    report = short_bench(prep_model("qwen3_moe"), tmp_path, "resident,inproc", "--predict", "off")
    assert report["tokens_equal"] is True and report["depth"] > 0
    m = report["modes"]["inproc"]
    assert m["gate"]["mode"] == "off" and m["gate"]["passes_on"] == 0 and m["gate"]["passes_off"] == 8
    assert m["predict_s_per_token"] == 0 and m["prefetched_bytes"] == 0 and m["recall"] is None


def test_bench_reports_the_time_over_the_bytes_bound(prep_model, tmp_path, monkeypatch):
    """A token's time over its records' bytes read at the disk's ceiling:
    with reads capped (--read-rate) the cap is the ceiling; with an
    unprofiled disk and no cap there is no bound to report."""
    monkeypatch.setenv("IOD_DISK_PROFILE", str(tmp_path / "none.json"))  # no profile
    prep = prep_model("qwen3_moe")
    capped = short_bench(prep, tmp_path, "sync", "--read-rate", "400")["modes"]["sync"]
    assert capped["read_ceiling_bytes_s"] == 400e6
    bound_s = capped["bytes_read_per_token"] / 400e6
    assert bound_s > 0
    assert capped["time_over_bytes_bound"] == pytest.approx(1 / capped["decode_tok_s"] / bound_s)
    free = short_bench(prep, tmp_path, "sync")["modes"]["sync"]
    assert free["read_ceiling_bytes_s"] is None and free["time_over_bytes_bound"] is None


def test_bench_sessions_share_one_daemon(prep_model, tmp_path):
    prep = prep_model("qwen3_moe")
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "infer.cli", "bench", "--model", str(prep),
                        "--runs", "1", "--max-tokens", "8", "--modes", "iod", "--sessions", "2",
                        "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    s = json.loads(out.read_text())["sessions"]
    assert s["n"] == 2 and s["alone_decode_tok_s"] > 0
    for setup in ("shared", "private"):
        assert len(s[setup]["decode_tok_s"]) == 2 and s[setup]["tokens_equal"]
        assert s[setup]["bytes_read"] > 0
    # one daemon serves both sessions: never more reads than a daemon each
    assert s["shared"]["bytes_read"] <= s["private"]["bytes_read"]


def test_bench_refuses_bad_arguments(prep_model, tmp_path):
    from infer.tools.bench import main

    prep = prep_model("qwen3_moe")
    assert main(["--model", str(tmp_path / "none")]) == 2
    assert main(["--model", str(prep), "--budget", "1.5"]) == 2
    assert main(["--model", str(prep), "--modes", "gpu"]) == 2


def test_budget_argument_is_fraction_or_size():
    from types import SimpleNamespace

    layer = SimpleNamespace(module="model.layers.0.mlp.switch_mlp", stride=100, num_experts=10)
    mtp = SimpleNamespace(module="mtp.layers.0.mlp.switch_mlp", stride=100, num_experts=10)
    manifest = SimpleNamespace(layers=[layer, mtp])
    assert cache_bytes_of("0.25", manifest) == 250  # of the model's own layers: no MTP head drafts
    assert cache_bytes_of("1", manifest) == 1000
    assert cache_bytes_of("4K", manifest) == 4096
    with pytest.raises(ValueError):
        cache_bytes_of("2.0", manifest)


def test_belady_on_the_textbook_sequence():
    seq = [frozenset([e]) for e in (1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 4, 5)]
    assert belady_layer(seq, 3) == 7
    assert belady_layer(seq, 4) == 6
    assert belady_layer(seq, 0) == 12
    assert simulate([(0, r) for r in seq], 3, "lru") == 10


def test_belady_with_calls_of_several_experts_and_per_layer_capacity():
    # two slots, calls alternating two pairs: Belady keeps the pair needed
    # next-soonest after each call; by hand: 2 + 2 + 0 + 2 + 0 + 2
    a, b = frozenset([0, 1]), frozenset([2, 3])
    trace = [(0, a), (0, b)] * 3
    assert belady_misses(trace, 2) == 8
    assert simulate(trace, 2, "lru") == 12  # LRU always evicts the pair needed next
    assert belady_misses(trace, 4) == 4 and simulate(trace, 4, "lru") == 4
    # per layer: layer 0 has room for nothing, layer 1 for its pair
    trace = [(0, a), (1, a), (0, a), (1, a)]
    assert belady_misses(trace, {0: 0, 1: 2}) == 4 + 2
    # a call larger than the stack: what fits stays (the store's compact fallback)
    trace = [(0, frozenset([0, 1, 2])), (0, frozenset([0, 1, 2]))]
    assert belady_misses(trace, 2) == 3 + 1
    assert simulate(trace, 2, "lru") == 3 + 1


@pytest.mark.parametrize("policy", ["lru", "lfu", "decay16"])
def test_online_policies_never_beat_belady(policy):
    import random

    rng = random.Random(0)
    trace = [(l, frozenset(rng.sample(range(16), 3) if rng.random() < 0.5 else [l, l + 1, 2]))
             for _ in range(200) for l in range(3)]
    for cap in (0, 2, 5, 9, 16):
        assert belady_misses(trace, cap) <= simulate(trace, cap, policy)


@pytest.mark.parametrize("fraction", [0.1, 0.3])
def test_the_store_misses_what_its_simulated_policy_misses(prep_model, fraction):
    """The session cache's replacement rule is the one the policy table
    measured (decay16+fit), and Belady on its own trace never misses more."""
    from infer.tools.bench import decode, forced_ids
    from infer.runtime.loader import load_streaming
    from iod.inproc import InprocSource
    from infer.runtime.streaming import LayerStack

    prep = prep_model("qwen3_moe")
    source = InprocSource(prep, arena=64 << 20)
    model, tok, store = load_streaming(prep, source, None)
    store.cache_bytes = int(source.manifest.expert_bytes * fraction)
    store.prefetcher.depth = 0
    store.trace = []
    decode(model, tok.encode("Hello there, lighthouse"), forced_ids(tok, 24), 24, store)
    source.close()
    cap = {l: s.capacity for l, s in store.stacks.items()}
    assert LayerStack.HALF_LIFE == 16.0
    assert store.stats["misses"] == simulate(store.routing_trace(), cap, "decay16+fit")
    assert belady_misses(store.routing_trace(), cap) <= store.stats["misses"]


def test_warm_bench_fills_the_cache_and_runs_resident_speed_layers(prep_model, tmp_path):
    """--warm: a budget that holds every expert is filled before timing, so
    the timed run reads nothing and every layer runs as a resident one."""
    import json
    import subprocess
    import sys

    out = tmp_path / "warm.json"
    r = subprocess.run([sys.executable, "-m", "infer.cli", "bench", "--model",
                        str(prep_model("qwen3_moe")), "--budget", "1.0", "--runs", "1",
                        "--max-tokens", "8", "--warm", "--modes", "resident,iod",
                        "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    rep = json.loads(out.read_text())
    iod = rep["modes"]["iod"]
    assert rep["tokens_equal"] and iod["misses"] == 0 and iod["hit_rate"] == 1.0
    assert iod["bytes_read_per_token"] == 0 and iod["belady_misses"] is None
    # every call ran its layer whole (no sync), and the trace still has them all
    assert iod["whole_calls"] == iod["trace_calls"] > 0


def test_bench_pair_interleaves_resident_and_iod_with_equal_ids(prep_model, tmp_path):
    """scripts/bench/bench_pair.py: both models in one process, block by block;
    one ratio per block, both decode the forced text to the same ids."""
    out = tmp_path / "pair.json"
    root = Path(__file__).parents[1]
    script, env = root / "scripts" / "bench" / "bench_pair.py", {**os.environ, "PYTHONPATH": str(root)}
    r = subprocess.run([sys.executable, str(script), str(prep_model("qwen3_moe")), "--tokens", "12",
                        "--block", "3", "--json", str(out)], capture_output=True, text=True, timeout=300,
                       env=env)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert report["ids_equal"] is True and len(report["ratios"]) == 4
    assert report["ratios"] and all(x > 0 for x in report["ratios"])
    lo, hi = report["ratio_quartiles"]
    assert lo <= report["ratio_median"] <= hi
    assert report["stall_ms_per_token"] >= 0 and "iod / resident: median" in r.stdout
    # as on a GPU: activations as stored, every expert cached: a calibrated
    # folder's preload completes every stack, so every timed call runs whole
    folder = tmp_path / "calibrated"
    shutil.copytree(prep_model("qwen3_moe"), folder)
    layers = [l.layer for l in Manifest.load(folder).layers]
    write_usage(folder, {l: {0: 1} for l in layers}, 1)
    r = subprocess.run([sys.executable, str(script), str(folder), "--tokens", "6",
                        "--block", "3", "--budget", "1.0", "--dtype", "bfloat16", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert report["dtype"] == "bfloat16" and report["ids_equal"] is True and len(report["ratios"]) == 2
    assert report["whole_calls"] == 6 * len(layers)
    bad = subprocess.run([sys.executable, str(script), str(prep_model("qwen3_moe")), "--tokens", "2",
                          "--block", "3"], capture_output=True, text=True, timeout=60, env=env)
    assert bad.returncode == 2 and "at least two blocks" in bad.stderr


@pytest.mark.parametrize("flags,msg", [
    (["--runs", "0"], "--runs"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--max-tokens", "1"], "--max-tokens must be at least 2"),
    (["--read-rate", "-5"], "--read-rate"),
    (["--read-rate", "nan"], "--read-rate"),
    (["--depth", "-1"], "--depth"),
    (["--sessions", "-1"], "--sessions"),
    (["--ranks", "0"], "--ranks"),
    (["--modes", ""], "names no mode"),
    (["--modes", ","], "names no mode"),
    (["--modes", "iod", "--arena", "0"], "--arena 0"),
    (["--json", "/nonexistent/dir/x.json"], "is not a folder"),
    (["--json", "DIR"], "is a folder"),
    (["--json", "FILE/x.json"], "is not a folder"),
    (["--json", "/proc/x.json"], "cannot write there"),
])
def test_bench_refuses_bad_values_before_running(prep_model, tmp_path, capsys, monkeypatch, flags, msg):
    """One line, exit 2, before any run: no mode started, nothing written."""
    import infer.tools.bench as bench

    prep = prep_model("qwen3_moe")
    monkeypatch.setattr(bench, "run_mode", lambda *a, **kw: pytest.fail("a mode ran"))
    (tmp_path / "DIR").mkdir()
    (tmp_path / "FILE").write_text("x")
    flags = [f.replace("DIR", str(tmp_path / "DIR")).replace("FILE", str(tmp_path / "FILE")) for f in flags]
    before = sorted(tmp_path.rglob("*"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:  # argparse's refusals exit; main's return
        sys.exit(bench.main(["--model", str(prep), *flags]))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("infer bench: ") and msg in err[0], err
    assert sorted(tmp_path.rglob("*")) == before


def test_bench_zero_keeps_its_documented_meanings(prep_model):
    """--read-rate 0 (no cap), --depth 0 (no prediction), --sessions 0 (none) are accepted."""
    from infer.tools.bench import build_parser

    a = build_parser().parse_args(["--model", "m", "--read-rate", "0", "--depth", "0", "--sessions", "0"])
    assert (a.read_rate, a.depth, a.sessions) == (0.0, 0, 0)


def test_a_daemon_that_does_not_start_leaves_no_folder(monkeypatch, tmp_path):
    import shared.launch

    made = []
    real = shared.launch.tempfile.mkdtemp

    def mkdtemp(**kw):
        made.append(Path(real(**{**kw, "dir": str(tmp_path)})))
        return str(made[-1])

    def spawn(*a, **kw):
        raise RuntimeError("iod did not start")

    monkeypatch.setattr(shared.launch.tempfile, "mkdtemp", mkdtemp)
    monkeypatch.setattr(shared.launch, "spawn", spawn)
    with pytest.raises(RuntimeError):
        shared.launch.start_daemon(0, 0.0)
    assert made and not made[0].exists()


def test_bench_json_is_written_whole(monkeypatch, tmp_path):
    from infer.args import write_atomic

    out = tmp_path / "b.json"
    write_atomic(out, lambda tmp: tmp.write_text("{}"))
    assert out.read_text() == "{}"

    def broken(self, text):
        Path.write_bytes(self, b"{half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", broken)
    with pytest.raises(OSError):
        write_atomic(out, lambda tmp: tmp.write_text('{"x": 1}'))
    assert [p.name for p in tmp_path.iterdir()] == ["b.json"] and out.read_bytes() == b"{}"


def _trace_file(path, layers, experts, k, tokens, seed=1):
    """An `infer routing` trace ([[layer, [experts]], ...] in call order):
    a prompt forward, then one decode forward per token; returns each decode
    token's experts per layer."""
    rnd = np.random.default_rng(seed)
    rows = [[sorted(rnd.choice(experts, k, replace=False).tolist()) for _ in range(layers)]
            for _ in range(tokens)]
    calls = [[l, list(range(experts))] for l in range(layers)]  # the prompt: every expert
    calls += [[l, row[l]] for row in rows for l in range(layers)]
    path.write_text(json.dumps(calls))
    return rows


def test_forced_routing_routes_as_the_trace(prep_model, tmp_path):
    """Every MoE block of the resident model routes each decode token to the
    trace's experts of that layer, in order, cycling through the trace."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from infer.runtime.taps import expert_paths, install
    from infer.tools.forced_routing import ForcedRouting
    from infer.tools.resident import load_resident
    from infer.tools.trace import read

    prep = prep_model("qwen3_moe")
    manifest = Manifest.load(prep)
    layers, experts = len(manifest.layers), manifest.layers[0].num_experts
    rows = _trace_file(tmp_path / "t.json", layers, experts, 2, tokens=3)
    model, _ = load_resident(prep)
    routing = ForcedRouting(read(tmp_path / "t.json"))
    paths = expert_paths(model)
    taps = install(model)  # records the ids each expert module is given
    assert routing.install(model, paths) == layers
    cache = make_prompt_cache(model)
    for t in range(5):  # past the trace's end: it cycles
        mx.eval(model(mx.array([[7 + t]]), cache=cache))
    for l, tap in enumerate(taps):
        seen = [sorted(np.array(ids).ravel().tolist()) for ids in tap.ids]
        assert seen == [rows[t % 3][l] for t in range(5)], l


def test_bench_replays_a_routing_trace_in_every_mode(prep_model, tmp_path):
    prep = prep_model("qwen3_moe")
    manifest = Manifest.load(prep)
    _trace_file(tmp_path / "t.json", len(manifest.layers), manifest.layers[0].num_experts, 2, tokens=6)
    report = short_bench(prep, tmp_path, "resident,sync,iod", "--routing-trace", str(tmp_path / "t.json"))
    assert report["tokens_equal"] is True
    assert report["routing_replayed"]["tokens"] == 6 and report["routing_replayed"]["top_k"] == 2
    # seven decode tokens of two experts a layer: no more misses than the trace routes
    assert 0 < report["modes"]["sync"]["decode_misses"] <= len(manifest.layers) * 2 * 7
    # the table fits a terminal and ends with the ratios
    from infer.tools.bench import table

    text = table(report)
    assert max(len(line) for line in text.splitlines()) < 120
    tok = {m: report["modes"][m]["decode_tok_s"] for m in ("resident", "sync", "iod")}
    assert text.splitlines()[-1] == (f"decode speed: sync/resident {tok['sync'] / tok['resident']:.2f}, "
                                     f"iod/resident {tok['iod'] / tok['resident']:.2f}, "
                                     f"iod/sync {tok['iod'] / tok['sync']:.2f}")


def test_bench_refuses_a_trace_of_another_shape(prep_model, tmp_path, capsys):
    from infer.tools.bench import main

    prep = prep_model("qwen3_moe")
    manifest = Manifest.load(prep)
    _trace_file(tmp_path / "t.json", len(manifest.layers) + 1, manifest.layers[0].num_experts, 2, tokens=2)
    assert main(["--model", str(prep), "--routing-trace", str(tmp_path / "t.json")]) == 2
    assert "the trace routes" in capsys.readouterr().err
