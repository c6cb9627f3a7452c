"""Every mlx-lm MoE architecture: `infer prep` finds its experts and streaming
gives stock mlx-lm's greedy ids, at the default cache and at one that holds
less than a token's experts, and with the prompt prefilled layer-major in
chunks.

The architectures are the installed mlx-lm's model files that use SwitchGLU /
SwitchMLP, and the model files built on those (VLM wrappers and variants, on
their base's tiny config), so a new mlx-lm release is covered (or fails here,
asking for a tiny config) without anyone listing it. Each model is mlx-lm's own class at
tiny dimensions with its own random init (routers that init to zero get random
weights, or routing would be constant), quantized by mlx-lm's quantize_model,
saved by mlx-lm's save_model, run by stock mlx-lm, prepped, and streamed
through one shared daemon.
"""

import re
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.generate import generate_step
from mlx_lm.models import switch_layers
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import _get_classes, load_model, quantize_model, save_config, save_model

from infer.runtime.client import IodClient
from infer.runtime.loader import load_streaming
from infer.runtime.prefill import prefill
from infer.prep.prep import prep
from shared.fixtures import LiveDaemon

MODELS_DIR = Path(switch_layers.__file__).parent


def _imports(text):
    out = set(re.findall(r"^\s*from \.(\w+) import", text, re.M))
    for names in re.findall(r"^\s*from \. import ([\w, ]+)", text, re.M):
        out |= {n.strip() for n in names.split(",")}
    return out


def moe_archs():
    """(archs, wrappers): mlx-lm model files that build SwitchGLU / SwitchMLP
    experts, and the model files built on those (VLM wrappers, variants)
    with the file each one builds on."""
    texts = {f.stem: f.read_text() for f in sorted(MODELS_DIR.glob("*.py"))
             if f.name not in ("switch_layers.py", "__init__.py")}
    archs = [k for k, t in texts.items() if re.search(r"\bSwitch(GLU|MLP)\b", t)]
    wrappers = {}
    grown = True
    while grown:
        grown = False
        for k, t in texts.items():
            if k not in archs and k not in wrappers:
                base = sorted(_imports(t) & (set(archs) | set(wrappers)))
                if base:
                    wrappers[k], grown = base[0], True
    return archs, wrappers


DIRECT, WRAPPERS = moe_archs()
ARCHS = sorted(DIRECT + list(WRAPPERS))

# Stock mlx-lm cannot run these on Linux, so there is nothing to compare with.
SKIP = {
    "muse_spark": "stock mlx-lm runs its attention through a Metal-only kernel "
    "(mlx_lm/kernels/qk_norm_rope.py): 'No Metal back-end' on Linux",
    # and this one needs an input that cannot be made from a config
    "prism_hadamard_qwen35": "loads only pre-packed 2-bit Hadamard-rotated weights with their module "
    "manifest, made by a calibration tool (and 2-bit experts are not a format infer streams)",
}

