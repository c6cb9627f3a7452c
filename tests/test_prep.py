"""`infer prep`: byte-exact records, unchanged resident weights, refusals, resume, memory."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from infer.prep.prep import main as prep_main
from shared.blob import Manifest, read_record, verify_record

CASES = [
    ("qwen3_moe", "affine4"),
    ("qwen3_moe", "affine8"),
    ("qwen3_next", "affine4"),
    ("mixtral", "affine4"),
    ("gpt_oss", "mxfp4"),
    ("deepseek_v3", "affine4"),
]


def raw(a: mx.array) -> bytes:
    """Bytes of an MLX array, bfloat16 included (viewed as uint16)."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.array(a).tobytes()


def load_all(folder: Path, pattern: str):
    out = {}
    for f in sorted(folder.glob(pattern)):
        out.update(mx.load(str(f)))
    return out


@pytest.mark.parametrize("arch,quant", CASES)
def test_records_and_resident_match_source(arch, quant, synth_model, prep_model):
    src = synth_model(arch, quant)
    dst = prep_model(arch, quant)
    manifest = Manifest.load(dst)
    source = load_all(src, "model*.safetensors")
    mtp_source = load_all(src, "mtp.safetensors")
    expert_keys = set()
    for layout in manifest.layers:
        tensors = mtp_source if layout.module.startswith("mtp.") else source
        assert layout.stride % 4096 == 0 and layout.stride >= layout.record_bytes
        assert (dst / layout.file).stat().st_size == layout.num_experts * layout.stride
        for seg in layout.segments:
            key = f"{layout.module}.{seg.projection}.{seg.tensor}"
            expert_keys.add(key)
            assert tensors[key].shape[0] == layout.num_experts
            assert list(tensors[key].shape[1:]) == seg.shape
        for e in range(layout.num_experts):
            rec = read_record(dst, layout, e)
            assert verify_record(layout, e, rec)
            for seg in layout.segments:
                want = raw(tensors[f"{layout.module}.{seg.projection}.{seg.tensor}"][e])
                assert rec[seg.offset : seg.offset + seg.nbytes] == want, (layout.layer, e, seg)
            # padding is zero
            with open(dst / layout.file, "rb") as f:
                pad = os.pread(f.fileno(), layout.stride - layout.record_bytes, e * layout.stride + layout.record_bytes)
            assert pad == bytes(len(pad))

    resident = load_all(dst, "model*.safetensors")
    assert set(resident) == set(source) - expert_keys
    for k, v in resident.items():
        assert v.dtype == source[k].dtype and v.shape == source[k].shape and raw(v) == raw(source[k]), k

    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (dst / name).read_bytes() == (src / name).read_bytes()

    if arch == "qwen3_next":
        mtp_layers = [l for l in manifest.layers if l.module.startswith("mtp.")]
        cfg = json.loads((src / "config.json").read_text())
        assert [l.layer for l in mtp_layers] == [cfg["num_hidden_layers"]]
        assert mtp_layers[0].module == "mtp.layers.0.mlp.switch_mlp"
        mtp_resident = load_all(dst, "mtp.safetensors")
        assert set(mtp_resident) == set(mtp_source) - expert_keys
        assert "mtp.fc.weight" in mtp_resident and "mtp.layers.0.mlp.shared_expert_gate.weight" in mtp_resident
        for k, v in mtp_resident.items():
            assert raw(v) == raw(mtp_source[k])
    else:
        assert not (dst / "mtp.safetensors").exists()


def test_manifest_describes_quantization(prep_model):
    m = Manifest.load(prep_model("gpt_oss"))
    l = m.layers[0]
    assert l.module == "model.layers.0.mlp.experts"
    assert l.quantization["gate_proj"] == {"mode": "mxfp4", "bits": 4, "group_size": 32}
    tensors = [(s.projection, s.tensor, s.dtype) for s in l.segments]
    assert tensors[:3] == [("gate_proj", "weight", "uint32"), ("gate_proj", "scales", "uint8"), ("gate_proj", "bias", "float32")]
    m = Manifest.load(prep_model("qwen3_moe", "affine8"))
    assert m.layers[0].quantization["down_proj"] == {"mode": "affine", "bits": 8, "group_size": 64}
    m = Manifest.load(prep_model("deepseek_v3"))
    assert [l.layer for l in m.layers] == [1, 2, 3]  # first layer dense


