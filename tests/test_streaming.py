"""Streaming experts give exactly mlx-lm's greedy tokens, whatever the cache size."""

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_load
from mlx_lm.generate import generate_step

from infer.loader import load_streaming
from infer.sources import SyncSource
from infer.streaming import ExpertCache

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
    for cache_fraction in (1.0, 0.0):
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
        else:
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


def test_cache_evicts_least_recently_used():
    cache = ExpertCache(capacity_bytes=30)
    for e in range(3):
        cache.put((0, e), {"e": e}, 10)
    assert cache.lookup((0, 0)) == {"e": 0}  # 0 becomes most recent
    cache.put((0, 3), {"e": 3}, 10)
    assert (0, 1) not in cache and (0, 0) in cache and (0, 3) in cache
    # entries the current call needs are kept even past capacity
    cache.put((0, 4), {"e": 4}, 10, keep=[(0, 0), (0, 2), (0, 3)])
    assert all((0, e) in cache for e in (0, 2, 3, 4))
    assert cache.nbytes == 40
