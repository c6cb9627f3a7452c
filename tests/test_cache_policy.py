"""Cache policies (infer.tools.belady) on scripted traces whose answer is known,
the live LayerStack against its simulation on trained routing, exact greedy
ids with the policy, and the cold-start usage file (infer.runtime.coldstart)."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from infer.prep.calibrate import count_usage
from infer.runtime import coldstart
from infer.tools.belady import belady_global, belady_misses, simulate, simulate_global

ARCHS = ["qwen3_moe", "qwen3_next"]


def heldout_ids(folder, tok):
    return tok.encode((folder / "heldout.txt").read_text(), add_special_tokens=False)


def test_rank_keeps_the_used_experts_out_of_reach_of_one_offs():
    """Expert 9 is used three times; a call of two one-off experts then
    finds one free position: decay16 gives it to 0 and evicts 9 for 1, the
    ranked rule lets neither one-off replace 9 (Belady does the same)."""
    trace = [(0, [9])] * 3 + [(0, [0, 1])] + [(0, [9])] * 2
    assert simulate(trace, 2, "decay16+rank") == 3 == belady_misses(trace, 2)
    assert simulate(trace, 2, "decay16") == 4
    # the old rule on a scan: LRU loses what it had, the ranked rule does not
    trace = [(0, [2, 3])] * 3 + [(0, [0, 1]), (0, [2, 3])]
    assert simulate(trace, 2, "lru") == 6 and simulate(trace, 2, "decay16+rank") == 4


def test_frequency_keeps_the_expert_used_three_times_lru_does_not():
    trace = [(0, [0])] * 3 + [(0, [1]), (0, [2]), (0, [0])]
    assert simulate(trace, 2, "lru") == 4  # 2 evicts 0, the least recent
    assert simulate(trace, 2, "lfu") == 3 == simulate(trace, 2, "decay16") == belady_misses(trace, 2)


def test_arc_keeps_experts_seen_twice_through_a_scan():
    trace = [(0, [e]) for e in [0, 1, 0, 1, 2, 3, 4, 0, 1]]
    assert simulate(trace, 2, "lru") == 7
    assert simulate(trace, 2, "arc") == 6  # 1 survives the scan 2, 3, 4
    assert belady_misses(trace, 2) == 5


def test_least_stale_ages_experts_in_tokens_not_calls():
    """Three layers with one fixed expert each in a pool of three; layer 2
    uses a one-off expert once. Call-time LRU then evicts each layer's
    expert just before its layer comes round (a cascade); token time evicts
    the one-off as soon as its layer has gone by without it."""
    trace = [(l, [0] + ([9] if (l, tok) == (2, 2) else [])) for tok in range(6) for l in range(3)]
    assert belady_global(trace, 3) == 4
    assert simulate_global(trace, 3, "lru", 3) == 7
    assert simulate_global(trace, 3, "least-stale", 3) == 6
    assert simulate_global(trace, 3, "decay16-token", 3) == 5


def test_prediction_aware_protects_what_the_next_layer_is_predicted_to_use():
    """Layer 1's expert 0 went unused for a token (stale), but layer 0's call
    predicts it for layer 1: least-stale evicts it and misses it at once,
    the prediction-aware pool evicts the fresher (1, 5) instead."""
    trace = [(0, [0]), (1, [0]), (0, [0]), (1, [5]),
             (0, [0, 1], [[1, 1, [0]]]), (1, [0])]
    assert simulate_global(trace, 3, "least-stale", 2) == 5
    assert simulate_global(trace, 3, "predict", 2) == 4 == belady_global(trace, 3)


def _decode(model, ids, n):
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([ids[:16]]), cache=cache))
    for t in ids[16:16 + n]:
        mx.eval(model(mx.array([[t]]), cache=cache))


@pytest.mark.parametrize("arch", ARCHS)
def test_live_stack_misses_what_its_simulation_misses(arch, trained_model, trained_prep):
    """On trained routing (prefill then teacher-forced decode), at budgets
    below a call's top-k (the ranked bypass) and above it, the store's
    misses are the simulated decay16+fit's, and never below Belady's."""
    from infer.runtime.loader import load_streaming
    from iod.inproc import InprocSource

    prep = trained_prep(arch)
    source = InprocSource(prep)
    try:
        model, tok, store = load_streaming(prep, source, 0, dtype=mx.float32, preload=False)
        ids = heldout_ids(trained_model(arch), tok)[200:]
        store.prefetcher.depth = 0
        for fraction in (0.05, 0.10, 0.25):
            store.stacks = {}
            store.stats["misses"] = 0
            store.cache_bytes = int(source.manifest.expert_bytes * fraction)
            store.trace = []
            _decode(model, ids, 48)
            cap = {l: s.capacity for l, s in store.stacks.items()}
            assert store.stats["misses"] == simulate(store.trace, cap, "decay16+fit"), fraction
            assert belady_misses(store.trace, cap) <= store.stats["misses"]
    finally:
        source.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_ids_equal_mlx_lm_with_the_ranked_policy(arch, trained_model, trained_prep):
    """10% of the expert bytes (fewer positions than a call's top-k: calls
    run partly from temporary stacks) with a calibrated cold start."""
    import mlx_lm

    from infer.runtime.loader import load_streaming
    from iod.inproc import InprocSource

    ref_model, tok = mlx_lm.load(str(trained_model(arch)))
    ids = heldout_ids(trained_model(arch), tok)[:40]
    ref = [t for t, _ in generate_step(mx.array(ids), ref_model, max_tokens=24)]
    prep = trained_prep(arch)
    source = InprocSource(prep)
    try:
        model, _, store = load_streaming(prep, source, int(source.manifest.expert_bytes * 0.1))
        out = [t for t, _ in generate_step(mx.array(ids), model, max_tokens=24)]
        assert out == ref
        assert store.stats["misses"] > 0
    finally:
        source.close()


def test_usage_file_round_trip_and_preload_order(tmp_path, trained_model, trained_prep):
    """calibrate() writes usage.json; it reads back as the counts; a store
    loaded from the folder starts with each layer's most used experts."""
    import shutil

    from infer.runtime.loader import load_streaming
    from iod.inproc import InprocSource

    prep = tmp_path / "prep"
    shutil.copytree(trained_prep("qwen3_moe"), prep)
    (prep / coldstart.USAGE_NAME).unlink(missing_ok=True)
    assert coldstart.read_usage(prep) is None
    text = (trained_model("qwen3_moe") / "heldout.txt").read_text()
    counts = count_usage(prep, text, max_tokens=64)
    assert coldstart.read_usage(prep) == counts
    assert all(sum(c.values()) == 64 * 8 for c in counts.values())  # top-8 per token
    order = coldstart.usage_order(counts)
    source = InprocSource(prep)
    try:
        _, _, store = load_streaming(prep, source, int(source.manifest.expert_bytes * 0.25))
        for layer, stack in store.stacks.items():
            assert set(stack.position) == set(order[layer][: stack.capacity])
        assert store.stats["fetched_bytes"] > 0 and store.stats["misses"] == 0
    finally:
        source.close()


