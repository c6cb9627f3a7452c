"""`infer synth`: models load and generate with mlx-lm, same seed same bytes, refusals."""

import json

import mlx.core as mx
import mlx_lm
import pytest

from infer.synth import presets as synth_presets
from infer.synth.synth import main as synth_main

ARCHS = [
    ("qwen3_moe", "affine4"),
    ("qwen3_moe", "affine8"),
    ("qwen3_moe", "mxfp4"),
    ("qwen3_next", "affine4"),
    ("mixtral", "affine4"),
    ("gpt_oss", "mxfp4"),
    ("deepseek_v3", "affine4"),
]


def files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("arch,quant", ARCHS)
def test_loads_and_generates(arch, quant, synth_model):
    folder = synth_model(arch, quant)
    model, tokenizer = mlx_lm.load(str(folder))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}], add_generation_prompt=True)
    assert isinstance(prompt, (list, str))
    text = mlx_lm.generate(model, tokenizer, prompt, max_tokens=4, verbose=False)
    assert isinstance(text, str)
    ids = tokenizer.encode("def f(x): return x")
    logits = model(mx.array([ids]))
    assert logits.shape == (1, len(ids), model.args.vocab_size)
    assert bool(mx.all(mx.isfinite(logits)))
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["quantization"]["bits"] == (8 if quant == "affine8" else 4)
    assert cfg["quantization"]["mode"] == ("mxfp4" if quant == "mxfp4" else "affine")
    assert cfg["torch_dtype"] == "float32"


def test_same_seed_same_bytes(synth_model, tmp_path):
    a = synth_model("qwen3_next")
    b = tmp_path / "b"
    assert synth_main(["--arch", "qwen3_next", "--preset", "tiny", "--out", str(b)]) == 0
    assert files(a) == files(b)
    c = tmp_path / "c"
    assert synth_main(["--arch", "qwen3_next", "--preset", "tiny", "--out", str(c), "--seed", "1"]) == 0
    fa, fc = files(a), files(c)
    assert fa["tokenizer.json"] == fc["tokenizer.json"]
    assert fa["model.safetensors"] != fc["model.safetensors"]


def test_qwen3_next_mtp_head(synth_model):
    folder = synth_model("qwen3_next")
    mtp = mx.load(str(folder / "mtp.safetensors"))
    for k in [
        "mtp.fc.weight",
        "mtp.norm.weight",
        "mtp.pre_fc_norm_embedding.weight",
        "mtp.pre_fc_norm_hidden.weight",
        "mtp.layers.0.input_layernorm.weight",
        "mtp.layers.0.post_attention_layernorm.weight",
        "mtp.layers.0.self_attn.q_proj.weight",
        "mtp.layers.0.self_attn.q_norm.weight",
        "mtp.layers.0.self_attn.k_norm.weight",
        "mtp.layers.0.self_attn.o_proj.scales",
        "mtp.layers.0.mlp.gate.weight",
        "mtp.layers.0.mlp.shared_expert.down_proj.weight",
        "mtp.layers.0.mlp.shared_expert_gate.weight",
        "mtp.layers.0.mlp.switch_mlp.gate_proj.weight",
        "mtp.layers.0.mlp.switch_mlp.gate_proj.scales",
        "mtp.layers.0.mlp.switch_mlp.down_proj.biases",
    ]:
        assert k in mtp, k
    cfg = json.loads((folder / "config.json").read_text())
    E = cfg["num_experts"]
    assert mtp["mtp.layers.0.mlp.switch_mlp.up_proj.weight"].shape[0] == E
    assert mtp["mtp.fc.weight"].dtype == mx.uint32  # quantized like the main model
    # the router is 8-bit, as mlx-lm's quant_predicate wants it
    assert cfg["quantization"]["mtp.layers.0.mlp.gate"]["bits"] == 8
    assert not any(k.startswith("mtp.") for k in mx.load(str(folder / "model.safetensors")))


def test_gpt_oss_features(synth_model):
    folder = synth_model("gpt_oss")
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["quantization"]["mode"] == "mxfp4"
    assert "sliding_attention" in cfg["layer_types"] and "full_attention" in cfg["layer_types"]
    w = mx.load(str(folder / "model.safetensors"))
    assert w["model.layers.0.mlp.experts.gate_proj.scales"].dtype == mx.uint8
    assert w["model.layers.0.mlp.experts.gate_proj.bias"].ndim == 2
    assert "model.layers.0.self_attn.sinks" in w


