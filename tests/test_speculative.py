"""Speculative decoding: exact against greedy decoding, rollback, drafters,
--draft auto, and `infer bench --draft` / `infer run --draft` end to end."""

import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ArraysCache
from mlx_lm.utils import load_model

from infer.runtime.loader import load_streaming
from infer.spec.ngram import NgramDrafter
from iod.inproc import InprocSource
from infer.spec.rowwise import RowwisePass
from infer.spec.policy import AutoPolicy
from infer.spec.decoder import (
    CacheCheckpoint,
    Wavefront,
    _Forward,
    make_cache,
    mismatch_rows,
    speculative_generate,
)

# a repetitive prompt (n-gram drafting finds matches) and a free one
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7],
    [101, 57, 300, 12, 999, 4, 77, 250, 31, 8, 640, 19, 3],
]
N = 128


def greedy(model, prompt, n=N):
    return [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


def spec(model, prompt, n=N, **kw):
    out, stats = [], None
    for t, stats in speculative_generate(model, prompt, max_tokens=n, **kw):
        out.append(t)
    return out, stats


class CountingSource(InprocSource):
    """An in-process source that remembers which layers it was asked for, per call."""

    def __init__(self, model_dir):
        super().__init__(model_dir, arena=64 << 20)
        self.calls = []

    def fetch_into(self, layer, experts, sink):
        self.calls.append((layer, len(experts)))
        return super().fetch_into(layer, experts, sink)


@pytest.fixture(scope="module")
def moe(synth_model, prep_model):
    src = synth_model("qwen3_moe")
    prep = prep_model("qwen3_moe")
    source = CountingSource(prep)
    # a cache of a few experts: nearly every lookup is a read
    model, _, store = load_streaming(prep, source, cache_bytes=1 << 16)
    yield src, prep, model, store, source
    source.close()


@pytest.fixture(scope="module")
def nxt(synth_model, prep_model):
    src = synth_model("qwen3_next")
    prep = prep_model("qwen3_next")
    source = CountingSource(prep)
    model, _, store = load_streaming(prep, source, cache_bytes=1 << 16, mtp_cache=True)
    yield src, prep, model, store, source
    source.close()


# -- exactness -----------------------------------------------------------------


@pytest.mark.parametrize("prompt", range(len(PROMPTS)))
def test_ngram_exact_qwen3_moe(moe, prompt):
    src, _, model, store, _ = moe
    p = PROMPTS[prompt]
    ref = greedy(model, p)
    # the streaming model agrees with mlx-lm on the source model
    assert ref == greedy(load_model(src)[0], p)
    for k in (1, 2, 3, 4):
        out, stats = spec(model, p, draft="ngram", num_draft=k, store=store)
        assert out == ref, f"K={k}"
        assert stats.committed == N and stats.passes < N
    assert stats.drafted > 0


@pytest.mark.parametrize("prompt", range(len(PROMPTS)))
def test_mtp_exact_qwen3_next(nxt, prompt):
    from infer.spec.mtp import MTPDrafter, load_mtp
    from shared.blob import Manifest

    src, prep, model, store, _ = nxt
    p = PROMPTS[prompt]
    ref = greedy(model, p)
    assert ref == greedy(load_model(src)[0], p)
    head = load_mtp(prep, model, store, Manifest.load(prep))
    # the n-gram matrix covers every K on both prompts; MTP drafting is slow
    # on a loaded 2-core machine, so the second prompt takes two of them
    for k in (1, 2, 3, 4) if prompt == 0 else (2, 4):
        out, stats = spec(model, p, draft="mtp", num_draft=k, store=store,
                          mtp=MTPDrafter(head, model))
        assert out == ref, f"K={k}"
        assert stats.drafted > 0


class OracleDrafter:
    """Proposes the true continuation, wrong from a chosen draft position on,
    so every acceptance length 0..K is exercised."""

    needs_hidden = False

    def __init__(self, truth, k, prompt_len):
        self.truth, self.k = truth, k
        self.done = -prompt_len  # the first observe is the prompt and 1st token
        self.calls = 0

    def observe(self, hidden, tokens):
        self.done += len(tokens)

    def propose(self, k):
        self.calls += 1
        right = self.calls % (self.k + 1)  # 0..K correct drafts, then wrong ones
        out = []
        for i in range(k):
            t = self.truth[self.done + i] if self.done + i < len(self.truth) else 0
            out.append(t if i < right else (t + 1) % 1000)
        return out


@pytest.mark.parametrize("verify", ["exact", "rowwise", "batched"])
def test_every_acceptance_length_qwen3_next(nxt, verify):
    """Full, partial and no acceptance, in the lockstep, the row-wise and the
    batched verify (the batched one is exact on MLX CPU as measured; see
    docs/speculative.md). The row-wise one rolls the recurrent state back
    exactly, so it never feeds accepted tokens again, as the lockstep."""
    _, _, model, store, _ = nxt
    p = PROMPTS[1]
    ref = greedy(model, p, 64)
    for k in (1, 3):
        drafter = OracleDrafter(ref, k, len(p))
        out, stats = spec(model, p, 64, draft="ngram", num_draft=k, store=store,
                          verify=verify, drafter=drafter)
        assert out == ref
        assert set(stats.accept_lens) == set(range(k + 1))
        assert stats.verify == verify
        if verify == "batched":  # the recurrent state is fed the accepted tokens again
            assert stats.fed > stats.passes + stats.drafted
        else:
            assert stats.fed == stats.passes + stats.drafted


def test_verify_fetches_union_once(moe):
    """The lockstep verify asks the source once per MoE layer for the whole batch."""
    _, _, model, store, source = moe
    p = PROMPTS[0]
    n_layers = len(model.layers)
    drafter = OracleDrafter(greedy(model, p, 16), 3, len(p))
    source.calls.clear()
    out, stats = spec(model, p, 16, draft="ngram", num_draft=3, store=store, drafter=drafter)
    # prefill (2 passes) + one call per layer per decode pass at most
    assert len(source.calls) <= n_layers * (2 + stats.passes)
    assert stats.fed > stats.committed - 1  # drafts were verified
    calls, fetched, asked = stats.union
    assert calls > 0 and 0 < fetched <= asked
    # the row-wise pass fetches the same unions, counted the same way
    out, rw = spec(model, p, 16, draft="ngram", num_draft=3, store=store, verify="rowwise",
                   drafter=OracleDrafter(greedy(model, p, 16), 3, len(p)))
    assert rw.union[0] > 0 and 0 < rw.union[1] <= rw.union[2]


# -- rollback ------------------------------------------------------------------


def _states(cache):
    out = []
    for c in cache:
        if isinstance(c, ArraysCache):
            out.append([np.array(a) for a in c.cache])
        else:
            k, v = c.state[0], c.state[1]
            out.append([c.offset, np.array(k[..., : c.offset, :]), np.array(v[..., : c.offset, :])])
    return out


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert len(x) == len(y)
        for u, v in zip(x, y):
            if isinstance(u, int):
                assert u == v
            else:
                assert u.shape == v.shape and np.array_equal(u, v)


@pytest.mark.parametrize("keep", [1, 2, 4])
def test_rollback_matches_fresh_run(nxt, keep):
    """After verifying 4 tokens and keeping `keep`, every cache array equals
    that of a run that only ever saw the kept tokens, one at a time."""
    _, _, model, store, _ = nxt
    prompt, fed = PROMPTS[1], [17, 230, 5, 900, 64]
    fwd = _Forward(model, want_hidden=False)

    def prefill():
        cache = make_cache(model)
        fwd(mx.array(prompt)[None], cache)
        mx.eval([c.state for c in cache])
        return cache

    fresh = prefill()
    for t in fed[:keep]:
        fwd(mx.array([[t]]), fresh)
    mx.eval([c.state for c in fresh])

    # lockstep verify (one-token passes): rolled back in place
    cache = prefill()
    ckpt = CacheCheckpoint(cache)
    Wavefront(fwd, store).run(fed, cache)
    assert ckpt.rollback(keep)
    ckpt.stop()
    _assert_same(_states(cache), _states(fresh))

    # row-wise verify (one batched pass, rows as one-token passes): rolled
    # back in place to the same bits, the recurrent state included
    cache = prefill()
    ckpt = CacheCheckpoint(cache)
    with RowwisePass(model):
        fwd(mx.array(fed)[None], cache)
    assert ckpt.rollback(keep)
    ckpt.stop()
    _assert_same(_states(cache), _states(fresh))

    # batched verify: back to the checkpoint, the kept tokens fed again
    cache = prefill()
    ckpt = CacheCheckpoint(cache)
    fwd(mx.array(fed)[None], cache)
    assert not ckpt.rollback(keep)
    ckpt.stop()
    fwd(mx.array(fed[:keep])[None], cache)
    for x, y in zip(_states(cache), _states(fresh)):
        for u, v in zip(x, y):
            np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6)

    # and the next step gives the same logits as the fresh run's
    a = fwd(mx.array([[33]]), fresh)[0]
    cache = prefill()
    ckpt = CacheCheckpoint(cache)
    Wavefront(fwd, store).run(fed, cache)
    ckpt.rollback(keep)
    ckpt.stop()
    assert np.array_equal(np.array(fwd(mx.array([[33]]), cache)[0]), np.array(a))


