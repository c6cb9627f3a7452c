"""Streaming experts give exactly mlx-lm's greedy tokens, whatever the cache size."""

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_load
from mlx_lm.generate import generate_step

from infer.loader import load_streaming
from iod.inproc import InprocSource
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
        source = InprocSource(prep, arena=64 << 20)
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
    source = InprocSource(prep, arena=64 << 20)
    model, tokenizer, store = load_streaming(prep, source, 0)
    greedy(model, tokenizer.encode(PROMPT), n=8)
    stats = store.prediction_stats()
    assert set(stats) == {1, 2, 3}  # the default depth
    for row in stats.values():
        assert 0.0 <= row["recall"] <= 1.0 and 0.0 < row["precision"] <= 1.0
    source.close()


def _batch(layout, values):
    """A Batch of records whose every uint32 word is the record's value."""
    import numpy as np

    from shared.source import Batch

    n = layout.record_bytes // 4
    buf = np.concatenate([np.full(n, v, dtype=np.uint32) for v in values]).view(np.uint8)
    return Batch(memoryview(buf), list(values), [i * layout.record_bytes for i in range(len(values))],
                 [layout.record_bytes] * len(values))


def _insert(stack, layout, e, keep=()):
    pos = stack.assign([e], set(keep) | {e})[e]
    if pos is not None:
        stack.copy_in(_batch(layout, [e]), [pos])
    return pos is not None


def test_stack_evicts_least_recently_used_in_place():
    layout = plan_layer(0, "m", [("fc1", "weight", "uint32", (4, 2), 4, 8)])
    stack = LayerStack(layout, capacity=3)
    for e in range(3):
        assert _insert(stack, layout, e)
    stack.touch(0)  # 0 becomes most recent; 1 is now the LRU one
    assert _insert(stack, layout, 3)
    assert 1 not in stack and all(e in stack for e in (0, 2, 3))
    weights = stack.arrays[("fc1", "weight")]
    for e in (0, 2, 3):
        assert (weights[stack.position[e]] == e).all().item()
    # experts the current call needs are never evicted
    assert not _insert(stack, layout, 4, keep={0, 2, 3})
    assert 4 not in stack


def test_stack_copies_a_batch_in_one_go_and_keeps_identity_positions():
    layout = plan_layer(0, "m", [("fc1", "weight", "uint32", (4, 2), 4, 4),
                                 ("fc1", "scales", "uint32", (2,), 4, 4)])
    stack = LayerStack(layout, capacity=4)  # holds every expert: expert e at position e
    assert stack.identity and not stack.complete
    batch = _batch(layout, [3, 1])
    places = stack.assign(batch.experts, keep={3, 1})
    positions = [places[e] for e in batch.experts]
    assert positions == [3, 1]
    stack.copy_in(batch, positions)
    for key in stack.arrays:
        for e in (1, 3):
            assert (stack.arrays[key][e] == e).all().item(), key
        assert (stack.arrays[key][0] == 0).all().item()
    for e in (0, 2):
        stack.copy_in(_batch(layout, [e]), [stack.assign([e], keep={e})[e]])
    assert stack.complete