def test_policy_table_sums_traces_per_budget():
    """scripts/bench/bench_policies.py: each budget's row is Belady and each policy
    summed over the traces, at the session cache's per-layer capacity."""
    import importlib.util
    from pathlib import Path
    from types import SimpleNamespace

    path = Path(__file__).parents[1] / "scripts" / "bench" / "bench_policies.py"
    spec = importlib.util.spec_from_file_location("bench_policies", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    layers = [SimpleNamespace(record_bytes=100)] * 2
    manifest = SimpleNamespace(layers=layers, expert_bytes=2 * 20 * 100)  # 20 experts a layer
    trace = [(l, [e % 7, (e + 1) % 7]) for e in range(30) for l in (0, 1)]
    rows = bench.table({"a": trace, "b": trace}, manifest, ["lru", "decay16+rank"], ["least-stale"])
    row = rows["25%"]
    assert row["capacity_per_layer"] == 5
    assert row["belady"] == 2 * belady_misses(trace, 5)
    assert row["lru"] == 2 * simulate(trace, 5, "lru")
    assert row["global least-stale"] == 2 * simulate_global(trace, 10, "least-stale", 2)
    assert row["belady_global"] == 2 * belady_global(trace, 10) <= row["belady"]
    assert "| 25% | 5 |" in bench.markdown(rows, ["lru"])


def test_policy_traces_record_each_call_and_the_next_layers_guesses(trained_prep):
    """scripts/bench/bench_policies.py records, per call, the routed experts and the
    guesses made there for the next layers (as the replayed policies see them)."""
    import importlib.util
    from pathlib import Path

    from shared.blob import Manifest

    path = Path(__file__).parents[1] / "scripts" / "bench" / "bench_policies.py"
    spec = importlib.util.spec_from_file_location("bench_policies", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    prep = trained_prep("qwen3_moe")
    layers = [l.layer for l in Manifest.load(prep).layers]
    traces = bench.record(prep, 8, stretches=1)
    assert set(traces) == {"s0-forced", "s0-free"}
    for trace in traces.values():
        # a prefill call, the prompt's last token (a one-token pass, as in
        # mlx-lm) and 7 decode calls per layer, in layer order
        assert [l for l, _, _ in trace] == layers * 9
        for n, (layer, experts, guesses) in enumerate(trace):
            assert len(experts) == (8 if n >= len(layers) else len(experts)) and experts
            assert all(0 <= e < 64 for e in experts)
            nxt = [l for l in layers if l > layer][:2]
            assert [(g[0], g[1]) for g in guesses] == [(l, d) for d, l in enumerate(nxt, 1)]


def test_split_cache_makes_whole_layers_only_where_they_pay():
    """Evenly without counts; with counts skewed toward a few experts, a
    budget near the model's size makes whole layers (they run as the
    resident model does) and a small one stays even; never over budget."""
    from collections import Counter
    from types import SimpleNamespace

    from infer.runtime.budget import split_cache

    layouts = [SimpleNamespace(layer=l, num_experts=64, record_bytes=1000) for l in range(4)]
    every = 4 * 64 * 1000
    assert set(split_cache(layouts, every // 2).values()) == {32}
    skewed = {l: Counter({e: 1000 // (e + 1) for e in range(64)}) for l in range(4)}
    for fraction in (0.1, 0.25, 0.5, 0.75, 0.9):
        caps = split_cache(layouts, int(every * fraction), skewed)
        assert sum(caps.values()) * 1000 <= every * fraction
    high = split_cache(layouts, int(every * 0.9), skewed)
    assert 0 < sum(c == 64 for c in high.values()) < 4
    assert set(split_cache(layouts, int(every * 0.1), skewed).values()) == {6}
    # counts missing for a layer: even
    assert set(split_cache(layouts, int(every * 0.9), {0: skewed[0]}).values()) == {57}


def _calibrated_prep(tmp_path, arch, trained_model, trained_prep, tokens):
    """A copy of the trained prep folder with a usage.json from its held-out text."""
    import shutil

    prep = tmp_path / "prep"
    shutil.copytree(trained_prep(arch), prep)
    count_usage(prep, (trained_model(arch) / "heldout.txt").read_text(), max_tokens=tokens)
    return prep


@pytest.mark.parametrize("arch", ARCHS)
def test_whole_layers_from_the_preload_equal_mlx_lm(arch, tmp_path, trained_model, trained_prep):
    """With a usage.json and 90% of the expert bytes, some stacks are whole
    from the cold-start preload, before their layer's first call: those
    layers run the resident call (bound to the stack) and the others stream;
    greedy ids equal mlx-lm's. A whole layer is never gathered nor guessed
    for, and a routing trace still records its calls: the same trace as a
    run that streams every layer."""
    import mlx_lm

    from infer.runtime.loader import load_streaming
    from iod.inproc import InprocSource

    ref_model, tok = mlx_lm.load(str(trained_model(arch)))
    ids = heldout_ids(trained_model(arch), tok)[:40]
    ref = [t for t, _ in generate_step(mx.array(ids), ref_model, max_tokens=16)]
    prep = _calibrated_prep(tmp_path, arch, trained_model, trained_prep, 64)
    source = InprocSource(prep)
    try:
        cached = [l for l in source.manifest.layers if l.layer in set(coldstart.read_usage(prep))]
        budget = int(sum(l.num_experts * l.record_bytes for l in cached) * 0.9)
        traces = []
        for cache in (budget, 0):
            model, _, store = load_streaming(prep, source, cache)
            whole = {l for l, s in store.stacks.items() if s.complete}
            assert (0 < len(whole) < len(cached)) == (cache > 0)
            gathered, gather = set(), store.gather
            store.gather = lambda layer, *a, **k: gathered.add(layer) or gather(layer, *a, **k)
            store.trace = []
            out = [t for t, _ in generate_step(mx.array(ids), model, max_tokens=16)]
            assert out == ref
            assert store.stats["misses"] > 0
            assert not gathered & whole and not set(store.prefetcher._predicted) & whole
            traces.append(store.routing_trace())
        assert traces[0] == traces[1] and {l for l, _ in traces[0]} == {l.layer for l in cached}
    finally:
        source.close()


def test_no_guesses_for_whole_layers(tmp_path, trained_model, trained_prep):
    """The next layers' guesses skip a whole layer: nothing of it is read,
    and a whole layer's call (the resident one) scores no guess."""
    from infer.runtime.loader import load_streaming
    from iod.inproc import InprocSource

    prep = _calibrated_prep(tmp_path, "qwen3_moe", trained_model, trained_prep, 32)
    source = InprocSource(prep)
    try:
        model, _, store = load_streaming(prep, source, source.manifest.expert_bytes)
        layers = sorted(store.stacks)
        assert len(layers) >= 3 and all(store.stacks[l].complete for l in layers)
        for l in (layers[0], layers[2]):  # one expert out: no longer whole
            stack = store.stacks[l]
            stack.position.pop(next(iter(stack.position)))
            assert not stack.complete
        x = mx.random.normal((1, 1, model.args.hidden_size))
        guessed = [g[0] for g in store.prefetcher.predict(layers[0], x)]
        assert guessed == [layers[2]]
    finally:
        source.close()


def _router_score_script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "scripts" / "bench" / "bench_router_score.py"
    spec = importlib.util.spec_from_file_location("bench_router_score", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_router_probabilities_in_the_score_keep_what_the_router_nearly_chose():
    """scripts/bench/bench_router_score.py's RouterScore: an expert the router gave
    high probability but did not route to outranks one routed once, later;
    its Foresight oracle keeps what the next call uses."""
    import numpy as np

    bench = _router_score_script()
    probs = [np.array(p) for p in ([1, 0, 0], [0.5, 0.5, 0], [0, 0, 1], [1, 0, 0])]
    reqs = [{0}, {1}, {2}, {0}]
    misses = {}
    for beta in (0, 8):
        policy = bench.RouterScore(2, 16.0, beta)
        misses[beta] = []
        for req, p in zip(reqs, probs):
            policy.probs = p
            misses[beta].append(policy.request(req))
    assert misses[0] == [1, 1, 1, 1]  # expert 0, the oldest, made room for 2
    assert misses[8] == [1, 1, 1, 0]  # expert 1 did: 0 had the router's weight

    told = bench.Foresight(2, 16.0)
    seen = []
    for t, req in enumerate(reqs):
        told.soon = dict.fromkeys(reqs[t + 1], 1.0) if t + 1 < len(reqs) else {}
        seen.append(told.request(req))
    assert seen == [1, 1, 1, 0]  # told the next call wants 0, it keeps 0


def test_router_score_replay_at_beta_zero_is_the_kept_policy(trained_prep):
    """The script records each MoE layer's router logits over stretches of
    heldout.txt, and its replay at beta 0 misses what the session cache's
    kept rule misses on the same calls (infer.tools.belady's simulation)."""
    import numpy as np

    from shared.blob import Manifest

    bench = _router_score_script()
    prep = trained_prep("qwen3_next")
    layers = [l.layer for l in Manifest.load(prep).layers if not l.module.startswith("mtp.")]
    logits = bench.record(prep, 2, 48)
    assert set(logits) == {f"s{s}_l{l}" for s in range(2) for l in layers}
    experts = next(iter(logits.values())).shape[-1]
    assert all(v.shape == (48, experts) for v in logits.values())
    assert not np.array_equal(logits["s0_l0"], logits["s1_l0"])  # two different stretches
    rows = bench.table(logits, 8, variants=[(16, 0), (16, 4)], fractions=(0.25,))
    row = rows[0.25]
    kept = belady = 0
    for key in logits:
        trace = [(0, sorted(r)) for r, _ in bench.calls(logits[key], 8)]
        assert len(trace) == 1 + 48 - bench.PROMPT_TOKENS
        kept += simulate(trace, row["capacity"], "decay16+fit")
        belady += belady_misses(trace, row["capacity"])
    assert row[(16, 0)] == kept == bench.foresight(logits, 8, row["capacity"], 0)
    assert row["belady"] == belady <= min(row[(16, 0)], row[(16, 4)])
