"""`infer routing`: the statistics' definitions, the report of a model and its prep folder, refusals."""

import json

import mlx_lm
import numpy as np
import pytest

from infer.tools import routing
from infer.tools.routing import Counts, hit_rates, main as routing_main, reuse


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
    from infer.synth.synth import main as synth_main

    with pytest.raises(SystemExit):
        synth_main(["--routing-report", "x"])


def _one_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("infer routing: "), err
    return err[0]


def test_refuses_output_paths_before_routing(synth_model, tmp_path, capsys, monkeypatch):
    """--json / --plot that cannot be written are refused up front: nothing routed, nothing written."""
    src = str(synth_model("mixtral"))
    monkeypatch.setattr(routing, "report", lambda *a, **kw: pytest.fail("routed"))
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("x")
    before = sorted(tmp_path.rglob("*"))
    for flag, path, msg in [("--json", tmp_path / "none" / "x.json", "is not a folder"),
                            ("--json", tmp_path / "dir", "is a folder"),
                            ("--json", tmp_path / "file" / "x.json", "is not a folder"),
                            ("--plot", "/proc/nope.png", "cannot write there"),
                            ("--plot", tmp_path / "hits.xyz", "cannot write .xyz")]:
        assert routing_main(["--model", src, "--tokens", "50", flag, str(path)]) == 2
        assert msg in _one_line(capsys)
    assert sorted(tmp_path.rglob("*")) == before


def test_writes_outputs_whole(synth_model, tmp_path, capsys, monkeypatch):
    """A write that fails leaves neither the file nor its temporary."""
    src = str(synth_model("mixtral"))

    def broken(rep, path, format=None):
        path.write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(routing, "plot", broken)
    png, js = tmp_path / "hits.png", tmp_path / "r.json"
    assert routing_main(["--model", src, "--tokens", "50", "--json", str(js), "--plot", str(png)]) == 1
    assert "No space left" in _one_line(capsys)
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # written whole before the plot failed
    json.loads(js.read_text())


def test_refuses_a_file_that_is_not_a_calibration(synth_model, tmp_path, capsys):
    src = str(synth_model("mixtral"))
    for name, data in [("x.npz", b"not numpy at all" * 8), ("y.npz", b"")]:
        (tmp_path / name).write_bytes(data)
        assert routing_main(["--model", src, "--tokens", "50", "--calibration", str(tmp_path / name)]) == 2
        assert "is not a calibration file" in _one_line(capsys)
    np.savez(tmp_path / "z.npz", a=np.zeros(3))  # an .npz, not a calibration
    assert routing_main(["--model", src, "--tokens", "50", "--calibration", str(tmp_path / "z.npz")]) == 2
    assert "is not a calibration file" in _one_line(capsys)


def test_corrupt_records_are_one_line(prep_model, tmp_path, capsys):
    """A checksum mismatch found while routing: one line, exit 1, no traceback."""
    import shutil

    from shared.blob import Manifest

    dst = tmp_path / "prep"
    shutil.copytree(prep_model("mixtral"), dst)
    lay = Manifest.load(dst).layers[0]
    with open(dst / lay.file, "r+b") as f:  # a flipped byte in every record of the first layer
        for e in range(lay.num_experts):
            f.seek(e * lay.stride + 5)
            b = f.read(1)
            f.seek(e * lay.stride + 5)
            f.write(bytes([b[0] ^ 0xFF]))
    out = tmp_path / "r.json"
    assert routing_main(["--model", str(dst), "--tokens", "50", "--json", str(out)]) == 1
    line = _one_line(capsys)
    assert "CHECKSUM" in line or "checksum" in line, line
    assert not out.exists()
