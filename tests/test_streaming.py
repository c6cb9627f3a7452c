"""Streaming experts give exactly mlx-lm's greedy tokens, whatever the cache size."""

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_load
from mlx_lm.generate import generate_step

from infer.loader import load_streaming
from infer.sources import SyncSource
from infer.streaming import LayerStack
from shared.blob import plan_layer

ARCHS = [
    ("qwen3_moe", "affine4"),
    ("qwen3_moe", "affine8"),
    ("qwen3_next", "affine4"),
    ("mixtral", "affine4"),
    ("gpt_oss", "mxfp4"),
    ("deepseek_v3", "affine4"),
]
N_TOKENS = 64
PROMPT = "The lighthouse keeper counted the ships: one, two, three"


def greedy(model, ids, n=N_TOKENS):
    prompt = mx.array(ids)
    return [int(t) for t, _ in generate_step(prompt, model, max_tokens=n)]


@pytest.fixture(scope="module")
def references():
    return {}


@pytest.mark.parametrize("arch,quant", ARCHS)
def test_greedy_ids_equal_mlx_lm(arch, quant, synth_model, prep_model, references):
    src = synth_model(arch, quant=quant)
    prep = prep_model(arch, quant=quant)
    ref_model, tokenizer = mlx_load(str(src))
    ids = tokenizer.encode(PROMPT)
    expected = greedy(ref_model, ids)
    del ref_model

    expert_bytes = None
    for cache_fraction in (1.0, 0.15, 0.0):
        source = SyncSource(prep)
        if expert_bytes is None:
            expert_bytes = source.manifest.expert_bytes
        model, _, store = load_streaming(prep, source, int(expert_bytes * cache_fraction))
        got = greedy(model, ids)
        source.close()
        assert got == expected, f"{arch} cache {cache_fraction}"
        if cache_fraction == 0.0:
            # a cache that holds only the current layer misses nearly always
            assert store.stats["misses"] > store.stats["hits"]
        elif cache_fraction == 1.0:
            # a cache that holds every expert reads each at most once
            assert store.stats["misses"] <= sum(l.num_experts for l in source.manifest.layers)


def test_prediction_is_scored_per_depth(synth_model, prep_model):
    prep = prep_model("qwen3_moe")
    source = SyncSource(prep)
    model, tokenizer, store = load_streaming(prep, source, 0)
    greedy(model, tokenizer.encode(PROMPT), n=8)
    stats = store.prediction_stats()
    assert set(stats) == {1, 2}
    for row in stats.values():
        assert 0.0 <= row["recall"] <= 1.0 and 0.0 < row["precision"] <= 1.0
    source.close()


def _expert(layout, value):
    return {
        (seg.projection, seg.tensor): mx.full(seg.shape, value, dtype=mx.uint32)
        for seg in layout.segments
    }


def test_stack_evicts_least_recently_used_in_place():
    layout = plan_layer(0, "m", [("fc1", "weight", "uint32", (4, 2), 4, 8)])
    stack = LayerStack(layout, capacity=3)
    for e in range(3):
        assert stack.insert(e, _expert(layout, e), keep=())
    stack.touch(0)  # 0 becomes most recent; 1 is now the LRU one
    assert stack.insert(3, _expert(layout, 3), keep=())
    assert 1 not in stack and all(e in stack for e in (0, 2, 3))
    weights = stack.arrays[("fc1", "weight")]
    for e in (0, 2, 3):
        assert (weights[stack.position[e]] == e).all().item()
    # experts the current call needs are never evicted
    assert not stack.insert(4, _expert(layout, 4), keep={0, 2, 3})
    assert 4 not in stack