@pytest.mark.parametrize("arch,dtype,batched_attention", [
    ("qwen3_moe", None, "probed"), ("qwen3_moe", None, "off"), ("qwen3_next", None, "probed"),
    ("qwen3_next", "bfloat16", "probed"), ("qwen3_next", "bfloat16", "off")])
def test_rowwise_rows_equal_one_token_steps(prep_model, arch, dtype, batched_attention, monkeypatch):
    """A row-wise pass's logits are the one-token steps' bits (on this CPU the
    plain batched pass is too, for these archs: docs/speculative.md), in
    bfloat16 too (compared through float32, which holds it exactly), with
    attention in one call where the probe allows it and row by row; a model
    whose attention takes another path for several rows (deepseek_v3's
    absorbed MLA) is refused, not computed inexactly."""
    from infer.spec import rowwise

    if batched_attention == "off":
        monkeypatch.setattr(rowwise, "batch_is_rows", lambda *a: False)
    prep = prep_model(arch)
    source = InprocSource(prep, arena=64 << 20)
    model, _, _ = load_streaming(prep, source, cache_bytes=1 << 18,
                                 dtype=getattr(mx, dtype) if dtype else None)
    for k in (1, 3):
        rows, differ, ids, _ = mismatch_rows(model, PROMPTS[1], 24, k, "rowwise")
        assert rows == 24 and differ == 0 and ids == 0
    source.close()