def test_deepseek_first_layer_dense(synth_model):
    w = mx.load(str(synth_model("deepseek_v3") / "model.safetensors"))
    assert "model.layers.0.mlp.gate_proj.weight" in w
    assert not any(k.startswith("model.layers.0.mlp.switch_mlp") for k in w)
    assert "model.layers.1.mlp.switch_mlp.gate_proj.weight" in w


def test_bfloat16_and_layers(synth_model):
    folder = synth_model("qwen3_moe", dtype="bfloat16", layers=2)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and cfg["torch_dtype"] == "bfloat16"
    w = mx.load(str(folder / "model.safetensors"))
    assert w["model.layers.1.mlp.switch_mlp.up_proj.scales"].dtype == mx.bfloat16
    assert w["model.norm.weight"].dtype == mx.bfloat16
    assert not any(k.startswith("model.layers.2.") for k in w)


def test_real_presets_have_real_dimensions():
    c = synth_presets.make_config(None, "qwen3-30b-a3b", layers=2)
    assert (c["hidden_size"], c["num_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"]) == (2048, 128, 8, 768)
    assert c["num_hidden_layers"] == 2
    c = synth_presets.make_config("qwen3_next", "qwen3-next-80b-a3b")
    assert (c["num_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"], c["num_hidden_layers"]) == (512, 10, 512, 48)
    with pytest.raises(ValueError):
        synth_presets.make_config("mixtral", "qwen3-30b-a3b")


def test_sharded_output_loads(tmp_path, monkeypatch):
    from infer.synth import synth

    monkeypatch.setattr(synth, "SHARD_BYTES", 400_000)
    out = tmp_path / "sharded"
    assert synth.main(["--arch", "mixtral", "--preset", "tiny", "--out", str(out), "--layers", "3"]) == 0
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    model, tok = mlx_lm.load(str(out))
    assert model(mx.array([[1, 2, 3]])).shape[-1] == model.args.vocab_size


