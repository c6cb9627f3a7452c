"""The device wait (infer.runtime.device): decode calls find their experts on
the GPU and wait there for misses, and give exactly mlx-lm's greedy ids.
MLX CUDA only; elsewhere the load leaves it off and every call syncs (the
rest of the suite)."""

import time

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_load
from mlx_lm.generate import generate_step

from infer.runtime.loader import load_streaming
from iod.inproc import InprocSource

CUDA = mx.cuda.is_available()
ARCHS = [
    ("qwen3_moe", "affine4"),
    ("qwen3_next", "affine4"),
    ("mixtral", "affine4"),
    ("gpt_oss", "mxfp4"),
    ("deepseek_v3", "affine4"),
]
PROMPT = "The lighthouse keeper counted the ships: one, two, three"
N_TOKENS = 48


def greedy(model, ids, n=N_TOKENS):
    return [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=n)]


def test_the_device_wait_is_off_where_the_backend_has_none(prep_model):
    if CUDA:
        pytest.skip("this machine has MLX CUDA")
    prep = prep_model("qwen3_moe")
    source = InprocSource(prep, arena=64 << 20)
    try:
        _, _, store = load_streaming(prep, source, 1 << 20)
        assert store.device is None
    finally:
        source.close()


@pytest.mark.skipif(not CUDA, reason="MLX CUDA only")
@pytest.mark.parametrize("arch,quant", ARCHS)
def test_device_wait_gives_mlx_lm_greedy_ids(arch, quant, synth_model, prep_model):
    src = synth_model(arch, quant=quant)
    prep = prep_model(arch, quant=quant)
    ref, tokenizer = mlx_load(str(src))
    ids = tokenizer.encode(PROMPT)
    expected = greedy(ref, ids)
    del ref
    for fraction in (0.15, 0.5):
        for device_wait in (True, False):
            source = InprocSource(prep, arena=64 << 20)
            try:
                model, _, store = load_streaming(prep, source,
                                                 int(source.manifest.expert_bytes * fraction),
                                                 device_wait=device_wait)
                assert (store.device is not None) == device_wait
                assert greedy(model, ids) == expected, f"{arch} {fraction} device wait {device_wait}"
                assert (store.stats["device_calls"] > 0) == device_wait
                assert store.stats["misses"] > 0
            finally:
                source.close()


@pytest.mark.skipif(not CUDA, reason="MLX CUDA only")
def test_a_failed_miss_releases_the_gpu_and_the_session_goes_on(synth_model, prep_model):
    """A source that fails while the GPU waits: the forward raises at once
    (no kernel left waiting out its timeout), and the next forwards, their
    misses served, give the right ids again."""
    src = synth_model("qwen3_moe")
    prep = prep_model("qwen3_moe")
    ref, tokenizer = mlx_load(str(src))
    ids = tokenizer.encode(PROMPT)
    expected = greedy(ref, ids)
    source = InprocSource(prep, arena=64 << 20)
    try:
        model, _, store = load_streaming(prep, source, int(source.manifest.expert_bytes * 0.15))
        serve, failures = store.serve_device, [0]

        def failing(layer, stack, posted):
            if failures[0] == 0 and any(e not in stack for e in posted):
                failures[0] += 1
                raise OSError("the disk went away")
            return serve(layer, stack, posted)

        store.serve_device = failing
        t0 = time.monotonic()
        with pytest.raises(OSError, match="went away"):
            greedy(model, ids)
        mx.synchronize()
        assert time.monotonic() - t0 < store.device.timeout_s / 2
        assert not store.device.mail[1]  # no kernel timed out
        store.reset()  # a cold cache: the failed call's stack is rebuilt
        assert greedy(model, ids) == expected
    finally:
        source.close()