def test_bfloat16_source(synth_model, tmp_path):
    src = synth_model("mixtral", dtype="bfloat16", layers=2)
    dst = tmp_path / "out"
    assert prep_main(["--model", str(src), "--out", str(dst), "--no-progress"]) == 0
    m = Manifest.load(dst)
    assert {s.dtype for s in m.layers[0].segments} == {"uint32", "bfloat16"}
    source = load_all(src, "model*.safetensors")
    l = m.layers[1]
    rec = read_record(dst, l, 5)
    for s in l.segments:
        assert rec[s.offset : s.offset + s.nbytes] == raw(source[f"{l.module}.{s.projection}.{s.tensor}"][5])


# --- refusals -------------------------------------------------------------------------------


def refuse(argv, capsys):
    assert prep_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("infer prep: "), err
    return err[0]


def test_refuses_non_model_folder(tmp_path, capsys):
    (tmp_path / "src").mkdir()
    out = tmp_path / "out"
    assert "not a model folder" in refuse(["--model", str(tmp_path / "src"), "--out", str(out)], capsys)
    assert "not a model folder" in refuse(["--model", str(tmp_path / "nope"), "--out", str(out)], capsys)
    assert not out.exists()


def test_refuses_dense_model(tmp_path, capsys, synth_model):
    src = tmp_path / "dense"
    src.mkdir()
    config = {
        "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 1, "intermediate_size": 128,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "rms_norm_eps": 1e-6,
        "vocab_size": 64, "rope_theta": 1e6, "max_position_embeddings": 512, "tie_word_embeddings": True,
    }
    (src / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(src / "model.safetensors"), {"model.embed_tokens.weight": mx.zeros((64, 64))})
    out = tmp_path / "out"
    assert "no MoE layers" in refuse(["--model", str(src), "--out", str(out)], capsys)
    assert not out.exists()


def _requantized_copy(src: Path, dst: Path, bits: int, group_size: int = 64):
    """Copy of ``src`` whose experts are re-quantized to ``bits``."""
    shutil.copytree(src, dst)
    w = mx.load(str(dst / "model.safetensors"))
    for k in [k for k in w if ".switch_mlp." in k and k.endswith(".weight")]:
        p = k[: -len(".weight")]
        full = mx.dequantize(w[k], w[p + ".scales"], w[p + ".biases"], group_size=64, bits=4)
        w[k], w[p + ".scales"], w[p + ".biases"] = mx.quantize(full, group_size, bits)
    mx.save_safetensors(str(dst / "model.safetensors"), w)


def test_refuses_unsupported_quantization(tmp_path, capsys, synth_model):
    src = tmp_path / "q3"
    _requantized_copy(synth_model("qwen3_moe"), src, bits=3)
    out = tmp_path / "out"
    msg = refuse(["--model", str(src), "--out", str(out)], capsys)
    assert "unsupported quantization affine 3-bit" in msg
    assert not out.exists()


def test_unquantized_experts(tmp_path, synth_model):
    """Float experts (no scales) are accepted: segments are just the weights."""
    src = tmp_path / "float"
    shutil.copytree(synth_model("qwen3_moe"), src)
    w = mx.load(str(src / "model.safetensors"))
    for k in [k for k in w if ".switch_mlp." in k and k.endswith(".weight")]:
        p = k[: -len(".weight")]
        w[k] = mx.dequantize(w[k], w.pop(p + ".scales"), w.pop(p + ".biases"), group_size=64, bits=4)
    mx.save_safetensors(str(src / "model.safetensors"), w)
    out = tmp_path / "out"
    assert prep_main(["--model", str(src), "--out", str(out), "--no-progress"]) == 0
    l = Manifest.load(out).layers[0]
    assert l.quantization == {}
    assert [(s.projection, s.tensor, s.dtype) for s in l.segments] == [
        ("gate_proj", "weight", "float32"), ("up_proj", "weight", "float32"), ("down_proj", "weight", "float32")
    ]
    rec = read_record(out, l, 3)
    s = l.segments[2]
    assert rec[s.offset : s.offset + s.nbytes] == raw(w[f"{l.module}.down_proj.weight"][3])


