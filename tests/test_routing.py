"""`infer routing`: the statistics' definitions, the report of a model and its prep folder, refusals."""

import json

import mlx_lm
import numpy as np
import pytest

from infer import routing
from infer.routing import Counts, hit_rates, main as routing_main, reuse


def test_reuse_and_hit_rates():
    ids = np.array([[0, 1], [1, 2], [2, 3], [0, 1]])
    assert reuse(ids) == pytest.approx((1 / 2 + 1 / 2 + 0) / 3)
    lru, opt = hit_rates(ids, 16, fractions=(0.25, 0.125))
    # 4 slots: only cold misses; 2 slots: the LRU keeps the last token's pair
    assert lru[0.25] == 4 / 8 and lru[0.125] == 2 / 8
    assert opt[0.25] == 4 / 8 and opt[0.125] >= lru[0.125]


def test_belady_bounds_lru():
    rng = np.random.default_rng(0)
    ids = np.stack([rng.choice(32, 4, replace=False) for _ in range(300)])
    lru, opt = hit_rates(ids, 32)
    for f in lru:
        assert opt[f] >= lru[f]
    # a cache of every expert misses each one once
    full_lru, full_opt = hit_rates(ids, 32, fractions=(1.0,))
    assert full_lru[1.0] == full_opt[1.0] == 1 - len(np.unique(ids)) / ids.size


def test_counts():
    c = Counts()
    c.add(np.array([[1, 2, 3]]), np.array([[3, 4]]))
    assert c.scores() == {"recall": 0.5, "precision": 1 / 3}


def test_lookahead_is_the_next_routers_on_this_input(synth_model):
    """Depth-d guesses are layer L+d's router applied to layer L's MoE input,
    top-k: at depth 0 that is the routing itself (recall 1)."""
    model, tok = mlx_lm.load(str(synth_model("qwen3_moe")))
    saved = dict(routing.PREDICTORS)
    routing.PREDICTORS["same_layer"] = (routing.PREDICTORS["moe_input"][0], (0,))
    try:
        layers, counts = routing.route(model, tok.encode("def f(x):\n    return x + 1\n" * 8))
    finally:
        routing.PREDICTORS.clear()
        routing.PREDICTORS.update(saved)
    rep = routing.summarize(layers, counts)["summary"]
    assert rep["predictors"]["same_layer"]["0"] == {"recall": 1.0, "precision": 1.0}
    assert set(rep["lookahead_recall"]) == {"1", "2", "3"}
    assert set(rep["predictors"]["pre_attention"]) == {"0", "1", "2", "3"}


def test_report_of_model_and_prep_folder(synth_model, prep_model, tmp_path, capsys):
    src, dst = synth_model("mixtral"), prep_model("mixtral")
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    png = tmp_path / "hits.png"
    capsys.readouterr()
    assert routing_main(["--model", str(src), "--tokens", "300", "--json", str(a), "--plot", str(png)]) == 0
    out = capsys.readouterr().out.splitlines()
    # header, 4 layers, 2 summary lines, 3 predictors (no calibration: no linear, combined)
    assert len(out) == 1 + 4 + 2 + 3 and "recall@1..3" in out[0]
    rep = json.loads(a.read_text())
    s = rep["summary"]
    for key in ("lookahead_recall", "lookahead_precision"):
        assert set(s[key]) == {"1", "2", "3"}
    for key in ("lru_hit", "belady_hit"):
        assert set(s[key]) == {"0.125", "0.25", "0.5"}
        assert all(0 <= v <= 1 for v in s[key].values())
    assert s["tokens"] == 300 and 1 <= s["max_load_ratio"] <= 16 and 0 <= s["next_token_reuse"] <= 1
    assert len(rep["layers"]) == 4 and rep["layers"][0]["module"] == "model.layers.0.block_sparse_moe.switch_mlp"
    assert png.read_bytes()[:4] == b"\x89PNG"
    # a prep folder routes the same, its experts read from the blobs
    assert routing_main(["--model", str(dst), "--tokens", "300", "--json", str(b)]) == 0
    other = json.loads(b.read_text())
    assert other["summary"] == rep["summary"] and other["layers"] == rep["layers"]


def test_refusals(tmp_path, capsys):
    assert routing_main(["--model", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err.startswith("infer routing: ")
    assert routing_main([]) == 2
    (tmp_path / "config.json").write_text("{}")
    assert routing_main(["--model", str(tmp_path)]) == 2
    assert "cannot load" in capsys.readouterr().err
    assert routing_main(["--model", str(tmp_path), "--text", str(tmp_path / "missing.txt")]) == 2
    assert routing_main(["--model", str(tmp_path), "--calibrate", str(tmp_path / "missing.txt")]) == 2
    assert routing_main(["--model", str(tmp_path), "--calibration", str(tmp_path / "missing.npz")]) == 2


def test_synth_routing_report_is_gone():
    from infer.synth import main as synth_main

    with pytest.raises(SystemExit):
        synth_main(["--routing-report", "x"])
