"""`infer routing --trace`: recorded routing replayed through the session
cache (infer.tools.trace, infer.tools.replay), on small traces made here in
each format."""

import json
import random

import pytest

from infer.runtime.placement import Placement
from infer.tools import replay, trace
from infer.tools.belady import FreqDecayRank
from infer.tools.routing import main as routing_main


def route_csv(path, turns, experts=4, k=1, layers=1, expert_bytes=100):
    """A route_trace v1 file: ``turns`` is [(prompt, decode)], each a list of
    tokens, a token a list (one per layer) of its experts."""
    lines = ["# route_trace v1", f"# model=/x/m.gguf arch=x n_layer={layers} n_expert={experts} n_expert_used={k}"]
    lines += [f"# layer={l} expert_bytes={expert_bytes} dense_bytes=1" for l in range(layers)]
    lines.append("turn,phase,step,layer,slot,expert,weight,residency,expert_bytes")
    for turn, (prompt, decode) in enumerate(turns):
        step = 0
        for phase, tokens in ((0, prompt), (1, decode)):
            for tok in tokens:
                for layer, ids in enumerate(tok):
                    for slot, e in enumerate(ids):
                        lines.append(f"{turn},{phase},{step},{layer},{slot},{e},0.5,0,{expert_bytes}")
                step += 1
    path.write_text("\n".join(lines) + "\n")
    return path


def one_layer(path, prompt, decode, experts=4):
    """One layer, top 1: a token is its expert."""
    return route_csv(path, [([[[e]] for e in prompt], [[[e]] for e in decode])], experts=experts)


def misses(rep, budget):
    return {p: v[budget]["misses"] for p, v in rep.items()}


def test_each_policy_on_hand_checked_traces(tmp_path):
    # one layer of 4 experts, top 1; a quarter holds 1, a half 2
    a = trace.read(one_layer(tmp_path / "a.csv", [0], [1, 0, 1, 2, 1, 0]))
    assert (a.prefill_calls, a.decode_tokens, a.num_experts, a.top_k) == (1, 6, 4, 1)
    assert replay.capacities(a, "0.25") == {0: 1}
    # runtime: every call fits the one place, so every miss takes it: 6
    # misses, as LRU and LFU (1 place). Belady keeps 0 through 1's first
    # use, then 1 through 2's: 0 hits at step 2, 1 at step 5. oracle1 keeps
    # the expert its next call uses: 0 over 1 at step 1, 1 over 2 at step
    # 4, and at step 6, told nothing more, as the runtime: 4 misses.
    assert misses(replay.replay(a, ["0.25"]), "0.25") == \
        {"runtime": 6, "lru": 6, "lfu": 6, "belady": 4, "oracle1": 4}
    b = trace.read(one_layer(tmp_path / "b.csv", [0], [0, 0, 1, 2, 0, 1]))
    # two places. LRU: 2 evicts 0, 0 evicts 1, 1 misses: 4. LFU: 2 evicts 1
    # (used once, 0 three times), 1 evicts 2: 3. The runtime as LFU (2's
    # rank 0.217 over 1's 0.173, then 1's 0.933 over 2's): 3; oracle1 the
    # same (it keeps 0, which the next call uses, as the runtime does).
    # Belady: 2 is never used again, so it does not stay: 2 misses.
    rep = replay.replay(b, ["0.5"])
    assert misses(rep, "0.5") == {"runtime": 3, "lru": 4, "lfu": 3, "belady": 2, "oracle1": 3}
    assert rep["lfu"]["0.5"]["hit"] == 0.5 and rep["belady"]["0.5"]["hit"] == pytest.approx(4 / 6)


def _drive_placement(requests, num_experts, cap):
    """The session cache as ExpertStore.gather drives its stack."""
    p, out = Placement(num_experts, cap), []
    for req in requests:
        p.tick()
        wanted = sorted(req)
        missing = [e for e in wanted if e not in p]
        for e in wanted:
            if e in p:
                p.touch(e)
        if missing:
            p.assign(missing, set(wanted))
        out.append(len(missing))
    return out