def test_mtp_parts_joined_into_one_file(tmp_path, monkeypatch, synth_model):
    from infer.synth import synth

    monkeypatch.setattr(synth, "SHARD_BYTES", 100_000)
    out = tmp_path / "next"
    assert synth.main(["--arch", "qwen3_next", "--preset", "tiny", "--out", str(out)]) == 0
    assert not list(out.glob("mtp-*")) and not list(out.glob(".*"))
    a = mx.load(str(out / "mtp.safetensors"))
    b = mx.load(str(synth_model("qwen3_next") / "mtp.safetensors"))
    assert set(a) == set(b)
    assert all(mx.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["--arch", "llama", "--preset", "tiny"], "unknown arch"),
        (["--arch", "qwen3_moe", "--preset", "huge"], "unknown preset"),
        (["--arch", "gpt_oss", "--preset", "tiny", "--quant", "affine4"], "mxfp4 only"),
        (["--arch", "qwen3_moe", "--preset", "tiny", "--quant", "affine3"], "unknown quantization"),
        (["--arch", "qwen3_moe", "--preset", "tiny", "--dtype", "int8"], "unknown dtype"),
        (["--arch", "mixtral", "--preset", "qwen3-30b-a3b"], "is a qwen3_moe model"),
        (["--preset", "tiny"], "--arch is required"),
        (["--arch", "qwen3_next", "--preset", "tiny", "--layers", "2"], "needs --layers >= 4"),
    ],
)
def test_refusals(argv, msg, tmp_path, capsys):
    out = tmp_path / "out"
    assert synth_main(argv + ["--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("infer synth: ") and msg in err[0], err
    assert not out.exists()
    assert not list(tmp_path.iterdir())


def test_refuses_non_empty_out(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "x").write_text("keep")
    assert synth_main(["--arch", "qwen3_moe", "--preset", "tiny", "--out", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["x"]


# --- routing ----------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next", "mixtral", "gpt_oss", "deepseek_v3"])
def test_routing_is_realistic(arch, synth_model):
    """Over ~1k tokens nearly all experts are used, consecutive tokens share
    only some, and an LRU of 1/8 of the experts hits roughly 50-75%."""
    from infer.tools.routing import route, summarize
    from infer.synth.tokenizer import corpus_text

    model, tok = mlx_lm.load(str(synth_model(arch)))
    s = summarize(*route(model, tok.encode(corpus_text())[:1024]))["summary"]
    assert s["tokens"] == 1024
    assert s["experts_used"] >= 0.85, s
    assert 0.25 <= s["next_token_reuse"] <= 0.75, s
    assert 0.50 <= s["lru_hit"]["0.125"] <= 0.75, s


def test_synth_memory_stays_near_one_layer(tmp_path):
    """A model several times larger than a shard plus a layer is written with
    bounded memory (subprocess, so its peak RSS is its own)."""
    import subprocess
    import sys

    script = f"""
import sys
from pathlib import Path
from infer.synth import synth
from infer.synth import presets as synth_presets
synth_presets.SIZES["mem"] = dict(synth_presets.SIZES["tiny"], hidden=1024, moe_inter=512, experts=32, layers=6, vocab=256)
synth.PRESETS = synth_presets.PRESETS + ("mem",)
synth.SHARD_BYTES = 32 << 20
assert synth.main(["--arch", "qwen3_moe", "--preset", "mem", "--quant", "affine8", "--out", {str(tmp_path / "m")!r}]) == 0
for line in open("/proc/self/status"):
    if line.startswith("VmHWM:"):
        print("peak", int(line.split()[1]) // 1024)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    peak = int(r.stdout.split("peak ")[1].split()[0])
    size = sum(p.stat().st_size for p in (tmp_path / "m").iterdir()) >> 20
    base = int(subprocess.run(
        [sys.executable, "-c", "import infer.synth.synth, mlx_lm.utils\nfor l in open('/proc/self/status'):\n if l.startswith('VmHWM:'): print(int(l.split()[1]) // 1024)"],
        capture_output=True, text=True).stdout)
    print(f"synth peak RSS {peak} MB (imports {base} MB) for a {size} MB model")
    assert size > 250
    # imports + one shard (32 MB) + one layer's float chunks and quantized experts (~60 MB)
    assert peak - base < 160, (peak, base, size)


@pytest.mark.parametrize("seed", ["-1", str(2**32), str(2**70)])
def test_refuses_seed_out_of_range(seed, tmp_path, capsys):
    out = tmp_path / "out"
    assert synth_main(["--arch", "qwen3_moe", "--preset", "tiny", "--seed", seed, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("infer synth: --seed must be between 0 and 4294967295"), err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("force", [[], ["--force"]])
@pytest.mark.parametrize("content", ["", "keep"])
def test_refuses_out_that_is_a_file(force, content, tmp_path, capsys):
    """A file at --out is not replaced, --force or not (it replaces a folder)."""
    out = tmp_path / "out"
    out.write_text(content)
    assert synth_main(["--arch", "qwen3_moe", "--preset", "tiny", "--out", str(out), *force]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0] == f"infer synth: {out} exists and is not a folder", err
    assert out.read_text() == content and [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.parametrize("under", ["afile/x", "afile/sub/x"])
def test_refuses_out_under_a_file(under, tmp_path, capsys):
    (tmp_path / "afile").write_text("keep")
    out = tmp_path / under
    assert synth_main(["--arch", "qwen3_moe", "--preset", "tiny", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("infer synth: ") and "afile is not a folder" in err[0], err
    assert [p.name for p in tmp_path.iterdir()] == ["afile"] and (tmp_path / "afile").read_text() == "keep"


def test_a_failed_synth_leaves_no_folders_it_made(tmp_path, monkeypatch):
    """The folders made above --out go with the half-built model when synthesis fails."""
    from infer.synth import synth

    (tmp_path / "kept").mkdir()

    def broken(*a, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(synth, "synthesize", broken)
    with pytest.raises(OSError):
        synth.main(["--arch", "qwen3_moe", "--preset", "tiny", "--out", str(tmp_path / "kept" / "a" / "b" / "m")])
    assert [p.name for p in tmp_path.iterdir()] == ["kept"] and not list((tmp_path / "kept").iterdir())