def test_rowwise_attention_probe_refuses_a_kernel_that_depends_on_the_rows():
    from infer.spec import rowwise

    sdpa = mx.fast.scaled_dot_product_attention

    def by_rows(q, k, v, *args, scale, mask=None, **kw):  # each row alone
        return rowwise._rows_alone(sdpa, q, k, v, scale=scale)

    def skewed(q, k, v, *args, scale, mask=None, **kw):  # one bit off in a batch
        out = by_rows(q, k, v, scale=scale)
        return out if q.shape[2] == 1 else out * (1 + 2.0**-20)

    def late(q, k, v, *args, scale, mask=None, **kw):  # another kernel past 1024 keys
        return skewed(q, k, v, scale=scale) if k.shape[2] > 1024 else by_rows(q, k, v, scale=scale)

    assert rowwise.batch_is_rows(by_rows, 3, mx.float32, 4, 2, 32, 0.17)
    assert not rowwise.batch_is_rows(skewed, 3, mx.float32, 4, 2, 32, 0.17)
    assert not rowwise.batch_is_rows(late, 3, mx.float32, 4, 2, 32, 0.17)


def test_a_rowwise_pass_touches_only_its_own_objects_and_thread(prep_model):
    """While a pass runs: another model's gated-delta layers and convolutions
    keep their classes, and attention in another thread is mlx's own (an
    explicit mask, which the pass refuses, works there); after it, the
    pass's own objects are back to their classes."""
    import threading

    import mlx.nn as nn

    from infer.spec import rowwise

    prep = prep_model("qwen3_next")
    model, _ = load_model(prep, lazy=True, strict=False)
    other, _ = load_model(prep, lazy=True, strict=False)
    mine, theirs = rowwise._gated_delta_layers(model), rowwise._gated_delta_layers(other)
    assert mine and theirs
    classes = [(type(m), type(m.conv1d)) for m in mine]
    q = mx.random.normal((1, 2, 3, 16))
    k = v = mx.random.normal((1, 2, 5, 16))
    mask = mx.zeros((3, 5))
    mx.eval(q, k, v, mask)  # (a lazy array is evaluated in the stream of the thread that made it)
    elsewhere = {}

    def attend():
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
        elsewhere["out"] = np.array(out)  # evaluated in its own thread's stream

    with RowwisePass(model):
        assert all(type(m) is not c and isinstance(m, c) for m, (c, _) in zip(mine, classes))
        assert all(type(m.conv1d) is not c for m, (_, c) in zip(mine, classes))
        assert {type(m) for m in theirs} == {c for c, _ in classes}
        assert all(type(m.conv1d) is nn.Conv1d for m in theirs)
        with pytest.raises(rowwise.RowwiseUnsupported):
            mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
        t = threading.Thread(target=attend)
        t.start()
        t.join()
    assert elsewhere["out"].shape == q.shape
    assert [(type(m), type(m.conv1d)) for m in mine] == classes
    same = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    assert np.array_equal(np.array(same), elsewhere["out"])


def test_rowwise_refuses_and_falls_back(prep_model):
    prep = prep_model("deepseek_v3")
    source = InprocSource(prep, arena=64 << 20)
    model, _, store = load_streaming(prep, source, cache_bytes=1 << 18)
    assert mismatch_rows(model, PROMPTS[1], 8, 1, "rowwise")[1] is None
    ref = greedy(model, PROMPTS[0], 24)
    out, stats = spec(model, PROMPTS[0], 24, draft="ngram", num_draft=2, store=store,
                      verify="rowwise", drafter=OracleDrafter(ref, 2, len(PROMPTS[0])))
    source.close()
    assert out == ref and stats.verify == "exact" and stats.draft_passes > 0


# -- drafters and policy -------------------------------------------------------


def test_ngram_drafter():
    d = NgramDrafter(max_n=3)
    d.observe(None, [1, 2, 3, 4, 9, 9, 2, 3])
    assert d.propose(2) == [4, 9]  # "2 3" was followed by "4 9"
    d.observe(None, [7])
    assert d.propose(3) == []  # 7 never seen before
    d.observe(None, [1, 2])
    assert d.propose(4) == [3, 4, 9, 9]
    assert d.propose(0) == []


def test_ngram_drafter_repeats_a_repetition_past_the_history():
    # a match ending just before the end is a repetition of that period: the
    # draft goes on repeating it (an overlapping copy), K tokens in all
    d = NgramDrafter(max_n=3)
    d.observe(None, [5, 1, 2, 1, 2, 1, 2])
    assert d.propose(5) == [1, 2, 1, 2, 1]
    d = NgramDrafter(max_n=3)
    d.observe(None, [4, 7, 7, 7, 7])
    assert d.propose(3) == [7, 7, 7]
    d = NgramDrafter(max_n=2)
    d.observe(None, [8, 1, 2, 3, 1, 2])
    assert d.propose(6) == [3, 1, 2, 3, 1, 2]