def _random_turns(rng, layers, experts, k, turns=2):
    def tok():
        return [rng.sample(range(experts), k) if rng.random() < 0.6 else list(range(l, l + k))
                for l in range(layers)]
    return [([tok() for _ in range(rng.randint(1, 12))], [tok() for _ in range(rng.randint(20, 60))])
            for _ in range(turns)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_belady_bounds_every_policy_and_runtime_is_the_placement(tmp_path, seed):
    rng = random.Random(seed)
    t = trace.read(route_csv(tmp_path / "r.csv", _random_turns(rng, 3, 16, 3), experts=16, k=3, layers=3))
    # the second turn's prompt comes between decode steps: it is read, not counted
    assert t.prefill_calls == 2
    budgets = ["0.0625", "0.2", "0.5", "1"]
    names = replay.policy_names()
    rep = replay.report(t, budgets, policies=names)["policies"]
    for b in budgets:
        cap = replay.capacities(t, b)
        best = rep["belady"][b]["misses"]
        assert all(best <= rep[p][b]["misses"] for p in names), (b, misses(rep, b))
        # the runtime's figure is the Placement driven directly, decode calls only
        direct = 0
        for layer, reqs, counted in replay.layer_requests(t):
            per = _drive_placement(reqs, 16, cap[layer])
            direct += sum(m for m, c in zip(per, counted) if c)
        assert rep["runtime"][b]["misses"] == direct
        # the simulator's copy of the rule (oracle1's base) misses the same
        simulated = replay.count_misses(t, replay._online(FreqDecayRank), cap)[0]
        assert simulated == direct == rep["decay16+fit"][b]["misses"]
    # a whole layer's worth: every policy misses only first uses
    first = rep["belady"]["1"]["misses"]
    assert all(rep[p]["1"]["misses"] == first for p in ("runtime", "lru", "lfu", "oracle1"))


def test_oracle1_is_the_rule_told_the_next_call():
    from infer.tools.belady import ToldNext

    reqs = [frozenset(r) for r in ({0}, {1}, {0}, {1}, {2}, {1}, {0})]
    told = ToldNext(1)
    assert [told.request(r) for r in reqs] == _drive_placement(reqs, 4, 1)  # told nothing: the rule
    told, seen = ToldNext(1), []
    for i, r in enumerate(reqs):
        told.soon = reqs[i + 1] if i + 1 < len(reqs) else frozenset()
        seen.append(told.request(r))
    assert seen == [1, 1, 0, 1, 1, 0, 1]  # keeps 0 over 1 for the call after, 1 over 2


def test_predictors_on_hand_checked_traces(tmp_path):
    t = trace.read(one_layer(tmp_path / "a.csv", [0], [1, 0, 1, 2, 1, 0]))
    p = replay.score_predictors(t)
    # the previous token's expert is never this one's; the two most recent
    # are right at steps 2, 3 and 5, guessing 1 expert at step 1, 2 after
    assert p["previous"]["k"] == {"breadth": 1, "recall": 0.0, "precision": 0.0}
    assert p["previous"]["2k"] == {"breadth": 2, "recall": 0.5, "precision": 3 / 11}
    # decayed counts: right only at step 5 (1: 1.836 against 0: 1.758)
    assert p["decayed"]["k"]["recall"] == pytest.approx(1 / 6)
    # what followed the previous token's expert before: right at 3, 5 (by
    # decayed count: nothing followed 2 yet) and 6 (0 and 2 followed 1 once each; 0 is used more)
    assert p["cooc_time"]["k"]["recall"] == 0.5
    # one layer: the previous MoE call is the same layer's previous token
    assert p["cooc_layer"]["k"] == p["cooc_time"]["k"]

    # layer 1 routes to layer 0's expert + 2: learned once seen
    tokens = [[[l0], [l0 + 2]] for l0 in (0, 1, 0, 1, 0)]
    t = trace.read(route_csv(tmp_path / "b.csv", [(tokens[:1], tokens[1:])], layers=2))
    p = replay.score_predictors(t)
    # layer 1: wrong at the first 1 (never seen), right after; layer 0 (from
    # layer 1's expert of the token before): wrong twice, then right
    assert p["cooc_layer"]["k"]["recall"] == 5 / 8
    assert p["previous"]["k"]["recall"] == 0.0


def test_mixtral_jsonl_both_kinds(tmp_path):
    rec = lambda **kw: json.dumps({"dataset": "he", **kw, "gating_probs": [0.6, 0.4]})
    # decode only, each problem a session; layer 1 lacks its last token
    lines = [rec(problem_id=p, layer=l, token_idx=i, experts=[(i + l + p) % 8, 7])
             for p in (0, 1) for l in (0, 1) for i in range(5 if l == 0 else 4)]
    path = tmp_path / "x_routing.jsonl"
    path.write_text("\n".join(lines) + "\n")
    t = trace.read(path)
    assert (t.format, len(t.sessions), t.decode_tokens, t.prefill_calls) == ("mixtral jsonl", 2, 10, 0)
    assert (t.layers, t.num_experts, t.top_k) == ([0, 1], 8, 2)
    assert t.sessions[0][0].wanted == {0: frozenset({0, 7}), 1: frozenset({1, 7})}
    assert t.sessions[0][4].wanted == {0: frozenset({4, 7})}
    # execution order: a 3-position prefill, then two decode steps, the
    # second without layer 0
    raw = [rec(problem_id=0, layer=l, token_pos=p, experts=[p + l, 7]) for l in (0, 1) for p in range(3)]
    raw += [rec(problem_id=0, layer=l, token_pos=0, experts=[6, l]) for l in (0, 1)]
    raw += [rec(problem_id=0, layer=1, token_pos=0, experts=[6, 1])]
    path = tmp_path / "routing_raw.jsonl"
    path.write_text("\n".join(raw) + "\n")
    t = trace.read(path)
    assert (t.prefill_calls, t.prefill_tokens, t.decode_tokens) == (1, 3, 2)
    calls = t.sessions[0]
    assert calls[0].wanted == {0: frozenset({0, 1, 2, 7}), 1: frozenset({1, 2, 3, 7})}
    assert calls[0].tokens[2] == {0: (2, 7), 1: (3, 7)}
    assert t.num_experts == 8  # the highest id seen, where the file does not say
    assert calls[2].wanted == {1: frozenset({6, 1})}
    # a quarter of 8 experts, 2 a layer. LRU: the prompt leaves each layer
    # its first two by id ({0, 1}, {1, 2}); each misses 6 at the first
    # decode step, and layer 1 hits both at the second
    rep = replay.replay(t, ["0.25"])
    assert rep["lru"]["0.25"]["misses"] == 2


def test_the_projects_own_trace(tmp_path):
    # routing_trace(): one (layer, experts) per call; the first forward is
    # the prompt, a later one wider than the usual call another prompt
    calls = [[0, [0, 1, 2, 3]], [1, [4, 5, 6]],
             [0, [0, 1]], [1, [4, 5]],
             [0, [0, 2]], [1, [5, 6]],
             [0, [0, 1, 2]], [1, [1, 2]],
             [0, [1, 2]], [1, [4, 6]]]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(calls))
    t = trace.read(path)
    assert (t.format, t.top_k, t.prefill_calls, t.decode_tokens) == ("routing_trace json", 2, 2, 3)
    assert [c.decode for c in t.sessions[0]] == [False, True, True, False, True]
    assert t.sessions[0][1].tokens == [{0: (0, 1), 1: (4, 5)}]
    # bench_policies.py's file: named traces (with their guesses), a session each
    path.write_text(json.dumps({"s0": [c + [[]] for c in calls], "s1": calls[:4]}))
    t = trace.read(path)
    assert len(t.sessions) == 2 and t.decode_tokens == 4


