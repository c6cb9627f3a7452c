"""Layer-major prefill (infer.runtime.prefill): a prompt's chunks pass each
streamed layer in turn, give mlx-lm's greedy ids with the same chunks, and
read fewer records than the chunks one after another."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load as mlx_load

from infer.runtime import prefill as layer_major
from infer.runtime.loader import load_streaming
from iod.inproc import InprocSource
from tests.test_device_wait import ARCHS  # five architectures, one of each kind
from tests.test_streaming import PROMPT

STEP = 16  # tokens a chunk: more than a decode-sized call (no hints), a prompt of many chunks
LONG = " ".join([PROMPT] * 8)


def test_the_chunks_are_mlx_lms():
    """mlx-lm's generate_step: chunks of the step, the last token left."""
    assert layer_major.chunks(20, 8) == [(0, 8), (8, 16), (16, 19)]
    assert layer_major.chunks(17, 8) == [(0, 8), (8, 16)]
    assert layer_major.chunks(9, 8) == [(0, 8)]
    assert layer_major.chunks(1, 8) == []


def _greedy_after(model, store, ids, order, n=24):
    cache = make_prompt_cache(model)
    if order == "layer-major":
        rest = layer_major.prefill(model, store, ids, cache, STEP)
    else:
        rest = layer_major.prefill(model, None, ids, cache, STEP)
    return [int(t) for t, _ in generate_step(mx.array(rest), model, max_tokens=n, prompt_cache=cache)]


@pytest.mark.parametrize("arch,quant", [(arch, quant) for arch, quant, _ in ARCHS])
def test_layer_major_prefill_gives_mlx_lm_greedy_ids_and_reads_less(arch, quant, synth_model, prep_model):
    prep = prep_model(arch, quant=quant)
    ref, tokenizer = mlx_load(str(synth_model(arch, quant=quant)))
    ids = tokenizer.encode(LONG)
    assert len(layer_major.chunks(len(ids), STEP)) >= 4
    expected = [int(t) for t, _ in generate_step(mx.array(ids), ref, max_tokens=24, prefill_step_size=STEP)]
    read = {}
    for order in ("layer-major", "chunked"):
        source = InprocSource(prep, arena=64 << 20)
        try:
            model, _, store = load_streaming(prep, source, int(source.manifest.expert_bytes * 0.15),
                                             device_wait="off")
            store.reset()  # a cold cache: the prefill reads what it needs
            store.reset_stats()
            assert _greedy_after(model, store, ids, order) == expected, (arch, order)
            read[order] = store.stats["fetched_bytes"]
            assert (store.stats["prefill_kept"] > 0) == (order == "layer-major")
            assert store.lockstep is None and store.kept == {}
        finally:
            source.close()
    assert read["layer-major"] < read["chunked"], read


def test_a_model_that_reads_a_later_layers_cache_at_its_start(prep_model, monkeypatch):
    """qwen3_next makes its attention mask from its first full-attention
    layer's cache before any layer runs: a chunk that starts before the
    chunk ahead reached that layer meets a guard and starts again later."""
    prep = prep_model("qwen3_next")
    source = InprocSource(prep, arena=64 << 20)
    restarts = []
    step = layer_major.Lockstep._step

    def counting(self, c):
        ok = step(self, c)
        if not ok:
            restarts.append(c)
        return ok

    monkeypatch.setattr(layer_major.Lockstep, "_step", counting)
    try:
        model, tokenizer, store = load_streaming(prep, source, int(source.manifest.expert_bytes * 0.15),
                                                 device_wait="off")
        if model.model.fa_idx == 0:
            pytest.skip("this model's first layer has full attention")
        ids = tokenizer.encode(LONG)
        _greedy_after(model, store, ids, "layer-major", n=2)
    finally:
        source.close()
    assert restarts and 0 not in restarts