def _drive(policy, truth, plain_s, verify_s, steps=200, accept=True, after_pass=None):
    """Runs the policy over a token sequence as the decoder would, with
    scripted costs: a plain step takes ``plain_s``, a verify pass of k
    drafts ``verify_s(k)``; the shadow proposals are the truth, and the real
    drafts are all right (``accept``) or all wrong. ``after_pass(probe)`` is
    called after each verify pass. Returns the decode time and the tokens
    committed."""
    pos, t = 0, 0.0
    policy.tokens(truth[:1])
    pos = 1
    while pos < steps:
        action = policy.next(steps - pos)
        if action[0] == "plain":
            for _ in range(action[1]):
                policy.shadow("ngram", truth[pos : pos + policy.k_max], 0.0)
                policy.tokens(truth[pos : pos + 1])
                pos += 1
            policy.plain(plain_s * action[1], action[1])
            t += plain_s * action[1]
        else:
            _, name, k, probe = action
            # every draft right and the target's token, or the target's token only
            new = truth[pos : pos + k + 1] if accept else truth[pos : pos + 1]
            policy.tokens(new)
            pos += len(new)
            dt = verify_s(k)
            policy.draft_pass(name, k, len(new) - 1, dt, 0.0, len(new), probe)
            t += dt
            if after_pass is not None:
                after_pass(probe)
    return t, pos


REPEATING = [i % 7 for i in range(400)]


def test_auto_policy_drafts_where_a_verify_pass_is_cheap():
    # a GPU-like verify: K+1 tokens for little more than one
    p = AutoPolicy(3, {"ngram": False})
    t, n = _drive(p, REPEATING, 0.01, lambda k: 0.01 * (1 + 0.1 * k))
    assert any(d["do"] == "draft" and d["k"] == 3 for d in p.log)
    assert t < 0.6 * n * 0.01  # most tokens came 4 per pass


def test_auto_policy_turns_off_where_verify_costs_a_step_per_token():
    # the lockstep on this CPU: K+1 one-token passes; at most one probe per
    # K (within the loss budget), then plain decoding
    p = AutoPolicy(3, {"ngram": False})
    t, n = _drive(p, REPEATING, 0.01, lambda k: 0.01 * (1 + k) * 1.05)
    probes = [d for d in p.log if d["do"] == "probe"]
    # one pass of one draft shows the cost; the fitted cost rules out every K
    assert [d["k"] for d in probes] == [1] and not [d for d in p.log if d["do"] == "draft"]
    assert t <= 1.03 * n * 0.01
    assert p.probe_loss <= p.LOSS_FRACTION * p.decode_s + 0.01 + 1e-9


def test_auto_policy_probe_loss_stays_in_budget_after_each_probe():
    # the shadow proposals are all right (the text repeated so far), the real
    # passes accept nothing (it stops repeating), and a verify of k drafts
    # costs 1 + 0.6 k steps: a probe of K=3, chosen on the shadow's
    # acceptance, loses ~2 steps. The budget (1% of the generation's decode
    # time) must hold after every probe, not only before it.
    p = AutoPolicy(3, {"ngram": False})
    t1, probes = 0.01, []

    def check(probe):
        assert probe  # nothing was accepted: never confirmed
        probes.append(probe)
        assert p.probe_loss <= p.LOSS_FRACTION * t1 * 400 + 1e-9

    _drive(p, REPEATING, t1, lambda k: t1 * (1 + 0.6 * k), steps=400, accept=False, after_pass=check)
    assert len(probes) >= 1


def test_auto_policy_probes_only_where_the_generation_can_win_it_back():
    # a verify costs a step per token (this CPU's lockstep): a probe of one
    # draft that accepts nothing loses a step, more than 1% of a 64-token
    # generation and less than 1% of a 256-token one
    t1 = 0.01
    for steps, probed in ((64, False), (256, True)):
        p = AutoPolicy(3, {"ngram": False})
        t, n = _drive(p, REPEATING, t1, lambda k: t1 * (1 + k), steps=steps, accept=False)
        assert any(d["do"] == "probe" for d in p.log) == probed, (steps, p.log)
        assert p.probe_loss <= p.LOSS_FRACTION * t1 * steps + 1e-9


def test_auto_policy_never_probes_without_acceptance():
    # nothing repeats: the shadow proposals are never right, no pass is spent
    p = AutoPolicy(4, {"ngram": False})
    truth = list(range(1000, 1400))
    pos = 1
    p.tokens(truth[:1])
    while pos < 300:
        action = p.next(300 - pos)
        assert action[0] == "plain"
        for _ in range(action[1]):
            p.shadow("ngram", [pos], 0.0)  # always wrong
            p.tokens(truth[pos : pos + 1])
            pos += 1
        p.plain(0.01 * action[1], action[1])
    assert not p.log or all(d["do"] == "plain" for d in p.log)


def test_auto_policy_limits_costly_shadow_proposals():
    p = AutoPolicy(2, {"mtp": True})
    p.plain(0.02, 2)
    p.plain(0.02, 2)
    asked = 0
    for i in range(200):
        if p.shadow_k("mtp"):
            asked += 1
            p.shadow("mtp", [1, 2], 0.01)  # a head step costs a plain step
        p.plain(0.01, 1)
    assert p.shadow_s <= p.SHADOW_FRACTION * p.decode_s + 0.01 + 0.02


def test_auto_is_exact(moe):
    _, _, model, store, _ = moe
    p = PROMPTS[0]
    ref = greedy(model, p, 48)
    out, stats = spec(model, p, 48, draft="auto", num_draft=3, store=store)
    assert out == ref
    assert stats.auto["t1_s"] > 0