def test_the_replay_of_a_sessions_own_trace_misses_what_it_missed(prep_model, tmp_path, capsys):
    """A live session's routing_trace, written as JSON and replayed with its
    stacks' capacities, misses what the session's cache missed; with
    --model the record size is the manifest's."""
    from infer.runtime.loader import load_streaming
    from infer.tools.bench import decode, forced_ids
    from iod.inproc import InprocSource
    from shared.blob import Manifest

    prep = prep_model("qwen3_moe")
    source = InprocSource(prep, arena=64 << 20)
    model, tok, store = load_streaming(prep, source, None)
    store.cache_bytes = int(source.manifest.expert_bytes * 0.25)
    store.prefetcher.depth = 0
    store.trace = []
    decode(model, tok.encode("Hello there, lighthouse"), forced_ids(tok, 16), 16, store)
    source.close()
    path = tmp_path / "t.json"
    path.write_text(json.dumps(store.routing_trace()))
    t = trace.read(path)
    # the prompt's last token is a one-token pass (as mlx-lm's), then 15 decode steps
    assert t.prefill_calls == 1 and t.decode_tokens == 16
    cap = {l: s.capacity for l, s in store.stacks.items()}
    assert replay.count_misses(t, replay.DRIVERS["runtime"], cap)[1] == store.stats["misses"]

    out = tmp_path / "r.json"
    assert routing_main(["--trace", str(path), "--model", str(prep), "--budgets", "0.25", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    layers = Manifest.load(prep).layers
    # the stacks the store had at a quarter, from the manifest's layouts
    replay.check_model(t, Manifest.load(prep))
    assert replay.capacities(t, "0.25") == cap
    assert rep["budgets"]["0.25"]["experts_per_layer"] == sorted(set(cap.values()))
    assert rep["record"]["mb"] == pytest.approx(sum(l.record_bytes for l in layers) / len(layers) / 1e6)
    assert rep["record"]["source"].startswith("manifest of ")
    assert rep["trace"]["num_experts"] == layers[0].num_experts
    capsys.readouterr()


def test_cli_json_table_and_plot(tmp_path, capsys):
    src = one_layer(tmp_path / "a.csv", [0], [1, 0, 1, 2, 1, 0])
    js, png = tmp_path / "r.json", tmp_path / "r.png"
    assert routing_main(["--trace", str(src), "--budgets", ".25,0.5", "--record-mb", "2.5",
                         "--json", str(js), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    rep = json.loads(js.read_text())
    assert list(rep["policies"]) == ["runtime", "lru", "lfu", "belady", "oracle1"]
    for p in rep["policies"].values():
        assert list(p) == [".25", "0.5"]
        assert all(set(v) == {"hit", "mb_per_token", "misses"} for v in p.values())
    assert rep["policies"]["runtime"][".25"] == {"hit": 0.0, "misses": 6, "mb_per_token": 2.5}
    assert rep["policies"]["belady"][".25"] == {"hit": pytest.approx(2 / 6), "misses": 4,
                                                 "mb_per_token": pytest.approx(4 * 2.5 / 6)}
    assert rep["record"] == {"mb": 2.5, "source": "--record-mb"}
    assert rep["budgets"] == {".25": {"experts_per_layer": [1]}, "0.5": {"experts_per_layer": [2]}}
    assert rep["trace"]["decode_tokens"] == 6 and rep["trace"]["format"] == "route_trace v1"
    assert set(rep["predictors"]) == {"previous", "decayed", "cooc_time", "cooc_layer"}
    assert rep["predictors"]["previous"]["2k"]["breadth"] == 2
    # the table shows the JSON's figures
    row = next(l for l in out.splitlines() if l.split()[:1] == [".25"])
    assert row.split()[2:4] == ["0.000", "2.50"]
    assert png.read_bytes()[:4] == b"\x89PNG"
    # the trace's own expert size where nothing else says (100 bytes here)
    assert routing_main(["--trace", str(src), "--json", str(js)]) == 0
    rep = json.loads(js.read_text())
    assert rep["record"]["mb"] == pytest.approx(1e-4) and "trace" in rep["record"]["source"]
    assert list(rep["budgets"]) == ["0.1", "0.25", "0.4"]
    # a known shape: 32 layers of 8 experts is Mixtral-8x7B at 4 bits
    path = tmp_path / "m_routing.jsonl"
    path.write_text("\n".join(json.dumps({"layer": l, "token_idx": i, "experts": [(i + l) % 8, (i + l + 1) % 8]})
                              for l in range(32) for i in range(4)) + "\n")
    assert routing_main(["--trace", str(path), "--budgets", "0.25", "--json", str(js)]) == 0
    rep = json.loads(js.read_text())
    assert rep["record"]["mb"] == 3 * 4096 * 14336 * 9 // 16 / 1e6
    assert rep["record"]["source"].startswith("Mixtral-8x7B")
    capsys.readouterr()


def _one_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("infer routing: "), err
    return err[0]


def test_bad_input_is_one_line_exit_2(tmp_path, capsys):
    good = one_layer(tmp_path / "a.csv", [0], [1, 0])
    cases = {
        "unknown trace format": "this is not a trace\n",
        "is empty": "",
        "only route_trace v1": "# route_trace v2\nturn,phase,step,layer,slot,expert\n",
        "no decode steps": "# route_trace v1\nturn,phase,step,layer,slot,expert\n0,0,0,0,0,1\n",
        "is not an integer": "# route_trace v1\nturn,phase,step,layer,slot,expert\n0,1,0,0,0,x\n",
        "out of range": "# route_trace v1\n# n_expert=4\nturn,phase,step,layer,slot,expert\n0,1,0,0,0,4\n",
        "neither token_idx nor token_pos": '{"layer": 0, "experts": [1, 2]}\n',
        "has no calls": "[]",
        "not [layer, [experts]]": "[[0, 1]]",
        "unknown trace format ": b"\xff\xfe\x00".decode("latin-1"),
    }
    for i, (msg, text) in enumerate(cases.items()):
        path = tmp_path / f"bad{i}"
        path.write_bytes(text.encode("latin-1"))
        assert routing_main(["--trace", str(path)]) == 2, msg
        assert msg.strip() in _one_line(capsys)
    for budgets, msg in (("0,0.5", "not in (0, 1]"), ("1.5", "not in (0, 1]"), ("-0.1", "not in (0, 1]"),
                         ("x", "is not a number"), ("", "is not a number")):
        assert routing_main(["--trace", str(good), "--budgets", budgets]) == 2
        assert msg in _one_line(capsys)
    for args, msg in ((["--trace", str(tmp_path / "none")], "is not a file"),
                      (["--trace", str(good), "--text", str(good)], "not with --trace"),
                      (["--trace", str(good), "--policies", "nope"], "is none of"),
                      (["--trace", str(good), "--record-mb", "0"], "positive"),
                      (["--trace", str(good), "--model", str(tmp_path)], "not a prep folder"),
                      (["--model", str(tmp_path), "--budgets", "0.5"], "goes with --trace"),
                      ([], "is required")):
        assert routing_main(args) == 2
        assert msg in _one_line(capsys)


def test_admission_variants_of_the_rule():
    """decay16+order drops the rule's admission test, decay16+fit keeps it
    for calls wider than the stack only."""
    from infer.tools.belady import POLICIES

    def run(name, reqs):
        p = POLICIES[name](1)
        return sum(p.request(frozenset(r)) for r in reqs)

    # 1 (rank 0.13) is not placed over 0 (0.758, used twice) until its second use
    narrow = [{0}, {0}, {1}, {1}]
    assert (run("decay16+rank", narrow), run("decay16+order", narrow), run("decay16+fit", narrow)) == (3, 2, 2)
    # a call of two experts on a stack of one: fit keeps 0 against both, order lets 1 in
    wide = [{0}, {0}, {1, 2}, {0}]
    assert (run("decay16+rank", wide), run("decay16+order", wide), run("decay16+fit", wide)) == (3, 4, 3)