def test_refuses_non_empty_out_without_force(tmp_path, capsys, synth_model):
    src = synth_model("qwen3_moe")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert "not empty" in refuse(["--model", str(src), "--out", str(out)], capsys)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    assert prep_main(["--model", str(src), "--out", str(out), "--force", "--no-progress"]) == 0
    assert not (out / "keep.txt").exists() and (out / "manifest.json").exists()


def test_usage_error_exits_2():
    with pytest.raises(SystemExit) as e:
        prep_main(["--model"])
    assert e.value.code == 2


# --- resume ---------------------------------------------------------------------------------


def test_resume_keeps_good_layers_and_rewrites_bad(tmp_path, synth_model, capsys):
    src = synth_model("qwen3_moe")
    out = tmp_path / "out"
    assert prep_main(["--model", str(src), "--out", str(out), "--no-progress"]) == 0
    m = Manifest.load(out)
    # simulate an interrupted run: one layer corrupt, one missing, no manifest yet
    with open(out / m.layers[1].file, "r+b") as f:
        f.seek(100)
        f.write(b"\xff\xfe")
    (out / m.layers[2].file).unlink()
    (out / "manifest.json").rename(out / "manifest.partial.json")
    before = (out / m.layers[0].file).stat().st_mtime_ns
    capsys.readouterr()
    assert prep_main(["--model", str(src), "--out", str(out), "--resume", "--no-progress"]) == 0
    assert f"({len(m.layers) - 2} kept by --resume)" in capsys.readouterr().out
    assert (out / m.layers[0].file).stat().st_mtime_ns == before
    assert Manifest.load(out).to_json() == m.to_json()
    assert not (out / "manifest.partial.json").exists()
    assert not list(out.glob("*.tmp"))


# --- memory ---------------------------------------------------------------------------------


def test_peak_rss_bounded(tmp_path, monkeypatch):
    """Prep a model with ~300 MB of experts in a subprocess: its peak RSS must stay
    near the fixed overhead plus one layer, far below the model's size."""
    from infer.synth import synth
    from infer.synth import presets as synth_presets

    size = dict(synth_presets.SIZES["tiny"], hidden=1024, moe_inter=512, experts=32, layers=5, top_k=2, vocab=256)
    monkeypatch.setitem(synth_presets.SIZES, "membound", size)
    monkeypatch.setattr(synth_presets, "PRESETS", synth_presets.PRESETS + ("membound",))
    monkeypatch.setattr(synth, "PRESETS", synth_presets.PRESETS + ("membound",))
    src = tmp_path / "big"
    assert synth.main(["--arch", "qwen3_moe", "--preset", "membound", "--quant", "affine8", "--out", str(src)]) == 0
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, "-m", "infer.cli", "prep", "--model", str(src), "--out", str(out), "--no-progress"],
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0, r.stderr
    peak_mb = float(r.stdout.split("peak RSS ")[1].split()[0])
    base = subprocess.run(
        [sys.executable, "-c", "import infer.prep.prep, mlx_lm.utils\nfor l in open('/proc/self/status'):\n if l.startswith('VmHWM:'): print(int(l.split()[1]) / 1024)"],
        capture_output=True, text=True,
    )
    base_mb = float(base.stdout) if base.stdout.strip() else 80.0
    m = Manifest.load(out)
    experts_mb = m.expert_bytes / 1e6
    layer_mb = max(l.stride * l.num_experts for l in m.layers) / 1e6
    # beyond its imports, prep holds a few MB of records at a time: the bound
    # (48 MB) is far below one layer (~57 MB) and the model (~280 MB of experts)
    assert experts_mb > 5 * 48
    assert peak_mb - base_mb < 48, (peak_mb, base_mb, layer_mb, experts_mb)
    print(f"prep peak RSS {peak_mb:.0f} MB for {experts_mb:.0f} MB of experts ({layer_mb:.0f} MB per layer)")