class ScriptedPolicy(AutoPolicy):
    """Auto's decisions on a schedule, to exercise every switch exactly."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.n = 0

    def next(self, remaining):
        self.n += 1
        if self.n % 3 == 0:
            return ("plain", min(remaining, 1 + self.n % 5))
        return ("draft", "ngram", 1 + self.n % 3, False)


@pytest.mark.parametrize("verify", ["exact", "rowwise"])
def test_switching_between_plain_and_drafting_is_exact(nxt, verify):
    _, _, model, store, _ = nxt
    p = PROMPTS[0]
    ref = greedy(model, p, 48)
    policy = ScriptedPolicy(3, {"ngram": False})
    out, stats = spec(model, p, 48, draft="auto", num_draft=3, store=store, policy=policy,
                      verify=verify)
    assert out == ref
    assert stats.plain_steps > 0 and stats.passes > stats.plain_steps


@pytest.mark.parametrize("verify", ["exact", "rowwise"])
def test_switching_computes_no_position_twice(nxt, verify, monkeypatch):
    # every position the target model computes is the prompt's or a fed one
    # (committed, or a draft verified): the plain step built ahead of a
    # drafting pass is kept, not thrown away and computed again
    from infer.spec import decoder as speculative

    computed = []
    forward = speculative._Forward.__call__

    def counting(self, inputs, cache):
        computed.append(inputs.shape[-1])
        return forward(self, inputs, cache)

    monkeypatch.setattr(speculative._Forward, "__call__", counting)
    _, _, model, store, _ = nxt
    p = PROMPTS[0]
    ref = greedy(model, p, 48)
    out, stats = spec(model, p, 48, draft="auto", num_draft=3, store=store,
                      policy=ScriptedPolicy(3, {"ngram": False}), verify=verify)
    assert out == ref
    assert stats.draft_passes > 0 and stats.plain_steps > 0
    assert sum(computed) == len(p) + stats.fed


@pytest.mark.parametrize("verify", ["exact", "rowwise"])
def test_fixed_drafter_steps_plainly_while_it_has_nothing(moe, verify, monkeypatch):
    # with a fixed drafter, a stretch where it proposes nothing is decoded in
    # pipelined plain steps (the next step built before a token is read), not
    # in one-token passes; the step built ahead of the next draft is kept
    from infer.spec import decoder as speculative

    computed, empty = [], []
    forward, draft_pass = speculative._Forward.__call__, speculative._Decoder.draft_pass

    def counting(self, inputs, cache):
        computed.append(inputs.shape[-1])
        return forward(self, inputs, cache)

    def checking(self, name, k, probe=False):
        empty.append(self.ahead is None and not self.drafters[name].propose(k))
        return draft_pass(self, name, k, probe)

    monkeypatch.setattr(speculative._Forward, "__call__", counting)
    monkeypatch.setattr(speculative._Decoder, "draft_pass", checking)
    _, _, model, store, _ = moe
    seen = []
    for p in PROMPTS:
        ref = greedy(model, p, 64)
        computed.clear()
        out, stats = spec(model, p, 64, draft="ngram", num_draft=3, store=store, verify=verify)
        assert out == ref
        assert sum(computed) == len(p) + stats.fed  # no position computed twice
        seen.append((stats.plain_steps, stats.draft_passes))
    assert not any(empty)  # a pass is only made with something to verify
    assert any(plain and drafts for plain, drafts in seen)


def test_auto_stays_off_without_repetition(moe):
    """No n-gram ever matches on a random model's free prompt: auto never
    verifies a draft, and decodes as plain decoding does (one token fed per
    token)."""
    _, _, model, store, _ = moe
    p = PROMPTS[1]
    ref = greedy(model, p, 64)
    out, stats = spec(model, p, 64, draft="auto", num_draft=4, store=store)
    assert out == ref
    assert stats.draft_passes == 0 and stats.fed == 63


def test_draft_none_equals_generate_step(nxt):
    _, _, model, store, _ = nxt
    for p in PROMPTS:
        out, stats = spec(model, p, 40, draft="none", store=store)
        assert out == greedy(model, p, 40)
        assert stats.passes == 39 and stats.plain_steps == 39


def test_stats_summary(moe):
    _, _, model, store, _ = moe
    out, stats = spec(model, PROMPTS[0], 24, draft="ngram", num_draft=2, store=store)
    s = stats.summary()
    for key in ("accept_len", "decode_tok_s", "bytes_read_per_token", "experts_per_token",
                "verify", "union", "fed_per_token"):
        assert key in s
    assert s["tokens"] == 24 and s["accept_len"] >= 1.0 and s["verify"] == "exact"
    assert s["bytes_read_per_token"] > 0


# -- command line --------------------------------------------------------------


def test_draft_mtp_refused_without_mtp(prep_model):
    prep = prep_model("qwen3_moe")
    r = subprocess.run(
        [sys.executable, "-m", "infer.cli", "run", "--model", str(prep), "--draft", "mtp",
         "--max-tokens", "4"],
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "mtp" in lines[0].lower()


def test_sliding_window_wrap_stays_exact(prep_model):
    """gpt_oss's sliding-window caches cannot be trimmed once their ring
    buffer wraps: they are rolled back from recorded states instead, and
    drafting carries on past the window with exact ids."""
    prep = prep_model("gpt_oss")
    source = InprocSource(prep, arena=64 << 20)
    model, _, store = load_streaming(prep, source, cache_bytes=1 << 18)
    window = model.args.sliding_window
    p = [(7 * i) % 900 + 3 for i in range(window - 40)]
    ref = greedy(model, p, 64)
    out, stats = spec(model, p, 64, draft="ngram", num_draft=4, store=store)
    assert out == ref
    assert stats.no_rollback_passes == 0
    assert stats.draft_passes > 0 and stats.drafted > stats.accepted  # rollbacks happened
    ref2 = greedy(model, p, 64)
    out2, _ = spec(model, p, 64, draft="ngram", num_draft=4, store=store, exact=False)
    source.close()
    assert out2 == ref2


def test_cli_every_draft_same_ids_through_iod(prep_model):
    """`infer run --draft ngram|mtp|auto` through the embedded daemon: the ids
    of `--draft none`, and the draft figures in the JSON stats."""
    import json
    import os
    import shutil

    from shared.fixtures import short_dir

    prep = prep_model("qwen3_next")
    folder = short_dir("iods-")
    env = dict(os.environ, IOD_RUN_DIR=str(folder))
    outs = {}
    try:
        for draft in ("none", "ngram", "mtp", "auto"):
            r = subprocess.run(
                [sys.executable, "-m", "infer.cli", "run", "--model", str(prep), "--draft", draft,
                 "--num-draft", "3", "--max-tokens", "40", "--json",
                 "--prompt", "Write a list of colors: red, green, blue"],
                capture_output=True, text=True, timeout=180, env=env,
            )
            assert r.returncode == 0, r.stderr
            outs[draft] = json.loads(r.stdout)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    for draft in ("ngram", "mtp", "auto"):
        assert outs[draft]["tokens"] == outs["none"]["tokens"], draft
        d = outs[draft]["stats"]["draft"]
        assert d["kind"] == draft and d["verify"] == "exact" and d["k"] == 3
    assert outs["mtp"]["stats"]["draft"]["drafted"] > 0


# -- infer bench --draft -------------------------------------------------------

DRAFT_KEYS = ("kind", "k", "accept_len", "decode_tok_s", "baseline_decode_tok_s", "speedup",
              "bytes_read_per_token", "exact")


def _bench(prep, tmp_path, *args):
    import json

    out = tmp_path / "bench.json"
    r = subprocess.run(
        [sys.executable, "-m", "infer.cli", "bench", "--model", str(prep), "--runs", "1",
         "--max-tokens", "4", "--dtype", "float32", "--draft-warmup", "4", "--json", str(out),
         *args],
        capture_output=True, text=True, timeout=900,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text()), r.stdout


def test_bench_draft_ngram(prep_model, tmp_path):
    """The "draft" object of the issue, every configuration's figures, the
    ids of plain greedy decoding, and the bitwise check of batched passes."""
    report, stdout = _bench(prep_model("qwen3_moe"), tmp_path, "--modes", "sync", "--draft", "ngram",
                            "--num-draft", "1,3", "--draft-tokens", "24", "--prompt", "@code",
                            "--draft-check")
    d = report["modes"]["sync"]["draft"]
    for key in DRAFT_KEYS:
        assert key in d, key
    assert d["kind"] == "ngram" and d["exact"] is True and d["verify"] == "exact"
    assert d["k"] in (1, 3) and d["tokens"] == 24
    assert [c["k"] for c in d["configs"]] == [1, 3] and all(c["exact"] for c in d["configs"])
    assert d["bytes_read_per_token"] > 0 and d["baseline_bytes_read_per_token"] > 0
    assert d["configs"][1]["union"]["experts_asked"] >= d["configs"][1]["union"]["experts_fetched"]
    for verify in ("batched", "rowwise"):
        c = d["check"]["1"][verify]
        assert c["rows"] == 24 and c["rows_bitwise_different"] == 0
    assert "speedup" in stdout
    # the ids the drafts were judged against: replaying the drafter over
    # them gives the configuration's own counts (where it proposes nothing,
    # plain steps until it does, and the step built ahead is committed too)
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from infer.tools.bench_draft import PROMPTS
    from infer.run import encode_prompt

    ids = d["baseline_ids"]
    assert len(ids) == 24
    drafter = NgramDrafter()
    drafter.observe(None, encode_prompt(load_tokenizer(prep_model("qwen3_moe")), PROMPTS["code"]) + ids[:1])
    pos, drafted, accepted, ahead = 1, 0, 0, False
    while pos < len(ids):
        if not ahead and not drafter.propose(3):
            while pos < len(ids):
                drafter.observe(None, ids[pos : pos + 1])
                pos += 1
                if pos < len(ids) and drafter.propose(3):
                    ahead = True
                    break
            continue
        if ahead:
            drafter.observe(None, ids[pos : pos + 1])
            pos, ahead = pos + 1, False
            if pos == len(ids):
                break
        k = min(3, len(ids) - pos - 1)
        drafts = drafter.propose(k) if k > 0 else []
        a = 0
        while a < len(drafts) and drafts[a] == ids[pos + a]:
            a += 1
        drafted, accepted = drafted + len(drafts), accepted + a
        drafter.observe(None, ids[pos : pos + a + 1])
        pos += a + 1
    assert (drafted, accepted) == (d["configs"][1]["drafted"], d["configs"][1]["accepted"])


def test_bench_draft_mtp_resident_and_streamed(prep_model, tmp_path):
    """MTP through the resident model (its head's experts read from the blob)
    and through streaming, lockstep and row-wise verify: ids equal."""
    report, _ = _bench(prep_model("qwen3_next"), tmp_path, "--modes", "resident,sync", "--draft", "mtp",
                       "--num-draft", "2", "--verify", "exact,rowwise", "--draft-tokens", "16")
    for mode in ("resident", "sync"):
        d = report["modes"][mode]["draft"]
        assert d["kind"] == "mtp" and d["exact"] is True and d["verify"] == "exact"
        assert {c["verify"] for c in d["configs"]} == {"exact", "rowwise"}
        assert all(c["verify_used"] == c["verify"] for c in d["configs"])  # rowwise ran as such
        assert all(c["exact"] and c["drafted"] > 0 for c in d["configs"])


def test_bench_draft_auto_without_repetition(prep_model, tmp_path):
    report, _ = _bench(prep_model("qwen3_moe"), tmp_path, "--modes", "sync", "--draft", "auto",
                       "--num-draft", "4", "--draft-tokens", "32", "--prompt", "@free")
    d = report["modes"]["sync"]["draft"]
    assert d["kind"] == "auto" and d["exact"] is True
    assert d["configs"][0]["draft_passes"] == 0  # it never verified a draft


def test_bench_draft_keeps_figures_when_plain_decoding_varies():
    """On a backend whose greedy ids vary run to run (MLX CUDA), the figures
    stay, with where the plain runs parted and whether each configuration
    equals one of them."""
    from infer.tools import bench_draft

    fig = {"accept_len": 2.0, "acceptance_rate": 0.5, "bytes_read_per_token": 10.0,
           "union": {"layer_calls": 0}, "verify_used": "exact"}
    run = {"tokens": 8, "prompt_tokens": 3, "baseline_ids": [1, 2, 3], "baseline_first_diff": 5,
           "baseline": [{"decode_tok_s": 10.0, "bytes_read_per_token": 12.0}] * 2,
           "configs": [{"kind": "mtp", "k": 1, "verify": "exact", "exact": False, "first_diff": 5,
                        "equals_a_plain_run": True, "decode_tok_s": 15.0, **fig},
                       {"kind": "mtp", "k": 2, "verify": "exact", "exact": False, "first_diff": 4,
                        "equals_a_plain_run": False, "decode_tok_s": 16.0, **fig}]}
    d = bench_draft.merge([run])
    assert d["baseline_first_diff"] == 5 and d["speedup"] == pytest.approx(1.6)
    assert [c["equals_a_plain_run"] for c in d["configs"]] == [True, False]
    table = bench_draft.table({"modes": {"resident": {"draft": d}}})
    assert "= a plain run" in table and "NO (plain varies too)" in table


def test_bench_draft_warms_every_configuration_through_the_timed_tokens(monkeypatch):
    """By default each configuration (and plain decoding) runs untimed for
    as many tokens as it is then timed for; --draft-warmup N caps that."""
    import argparse
    from contextlib import nullcontext
    from types import SimpleNamespace

    from infer.tools import bench_draft

    runs = []

    def plain(model, prompt, n, store):
        runs.append(("plain", n))
        return [0] * n, {"decode_tok_s": 1.0, "bytes_read_per_token": 0.0}

    def drafted(model, prompt, n, store, head, kind, k, verify):
        runs.append((k, n))
        return [0] * n, {}

    monkeypatch.setattr(bench_draft, "fresh_source", lambda *a: nullcontext())
    monkeypatch.setattr(bench_draft, "load_head", lambda *a: None)
    monkeypatch.setattr(bench_draft, "_plain", plain)
    monkeypatch.setattr(bench_draft, "_drafted", drafted)
    tok = SimpleNamespace(has_chat_template=False, encode=lambda text, **kw: [1, 2, 3])
    p = argparse.ArgumentParser()
    bench_draft.add_args(p)
    for extra, warm in (([], 12), (["--draft-warmup", "5"], 5)):
        args = p.parse_args(["--draft", "ngram", "--num-draft", "1,2", "--draft-tokens", "12",
                             "--raw-prompt", *extra])
        args.prompt, args.max_tokens = "x", 12
        assert ("--draft-warmup" in bench_draft.worker_argv(args)) == bool(extra)
        runs.clear()
        bench_draft.measure(args, "resident", None, tok, None, None, None)
        assert runs == [("plain", warm), (1, warm), (2, warm), ("plain", 12), (1, 12), (2, 12),
                        ("plain", 12)]


def test_bench_draft_refuses_bad_arguments(prep_model):
    from infer.tools import bench_draft
    from infer.spec import decoder as speculative
    from infer.tools.bench import main

    assert bench_draft.VERIFY == speculative.VERIFY

    assert main(["--model", str(prep_model("qwen3_moe")), "--draft", "mtp"]) == 2
    assert main(["--model", str(prep_model("qwen3_moe")), "--draft", "ngram", "--verify", "fast"]) == 2
    assert main(["--model", str(prep_model("qwen3_moe")), "--draft", "ngram", "--num-draft", "0"]) == 2
    assert main(["--model", str(prep_model("qwen3_moe")), "--prompt", "@nope"]) == 2


# -- trained models (tests/models/tiny-trained-<arch>, from `infer train`) --------


class GpuCostPolicy(AutoPolicy):
    """Auto with the costs a GPU would have (a verify pass of K+1 tokens for
    about one step, a head step for 1/20 of one), the acceptance its own:
    is the trained head good enough to turn drafting on?"""

    def shadow(self, name, proposal, seconds, asked=None, start=None):
        t1 = self.plain_time() or seconds
        super().shadow(name, proposal, 0.05 * t1 * len(proposal), asked, start)

    def draft_pass(self, name, k, accepted, seconds, draft_seconds, committed, probe, asked=None):
        t1 = self.plain_time()
        super().draft_pass(name, k, accepted, t1 * (1 + 0.05 * k), 0.05 * t1 * k, committed, probe,
                           asked)


@pytest.fixture(scope="module")
def trained_next(trained_prep):
    return trained_prep("qwen3_next")


def test_trained_mtp_head_is_accepted_and_turns_auto_on(trained_next):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from infer.tools.bench_draft import PROMPTS
    from infer.spec.mtp import MTPDrafter, load_mtp
    from shared.blob import Manifest

    source = InprocSource(trained_next, arena=64 << 20)
    model, tok, store = load_streaming(trained_next, source, cache_bytes=None, dtype=mx.float32, mtp_cache=True)
    head = load_mtp(trained_next, model, store, Manifest.load(trained_next))
    p = tok.encode(PROMPTS["pycode"])
    ref = greedy(model, p, 64)
    out, stats = spec(model, p, 64, draft="mtp", num_draft=1, store=store, verify="rowwise",
                      mtp=MTPDrafter(head, model))
    assert out == ref
    assert stats.accepted / stats.drafted > 0.3  # an untrained head accepts ~nothing
    policy = GpuCostPolicy(3, {"mtp": True}, prior_beta=0.3)  # as speculative_generate's for rowwise
    ref = greedy(model, p, 96)
    out, stats = spec(model, p, 96, draft="auto", num_draft=3, store=store, verify="rowwise",
                      mtp=MTPDrafter(head, model), policy=policy)
    source.close()
    assert out == ref
    # probes first (one per K), then drafting: most of the tokens came from passes
    assert any(d["drafter"] == "mtp" and d["do"] in ("probe", "draft") for d in stats.auto_log), stats.auto
    assert stats.draft_passes >= 8 and stats.plain_steps < stats.committed / 2


class EveryStepShadowPolicy(AutoPolicy):
    """Auto that never probes and proposes with the MTP head at every plain
    step: the queued shadow proposals, all of them."""

    LOSS_FRACTION = 0.0
    SHADOW_FRACTION = 1e9


def test_queued_mtp_shadow_proposals_are_judged_at_their_own_position(trained_next):
    # the head's shadow proposal is read a step after it is queued; judged
    # against the wrong position, the trained head's acceptance would fall to
    # about nothing
    from infer.tools.bench_draft import PROMPTS
    from infer.spec.mtp import MTPDrafter, load_mtp
    from shared.blob import Manifest

    source = InprocSource(trained_next, arena=64 << 20)
    model, tok, store = load_streaming(trained_next, source, cache_bytes=None, dtype=mx.float32,
                                       mtp_cache=True)
    head = load_mtp(trained_next, model, store, Manifest.load(trained_next))
    p = tok.encode(PROMPTS["pycode"])
    ref = greedy(model, p, 48)
    policy = EveryStepShadowPolicy(1, {"mtp": True})
    out, stats = spec(model, p, 48, draft="auto", num_draft=1, store=store,
                      mtp=MTPDrafter(head, model), policy=policy)
    source.close()
    assert out == ref
    assert stats.draft_passes == 0 and stats.plain_steps == 47
    judged = list(policy.outcomes["mtp"])
    # the first chunk measures the step time; every later step proposes
    assert len(judged) >= 47 - 2 * policy.CHUNK, len(judged)
    assert policy.rate("mtp") > 0.3, policy.rate("mtp")


def test_auto_decodes_plainly_where_nothing_is_read(prep_model):
    # every expert resident and the lockstep verify: a pass of K+1 tokens is
    # K+1 one-token passes and saves no read, so auto runs no policy (no
    # probe, no shadow proposal, no pass), and each token goes out when it
    # is committed, not at the end of a stretch of plain steps
    from shared.blob import Manifest

    prep = prep_model("qwen3_moe")
    source = InprocSource(prep, arena=64 << 20)
    model, _, store = load_streaming(prep, source, cache_bytes=Manifest.load(prep).expert_bytes,
                                     preload=False)
    assert not store.all_resident
    store.preload()
    assert store.all_resident
    p = PROMPTS[0]
    ref = greedy(model, p, 48)
    out, committed = [], []
    for t, stats in speculative_generate(model, p, draft="auto", num_draft=3, max_tokens=48,
                                         store=store):
        out.append(t)
        committed.append(stats.committed)
    assert out == ref
    assert committed == list(range(1, 49))
    assert stats.auto["off"].startswith("lockstep verify") and stats.k == 3
    assert stats.draft_passes == 0 and stats.plain_steps == 47
    # the row-wise verify can cost less than a step a token: auto measures it
    out, stats = spec(model, p, 48, draft="auto", num_draft=3, store=store, verify="rowwise")
    source.close()
    assert out == ref
    assert stats.auto["t1_s"] > 0