# Tiny dimensions shared by all; each ModelArgs takes the names it knows.
BASE = dict(
    hidden_size=64, num_hidden_layers=2, intermediate_size=128, moe_intermediate_size=64,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
    rms_norm_eps=1e-5, norm_eps=1e-5, layer_norm_epsilon=1e-5, layernorm_epsilon=1e-5,
    rope_theta=10000.0, max_position_embeddings=4096, rope_scaling=None, partial_rotary_factor=1.0,
    num_experts=8, num_local_experts=8, n_routed_experts=8, moe_num_experts=8,
    num_experts_per_tok=2, moe_topk=2, experts_per_token=2,
    n_shared_experts=1, num_shared_experts=1, num_shared_expert=1,
    shared_expert_intermediate_size=64, shared_intermediate_size=64,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], first_k_dense_replace=0,
    attention_bias=False, tie_word_embeddings=False, n_group=1, topk_group=1,
    routed_scaling_factor=1.0, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16,
    qk_nope_head_dim=16, v_head_dim=16, use_qk_norm=True, use_bias=False,
)
LAYERS2 = ["sliding_attention", "full_attention"]
YARN = {"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0}
KDA = {"kda_layers": [1], "num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4}

# What each architecture needs beyond BASE (found by building each one).
# "text_config": the arguments nest under it, as in the published configs.
OVERRIDES = {
    "afmoe": dict(layer_types=LAYERS2, num_dense_layers=0, sliding_window=64),
    "bailing_hybrid": dict(layer_group_size=2, group_norm_size=1),
    "bailing_moe_linear": dict(layer_group_size=2, group_norm_size=1),
    "deepseek_v2": dict(rope_scaling=YARN),
    "exaone_moe": dict(sliding_window=64, layer_types=LAYERS2, is_moe_layer=[True, True]),
    "gemma4_text": dict(enable_moe_block=True, top_k_experts=2, num_kv_shared_layers=0,
                        hidden_size_per_layer_input=0, sliding_window_pattern=2,
                        global_head_dim=16, sliding_window=64, vocab_size_per_layer_input=512),
    "glm_moe_dsa": dict(index_head_dim=16, index_n_heads=2, index_topk=8, topk_method="noaux_tc",
                        scoring_func="sigmoid", moe_layer_freq=1,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "granitemoe": dict(logits_scaling=1.0, attention_multiplier=0.25, embedding_multiplier=1.0,
                       residual_multiplier=1.0),
    "granitemoehybrid": dict(logits_scaling=1.0, attention_multiplier=0.25, embedding_multiplier=1.0,
                             residual_multiplier=1.0, layer_types=["mamba", "attention"],
                             mamba_n_heads=8, mamba_d_head=16, mamba_proj_bias=False,
                             mamba_d_state=16, mamba_d_conv=4, mamba_n_groups=1,
                             mamba_conv_bias=True),
    "hunyuan": dict(use_mixed_mlp_moe=True, use_cla=False, cla_share_factor=2,
                    rope_scaling={"type": "dynamic", "factor": 1.0, "alpha": 1.0}),
    "jamba": dict(attn_layer_offset=1, attn_layer_period=2, expert_layer_offset=0,
                  expert_layer_period=1, mamba_d_conv=4, mamba_d_state=16, mamba_expand=2),
    "kimi_k3": dict(text_config=dict(model_type="kimi_linear", linear_attn_config=KDA,
                                     num_experts_per_token=2, model_max_length=4096)),
    "kimi_linear": dict(linear_attn_config=KDA, model_max_length=4096, num_experts_per_token=2),
    "laguna": dict(num_hidden_layers=3),
    "lfm2_moe": dict(use_expert_bias=True, num_dense_layers=0, conv_bias=False, conv_L_cache=3,
                     layer_types=["conv", "full_attention"]),
    # chunked attention needs a global layer every fourth; one expert per token
    "llama4": dict(text_config=dict(model_type="llama4_text", attention_chunk_size=64,
                                    interleave_moe_layer_step=1, intermediate_size_mlp=128,
                                    num_experts_per_tok=1, num_hidden_layers=4)),
    "longcat_flash": dict(attention_method="MLA", zero_expert_type="identity", ffn_hidden_size=128,
                          expert_ffn_hidden_size=64, zero_expert_num=2, num_layers=2,
                          mla_scale_q_lora=True, mla_scale_kv_lora=True),
    "mellum": dict(sliding_window=64, layer_types=LAYERS2,
                   rope_parameters={t: {"rope_theta": 10000.0} for t in LAYERS2}),
    "mimo_v2_flash": dict(hybrid_layer_pattern=[0, 1], moe_layer_freq=[1, 1],
                          add_swa_attention_sink_bias=True, add_full_attention_sink_bias=False,
                          sliding_window_size=64, topk_method="noaux_tc", scoring_func="sigmoid",
                          swa_rope_theta=10000.0, swa_num_attention_heads=4,
                          swa_num_key_value_heads=2, swa_head_dim=16, swa_v_head_dim=16),
    "minimax": dict(rotary_dim=16),
    "minimax_m3_vl": dict(text_config=dict(dense_intermediate_size=128, rotary_dim=16)),
    "mistral4": dict(rope_parameters={**YARN, "rope_theta": 10000.0, "mscale_all_dim": 1.0,
                                      "llama_4_scaling_beta": 0.1}),
    "muse_spark": dict(text_config=dict(post_norm_eps=1e-5, rope_parameters={"rope_theta": 10000.0},
                                        layer_rope_theta=[10000.0, 0], layer_types=LAYERS2,
                                        sliding_window=64, final_logit_softcapping=30.0,
                                        output_multiplier=1.0, moe_hidden_size=64,
                                        num_shared_experts=0)),
    "nemotron_h": dict(mamba_num_heads=4, mamba_head_dim=16, mamba_proj_bias=False,
                       ssm_state_size=16, conv_kernel=4, n_groups=1, mlp_bias=False,
                       use_conv_bias=True, hybrid_override_pattern="M*EE", num_hidden_layers=4,
                       moe_shared_expert_intermediate_size=64),
    # its own names for the sizes
    "phixtral": dict(num_vocab=512, model_dim=64, num_heads=4, num_layers=2, rotary_dim=16),
    "qwen3_next": dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                       linear_value_head_dim=16, linear_conv_kernel_dim=4,
                       full_attention_interval=2, partial_rotary_factor=0.25),
    "step3p5": dict(num_attention_groups=2, share_expert_dim=64, moe_top_k=2,
                    layer_types=["sliding_attention", "full_attention", "full_attention"],
                    sliding_window=64, num_hidden_layers=3),
}

PROMPT = [1, 5, 9, 33, 100, 7, 3, 12, 40, 41, 42, 43]
N_TOKENS = 8


def tiny_config(arch):
    if arch in WRAPPERS and arch not in OVERRIDES:
        # the config of the file it builds on, nested the way its ModelArgs wants
        base = tiny_config(WRAPPERS[arch])
        text = base.get("text_config", base)
        _, args_class = _get_classes({"model_type": arch})
        if "text_config" in args_class.__dataclass_fields__:
            return {"model_type": arch, "text_config": dict(text)}
        return {**text, "model_type": arch}
    over = dict(OVERRIDES.get(arch, {}))
    text = over.pop("text_config", None)
    config = {**BASE, "model_type": arch, **over}
    if text is not None:
        config = {"model_type": arch, "text_config": {**BASE, "model_type": arch, **text}}
    return config


# routers and routing biases that mlx-lm initializes to zero (DeepSeek's
# MoEGate, correction biases, ...) would route every token alike
_ROUTING = re.compile(r"(?:^|\.)(?:gate|router)\.weight$|bias$")


def randomize_zero_routing(model):
    fresh = []
    for name, p in tree_flatten(model.parameters()):
        if _ROUTING.search(name) and mx.issubdtype(p.dtype, mx.floating) and p.size and not mx.any(p).item():
            scale = p.shape[-1] ** -0.5 if p.ndim > 1 else 0.1
            fresh.append((name, mx.random.normal(p.shape) * scale))
    if fresh:
        model.update(tree_unflatten(fresh))


def build(arch, folder: Path, tokenizer_dir: Path) -> Path:
    config = tiny_config(arch)
    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))
    randomize_zero_routing(model)
    model, config = quantize_model(model, config, 64, 4)
    save_model(folder, model)
    save_config(config, folder / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    return folder


def greedy(model, **kwargs):
    steps = generate_step(mx.array(PROMPT), model, max_tokens=N_TOKENS, **kwargs)
    return [int(t) for t, _ in steps]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from infer.synth.tokenizer import save

    folder = tmp_path_factory.mktemp("tok")
    save(folder, 384)
    return folder


@pytest.fixture(scope="module")
def daemon():
    # one daemon for every architecture: its slots fit the largest tiny record
    d = LiveDaemon(args=["--slot-size", "256K", "--arena", "64M"])
    yield d
    d.stop()


def test_every_moe_architecture_is_enumerated():
    # mlx-lm 0.32.2 has 43 files that build experts; a new release may add more
    assert len(DIRECT) >= 43, DIRECT
    assert {"qwen3_moe", "qwen3_next", "mixtral", "gpt_oss", "deepseek_v3", "phixtral"} <= set(DIRECT)
    assert WRAPPERS.get("qwen3_vl_moe") == "qwen3_moe" and WRAPPERS.get("kimi_vl") == "deepseek_v3"


@pytest.mark.parametrize("arch", ARCHS)
def test_streaming_equals_stock_mlx_lm(arch, tmp_path, tokenizer_dir, daemon):
    if arch in SKIP:
        pytest.skip(SKIP[arch])
    src = build(arch, tmp_path / "src", tokenizer_dir)
    stock = load_model(src)[0]
    expected = greedy(stock)
    # the prompt in chunks of 4 tokens: mlx-lm's ids with those chunks
    in_chunks = greedy(stock, prefill_step_size=4)

    dst = tmp_path / "prep"
    manifest = prep(src, dst, progress=False)
    assert manifest.layers, arch
    one_layer = min(l.record_bytes for l in manifest.layers) * len(manifest.layers)
    misses = []
    for cache_bytes in (None, one_layer):  # default (25%), then one expert per layer
        client = IodClient(dst, iod=str(daemon.socket))
        try:
            model, _, store = load_streaming(dst, client, cache_bytes)
            store.trace = []
            assert greedy(model) == expected, (arch, cache_bytes)
            misses.append(store.stats["misses"])
            if cache_bytes:
                # the routing varies, so the comparison exercises the streaming
                used = max(len({e for l, es in store.routing_trace() if l == layer for e in es})
                           for layer in store.layouts)
                assert used > 2, (arch, store.routing_trace())
        finally:
            client.close()
    assert 0 < misses[0] <= misses[1], misses
    # the same chunks layer-major (infer.runtime.prefill), one expert a layer cached
    client = IodClient(dst, iod=str(daemon.socket))
    try:
        model, _, store = load_streaming(dst, client, one_layer)
        cache = make_prompt_cache(model)
        rest = prefill(model, store, PROMPT, cache, 4)
        steps = generate_step(mx.array(rest), model, max_tokens=N_TOKENS, prompt_cache=cache)
        assert [int(t) for t, _ in steps] == in_chunks, (arch, "layer-major prefill")
    finally:
        client.close()
    print(f"{arch}: {len(manifest.layers)} MoE layers ({manifest.layers[0].module}), misses {misses}")