def test_interrupted_run_leaves_only_whole_files_and_resumes(tmp_path, synth_model, monkeypatch, capsys):
    from infer.prep import prep as prep_mod

    src = synth_model("qwen3_moe")
    out = tmp_path / "out"
    real = prep_mod.write_blob
    calls = []

    def failing(dst, el, progress, *a, **kw):
        calls.append(el.layout.layer)
        if len(calls) == 3:
            # die halfway through the third blob's temporary file
            (dst / (el.layout.file + ".tmp")).write_bytes(b"partial")
            raise KeyboardInterrupt
        return real(dst, el, progress, *a, **kw)

    monkeypatch.setattr(prep_mod, "write_blob", failing)
    with pytest.raises(KeyboardInterrupt):
        prep_mod.prep(src, out, progress=False)
    assert not (out / "manifest.json").exists()
    assert sorted(p.name for p in out.glob("layer*.blob")) == ["layer000.blob", "layer001.blob"]
    partial = json.loads((out / "manifest.partial.json").read_text())
    assert [l["layer"] for l in partial["layers"]] == [0, 1]
    monkeypatch.setattr(prep_mod, "write_blob", real)
    # the leftover .tmp is the failing writer's own doing here; a real write_blob removes its tmp
    (out / "layer002.blob.tmp").unlink()
    assert prep_main(["--model", str(src), "--out", str(out), "--resume", "--no-progress"]) == 0
    assert "(2 kept by --resume)" in capsys.readouterr().out
    assert verify_main_ok(out)


