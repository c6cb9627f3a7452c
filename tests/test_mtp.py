"""Qwen3-Next's MTP head: loading, streamed experts, and the drafter's cache."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from infer.runtime.loader import load_streaming
from infer.spec.mtp import MTPDrafter, MTPError, _hf_norms, has_mtp, load_mtp
from iod.inproc import InprocSource
from shared.blob import Manifest


class CountingSource(InprocSource):
    def __init__(self, model_dir):
        super().__init__(model_dir, arena=64 << 20)
        self.layers = []

    def fetch_into(self, layer, experts, sink):
        self.layers.append(layer)
        return super().fetch_into(layer, experts, sink)


@pytest.fixture(scope="module")
def nxt(prep_model):
    prep = prep_model("qwen3_next")
    source = CountingSource(prep)
    model, _, store = load_streaming(prep, source, cache_bytes=1 << 16)
    head = load_mtp(prep, model, store, Manifest.load(prep))
    yield prep, model, store, source, head
    source.close()


def test_has_mtp(prep_model, synth_model):
    assert has_mtp(prep_model("qwen3_next"))
    assert has_mtp(synth_model("qwen3_next"))
    assert not has_mtp(prep_model("qwen3_moe"))


def test_load_refuses_model_without_mtp(prep_model):
    prep = prep_model("qwen3_moe")
    with pytest.raises(MTPError, match="no MTP head"):
        load_mtp(prep, None)


def test_mtp_experts_stream_through_the_store(nxt):
    prep, model, store, source, head = nxt
    n_layers = len(model.layers)
    man = Manifest.load(prep)
    assert any(l.layer == n_layers and l.module.startswith("mtp.") for l in man.layers)
    assert type(head.layers[0].mlp.switch_mlp).__name__ == "StreamingExperts"
    source.layers.clear()
    d = MTPDrafter(head, model)
    d.observe(mx.random.normal((1, 3, model.args.hidden_size)), [4, 5, 6])
    assert len(d.propose(2)) == 2
    assert source.layers and set(source.layers) == {n_layers}


def test_streamed_head_equals_resident_head(nxt, synth_model):
    """Experts from the blob give the same head output as the synth folder's
    resident experts (the same weights, loaded whole)."""
    from mlx_lm.utils import load_model

    prep, model, store, _, head = nxt
    src_model, _ = load_model(synth_model("qwen3_next"))
    resident = load_mtp(synth_model("qwen3_next"), src_model)
    h = mx.random.normal((1, 5, model.args.hidden_size), key=mx.random.key(1))
    e = model.model.embed_tokens(mx.array([[3, 9, 27, 81, 243]]))
    a = head(h, e, [KVCache()])
    b = resident(h, e, [KVCache()])
    assert np.array_equal(np.array(a), np.array(b))


def test_drafter_cache_equals_from_scratch(nxt):
    """Drafting, trimming its speculative entries and observing the real
    tokens leaves the head's cache as if it had only seen the real pairs."""
    _, model, _, _, head = nxt
    H = model.args.hidden_size
    hs = mx.random.normal((1, 9, H), key=mx.random.key(2))
    toks = [11, 12, 13, 14, 15, 16, 17, 18, 19]

    d = MTPDrafter(head, model)
    d.observe(hs[:, :4], toks[:4])
    first = d.propose(3)  # 2 speculative entries
    d.observe(hs[:, 4:6], toks[4:6])
    d.propose(2)
    d.observe(hs[:, 6:9], toks[6:9])
    got = d.propose(3)

    ref = MTPDrafter(head, model)
    ref.observe(hs, toks)
    want = ref.propose(3)
    assert got == want
    k1, k2 = d.cache[0], ref.cache[0]
    assert k1.offset == k2.offset
    np.testing.assert_allclose(np.array(k1.keys[..., : k1.offset - 2, :]),
                               np.array(k2.keys[..., : k2.offset - 2, :]), rtol=1e-5, atol=1e-6)
    assert len(first) == 3


def test_norm_convention():
    assert not _hf_norms({}, {"format": "mlx"})
    assert _hf_norms({}, {"format": "pt"})
    assert _hf_norms({}, {})
    assert not _hf_norms({}, {"norms": "mlx", "format": "pt"})


def test_drafter_backlog_is_bounded(nxt):
    """Positions observed without a proposal (plain decoding under --draft
    auto) wait up to MAX_BACKLOG; beyond, the head restarts on the recent
    ones: a proposal then equals a fresh head's over just those."""
    _, model, _, _, head = nxt
    H = model.args.hidden_size
    n = MTPDrafter.MAX_BACKLOG
    hs = mx.random.normal((1, 3 * n, H), key=mx.random.key(3))
    toks = list(range(20, 20 + 3 * n))
    d = MTPDrafter(head, model)
    d.observe(hs[:, :2], toks[:2])
    d.propose(1)  # the head has seen two positions
    for i in range(2, 3 * n):  # then one position a step, never proposing
        d.observe(hs[:, i : i + 1], toks[i : i + 1])
        assert d.backlog <= n
    assert d.backlog == n and d.cache[0].offset == 0  # restarted
    ref = MTPDrafter(head, model)
    ref.observe(hs[:, -n:], toks[-n:])
    assert d.propose(2) == ref.propose(2)
