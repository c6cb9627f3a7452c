"""Model configs for `infer synth`: presets (sizes) and per-architecture config.json."""

import copy

ARCHS = ("qwen3_moe", "qwen3_next", "mixtral", "gpt_oss", "deepseek_v3")

# Generic sizes, mapped onto each architecture by `make_config`.
# experts/top_k = 16 as in Qwen3-30B-A3B, so an LRU of 1/8 of the experts
# holds two tokens' worth.
SIZES = {
    "tiny": dict(
        hidden=128, layers=4, experts=32, top_k=2, moe_inter=64, inter=256,
        heads=4, kv_heads=2, head_dim=32, vocab=1024,
    ),
    "small": dict(
        hidden=1024, layers=16, experts=128, top_k=8, moe_inter=384, inter=2048,
        heads=16, kv_heads=4, head_dim=64, vocab=4096,
    ),
}

# Real dimensions, from the models' Hugging Face config.json.
REAL = {
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "decoder_sparse_step": 1,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 6144,
        "max_position_embeddings": 40960,
        "max_window_layers": 48,
        "mlp_only_layers": [],
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "num_attention_heads": 32,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 48,
        "num_key_value_heads": 4,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    "qwen3-next-80b-a3b": {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "decoder_sparse_step": 1,
        "eos_token_id": 151645,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 5120,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 128,
        "max_position_embeddings": 262144,
        "mlp_only_layers": [],
        "moe_intermediate_size": 512,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "norm_topk_prob": True,
        "num_attention_heads": 16,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "num_hidden_layers": 48,
        "num_key_value_heads": 2,
        "output_router_logits": False,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 10000000,
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 512,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": 151936,
    },
}

PRESETS = tuple(SIZES) + tuple(REAL)


def make_config(arch: str, preset: str, layers=None) -> dict:
    """config.json for ``arch`` at ``preset`` (without quantization / dtype)."""
    if preset in REAL:
        c = copy.deepcopy(REAL[preset])
        if arch is not None and arch != c["model_type"]:
            raise ValueError(f"preset {preset} is a {c['model_type']} model, not {arch}")
    else:
        s = dict(SIZES[preset])
        c = globals()[f"_{arch}"](s)
    if layers is not None:
        c["num_hidden_layers"] = layers
        if c["model_type"] == "gpt_oss":
            c["layer_types"] = c["layer_types"][:layers]
        if c["model_type"] == "qwen3_moe" and "max_window_layers" in c:
            c["max_window_layers"] = layers
    return c


def _qwen_common(s):
    return {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "decoder_sparse_step": 1,
        "eos_token_id": 2,
        "head_dim": s["head_dim"],
        "hidden_act": "silu",
        "hidden_size": s["hidden"],
        "initializer_range": 0.02,
        "intermediate_size": s["inter"],
        "max_position_embeddings": 32768,
        "mlp_only_layers": [],
        "moe_intermediate_size": s["moe_inter"],
        "norm_topk_prob": True,
        "num_attention_heads": s["heads"],
        "num_experts": s["experts"],
        "num_experts_per_tok": s["top_k"],
        "num_hidden_layers": s["layers"],
        "num_key_value_heads": s["kv_heads"],
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "vocab_size": s["vocab"],
    }


def _qwen3_moe(s):
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **_qwen_common(s)}


def _qwen3_next(s):
    c = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", **_qwen_common(s)}
    c.update(
        full_attention_interval=4,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=s["head_dim"],
        linear_num_key_heads=s["kv_heads"],
        linear_num_value_heads=s["heads"],
        linear_value_head_dim=s["head_dim"],
        partial_rotary_factor=0.25,
        shared_expert_intermediate_size=s["moe_inter"],
        mtp_num_hidden_layers=1,
        mtp_use_dedicated_embeddings=False,
    )
    return c


def _mixtral(s):
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": s["hidden"],
        "initializer_range": 0.02,
        "intermediate_size": s["moe_inter"],
        "max_position_embeddings": 32768,
        "num_attention_heads": s["heads"],
        "num_experts_per_tok": s["top_k"],
        "num_hidden_layers": s["layers"],
        "num_key_value_heads": s["kv_heads"],
        "num_local_experts": s["experts"],
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "vocab_size": s["vocab"],
    }


def _gpt_oss(s):
    n = s["layers"]
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "attention_bias": True,
        "attention_dropout": 0.0,
        "eos_token_id": 2,
        "experts_per_token": s["top_k"],
        "head_dim": s["head_dim"],
        "hidden_act": "silu",
        "hidden_size": s["hidden"],
        "initial_context_length": 4096,
        "initializer_range": 0.02,
        "intermediate_size": s["moe_inter"],
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
        "max_position_embeddings": 131072,
        "num_attention_heads": s["heads"],
        "num_experts_per_tok": s["top_k"],
        "num_hidden_layers": n,
        "num_key_value_heads": s["kv_heads"],
        "num_local_experts": s["experts"],
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 150000,
        "router_aux_loss_coef": 0.9,
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "vocab_size": s["vocab"],
    }


def _deepseek_v3(s):
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "attention_bias": False,
        "bos_token_id": None,
        "eos_token_id": 2,
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "hidden_size": s["hidden"],
        "intermediate_size": s["inter"],
        "kv_lora_rank": 64,
        "max_position_embeddings": 32768,
        "moe_intermediate_size": s["moe_inter"],
        "moe_layer_freq": 1,
        "n_group": 1,
        "n_routed_experts": s["experts"],
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": s["heads"],
        "num_experts_per_tok": s["top_k"],
        "num_hidden_layers": s["layers"],
        "num_key_value_heads": s["heads"],
        "q_lora_rank": 128,
        "qk_nope_head_dim": s["head_dim"],
        "qk_rope_head_dim": 32,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "tie_word_embeddings": False,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "v_head_dim": s["head_dim"],
        "vocab_size": s["vocab"],
    }