def test_force_keeps_the_old_folder_until_the_new_one_is_whole(tmp_path, synth_model, monkeypatch, capsys):
    """`--force` over a prep folder writes the new one beside it and swaps at
    the end: interrupted, the old folder is whole and nothing else is left."""
    from infer.prep import prep as prep_mod

    src = synth_model("qwen3_moe")
    out = tmp_path / "out"
    assert prep_main(["--model", str(src), "--out", str(out), "--no-progress"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real = prep_mod.write_blob

    def interrupted(dst, el, progress, *a, **kw):
        if el.layout.layer == 1:
            raise KeyboardInterrupt
        return real(dst, el, progress, *a, **kw)

    monkeypatch.setattr(prep_mod, "write_blob", interrupted)
    assert prep_main(["--model", str(src), "--out", str(out), "--force", "--no-progress"]) == 130
    assert capsys.readouterr().err.strip() == f"infer prep: interrupted; {out} is as it was"
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging folder left
    monkeypatch.setattr(prep_mod, "write_blob", real)
    (out / "extra.txt").write_text("old")
    assert prep_main(["--model", str(src), "--out", str(out), "--force", "--no-progress"]) == 0
    assert not (out / "extra.txt").exists() and verify_main_ok(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_resume_over_another_models_folder_gives_the_folder_force_would(tmp_path, synth_model, capsys):
    """--resume into a folder prepped from another model once kept that
    model's calibration, MTP weights and extra blobs, and runs used them."""
    nxt, moe = synth_model("qwen3_next"), synth_model("qwen3_moe")
    out, fresh = tmp_path / "out", tmp_path / "fresh"
    assert prep_main(["--model", str(nxt), "--out", str(out), "--no-progress"]) == 0
    (out / "predict.npz").write_bytes(b"another model's calibration")
    (out / "usage.json").write_text('{"tokens": 1, "layers": {}}')
    (out / "layer000.blob.tmp").write_bytes(b"an interrupted write")
    assert (out / "mtp.safetensors").exists()
    assert prep_main(["--model", str(moe), "--out", str(out), "--resume", "--no-progress"]) == 0
    assert prep_main(["--model", str(moe), "--out", str(fresh), "--no-progress"]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in fresh.iterdir())
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {p.name: p.read_bytes() for p in fresh.iterdir()}


def test_force_sweeps_the_staging_folders_of_killed_runs(tmp_path, synth_model):
    """A `--force` run killed with SIGKILL leaves its staging folder (named
    after its pid); the next `--force` into that folder removes it, not the
    staging folder of a run still going."""
    src = synth_model("qwen3_moe")
    out = tmp_path / "out"
    assert prep_main(["--model", str(src), "--out", str(out), "--no-progress"]) == 0
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = tmp_path / f".out.prep-{gone.pid}"
    dead.mkdir()
    (dead / "layer000.blob.tmp").write_bytes(b"x" * 1000)
    old = tmp_path / f".out.old-{gone.pid}"
    old.mkdir()
    alive = tmp_path / f".out.prep-{os.getppid()}"
    alive.mkdir()
    assert prep_main(["--model", str(src), "--out", str(out), "--force", "--no-progress"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", alive.name])
    assert verify_main_ok(out)


def test_a_prep_folder_as_source_is_named_as_one(tmp_path, prep_model, capsys):
    line = refuse(["--model", str(prep_model("qwen3_moe")), "--out", str(tmp_path / "o")], capsys)
    assert "is a prep folder already" in line and not (tmp_path / "o").exists()


def test_truncated_source_is_refused_before_anything_is_written(tmp_path, synth_model, capsys):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(synth_model("qwen3_moe"), src)
    weights = sorted(src.glob("model*.safetensors"))[-1]
    weights.write_bytes(weights.read_bytes()[:-100])
    out = tmp_path / "out"
    assert "truncated" in refuse(["--model", str(src), "--out", str(out)], capsys)
    assert not out.exists()


def verify_main_ok(folder):
    from infer.prep.verify import main as verify_main

    return verify_main([str(folder)]) == 0


def test_write_blob_removes_its_tmp_on_failure(tmp_path, synth_model, monkeypatch):
    from infer.prep import prep as prep_mod
    from infer.prep import safetensors as prep_safetensors

    src = synth_model("mixtral")
    layers, _, _ = prep_mod.plan(src, json.loads((src / "config.json").read_text()))
    calls = []

    def boom(*a, **kw):
        calls.append(1)
        if len(calls) > 5:
            raise OSError("disk on fire")
        return real_read(*a, **kw)

    real_read = prep_safetensors.read_bytes
    monkeypatch.setattr(prep_safetensors, "read_bytes", boom)
    with pytest.raises(OSError):
        prep_mod.write_blob(tmp_path, layers[0], prep_mod.Progress(1, False))
    assert list(tmp_path.iterdir()) == []


# --- folders as Hugging Face publishes them ----------------------------------------------------


def synth_hf(folder, arch, preset="tiny", layers=None):
    from infer.synth.synth import main as synth_main

    argv = ["--arch", arch, "--preset", preset, "--layout", "hf", "--out", str(folder)]
    if layers:
        argv += ["--layers", str(layers)]
    assert synth_main(argv) == 0
    return folder


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next", "mixtral"])
def test_published_layout_is_converted_as_mlx_lm_convert_does(arch, tmp_path):
    """A bf16 folder in Hugging Face's layout: the prep folder holds, byte for
    byte, what `mlx_lm.convert -q` writes (resident tensors, each expert's
    slice of the stacked tensors, the config's quantization)."""
    from mlx_lm.convert import convert

    src = synth_hf(tmp_path / "hf", arch)
    dst = tmp_path / "prep"
    assert prep_main(["--model", str(src), "--out", str(dst), "--no-progress"]) == 0
    ref = tmp_path / "mlx"
    convert(str(src), str(ref), quantize=True, q_group_size=64, q_bits=4)

    expected = load_all(ref, "model*.safetensors")
    resident = load_all(dst, "model*.safetensors")
    manifest = Manifest.load(dst)
    expert_keys = set()
    for layout in manifest.layers:
        for e in (0, layout.num_experts - 1):
            rec = read_record(dst, layout, e)
            assert verify_record(layout, e, rec)
            for seg in layout.segments:
                key = f"{layout.module}.{seg.projection}.{seg.tensor}"
                expert_keys.add(key)
                assert rec[seg.offset : seg.offset + seg.nbytes] == raw(expected[key][e]), (key, e)
        assert layout.quantization[layout.projections[0]] == {"mode": "affine", "bits": 4, "group_size": 64}
    assert set(resident) | expert_keys == set(expected)
    for k, v in resident.items():
        assert v.dtype == expected[k].dtype and raw(v) == raw(expected[k]), k
    ours, theirs = (json.loads((f / "config.json").read_text()) for f in (dst, ref))
    assert ours["quantization"] == theirs["quantization"]


def test_published_layout_runs_exactly_as_mlx_lm_convert_output(tmp_path, monkeypatch):
    import mlx.core as mx
    from mlx_lm import load as mlx_load
    from mlx_lm.convert import convert
    from mlx_lm.generate import generate_step

    from infer.runtime.client import IodClient
    from infer.runtime.loader import load_streaming
    from shared.fixtures import short_dir

    monkeypatch.setenv("IOD_RUN_DIR", str(short_dir("iodh-")))
    src = synth_hf(tmp_path / "hf", "qwen3_moe")
    dst = tmp_path / "prep"
    assert prep_main(["--model", str(src), "--out", str(dst), "--no-progress", "--q-bits", "8"]) == 0
    ref = tmp_path / "mlx"
    convert(str(src), str(ref), quantize=True, q_group_size=64, q_bits=8)
    model, tokenizer = mlx_load(str(ref))
    prompt = mx.array(tokenizer.encode("The lighthouse keeper counted the ships"))
    expected = [int(t) for t, _ in generate_step(prompt, model, max_tokens=12)]
    source = IodClient(dst, iod="auto")
    try:
        streamed, _, _ = load_streaming(dst, source, cache_bytes=1)
        assert [int(t) for t, _ in generate_step(prompt, streamed, max_tokens=12)] == expected
    finally:
        source.close()


def test_published_layout_peak_rss_below_1_gb(tmp_path):
    """`infer prep` of a bf16 Hugging Face folder of the small preset's size
    (3 of its 16 layers: the peak is per tensor, not per model) stays below
    1 GB, and below the model's own size."""
    src = synth_hf(tmp_path / "hf", "qwen3_moe", preset="small", layers=3)
    size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    r = subprocess.run([sys.executable, "-m", "infer.cli", "prep", "--model", str(src),
                        "--out", str(tmp_path / "out"), "--no-progress"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    peak_mb = float(r.stdout.split("peak RSS ")[1].split()[0])
    print(f"prep of a {size / 1e6:.0f} MB bf16 Hugging Face folder: peak RSS {peak_mb:.0f} MB")
    assert peak_mb < 1000 and peak_mb * 1e6 < size, (peak_mb, size)


def test_repo_id_is_one_line_with_the_download_command(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = refuse(["--model", "Qwen/Qwen3-30B-A3B", "--out", "q"], capsys)
    assert "hf download Qwen/Qwen3-30B-A3B --local-dir Qwen3-30B-A3B" in line
    assert "huggingface-cli download" in line


def test_quantization_options_are_for_published_folders_only(synth_model, tmp_path, capsys):
    src = synth_model("qwen3_moe")
    capsys.readouterr()
    msg = refuse(["--model", str(src), "--out", str(tmp_path / "o"), "--q-bits", "8"], capsys)
    assert "already converted by mlx-lm" in msg
