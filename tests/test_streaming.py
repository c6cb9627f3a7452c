"""Streaming experts give exactly mlx-lm's greedy tokens, whatever the cache size."""

import os

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_load
from mlx_lm.generate import generate_step

from infer.runtime.loader import load_streaming
from iod.inproc import InprocSource
from infer.runtime.streaming import LayerStack
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


def mlx_reference(src):
    """(PROMPT's ids, mlx-lm's greedy ids after them) of the model folder ``src``, whole in memory."""
    model, tokenizer = mlx_load(str(src))
    ids = tokenizer.encode(PROMPT)
    return ids, greedy(model, ids)


@pytest.fixture(scope="module")
def references():
    return {}


@pytest.mark.parametrize("arch,quant", ARCHS)
def test_greedy_ids_equal_mlx_lm(arch, quant, synth_model, prep_model, references):
    prep = prep_model(arch, quant=quant)
    ids, expected = mlx_reference(synth_model(arch, quant=quant))

    expert_bytes = None
    for cache_fraction in (1.0, 0.15, 0.0):
        source = InprocSource(prep, arena=64 << 20)
        if expert_bytes is None:
            expert_bytes = source.manifest.expert_bytes
        model, _, store = load_streaming(prep, source, int(expert_bytes * cache_fraction))
        store.hits_first = True  # the split, on any device (its default: on the CPU alone)
        got = greedy(model, ids)
        source.close()
        assert got == expected, f"{arch} cache {cache_fraction}"
        if cache_fraction == 0.0:
            # a cache that holds only the current layer misses nearly always,
            # and a token computes the experts it bypasses from their own stack
            assert store.stats["misses"] > store.stats["hits"]
            assert store.stats["aside_calls"] > 0
            # one kept stack per shape of layout serves every such call
            assert 0 < len(store._asides) <= len({l.record_bytes for l in source.manifest.layers})
            assert store.stats["aside_calls"] > len(store._asides)
        elif cache_fraction == 0.15:
            # tokens with some experts cached computed them while the rest were
            # read; a token's experts fit the stack, so every miss was placed
            assert store.stats["hits_first"] > 0 and store.stats["aside_calls"] == 0
            # and the same ids with that overlap off
            source = InprocSource(prep, arena=64 << 20)
            model, _, store = load_streaming(prep, source, int(expert_bytes * cache_fraction))
            store.hits_first = False
            assert greedy(model, ids) == expected, f"{arch} cache {cache_fraction}, no hits first"
            assert store.stats["hits_first"] == 0
            source.close()
        elif cache_fraction == 1.0:
            # a cache that holds every expert reads each at most once
            assert store.stats["misses"] <= sum(l.num_experts for l in source.manifest.layers)


def test_split_only_where_each_expert_is_computed_alike(synth_model, prep_model, monkeypatch):
    """A one-token call computes its experts in groups (cached first, bypassed
    apart) only where the probe finds a product's bits independent of the
    other experts in the call (MLX CUDA 0.32's gather kernels are not: the
    H200, docs/benchmarks.md). A kernel that depends on them is refused, and
    with the split off the streamed ids stay mlx-lm's."""
    import copy

    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    from infer.runtime import streaming

    class ByCount(QuantizedSwitchLinear):  # one bit off unless it has all 8 experts
        def __call__(self, x, indices, sorted_indices=False):
            y = super().__call__(x, indices, sorted_indices)
            return y if indices.shape[-1] == 8 else y * (1 + 2.0**-20)

    src = synth_model("qwen3_moe")
    prep = prep_model("qwen3_moe")
    source = InprocSource(prep, arena=64 << 20)
    model, _, store = load_streaming(prep, source, source.manifest.expert_bytes // 8)
    module = next(m for _, m in model.named_modules() if isinstance(m, streaming.StreamingExperts))
    assert streaming.split_is_exact(module._inner, module._layout, mx.float32)  # MLX CPU
    skewed = copy.copy(module._inner)
    for proj in module._layout.projections:
        skewed[proj] = copy.copy(skewed[proj])
        skewed[proj].__class__ = ByCount
    assert not streaming.split_is_exact(skewed, module._layout, mx.float32)

    ref_model, tokenizer = mlx_load(str(src))
    ids = tokenizer.encode(PROMPT)
    expected = greedy(ref_model, ids)
    monkeypatch.setattr(streaming, "split_is_exact", lambda *a: False)
    store.hits_first = True
    assert greedy(model, ids) == expected
    assert store.stats["misses"] > 0 and store.stats["hits_first"] == 0
    assert store.stats["aside_calls"] == 0
    source.close()


def test_prediction_is_scored_per_depth(synth_model, prep_model):
    prep = prep_model("qwen3_moe")
    source = InprocSource(prep, arena=64 << 20)
    model, tokenizer, store = load_streaming(prep, source, 0)
    greedy(model, tokenizer.encode(PROMPT), n=8)
    stats = store.prefetcher.prediction_stats()
    assert set(stats) == {1, 2, 3}  # the default depth
    for row in stats.values():
        assert 0.0 <= row["recall"] <= 1.0 and 0.0 < row["precision"] <= 1.0
    source.close()


def test_a_cache_of_every_expert_starts_whole_without_a_calibration(synth_model, prep_model):
    """A prep folder without usage.json and a cache that holds every expert:
    the load fills every stack, so every call from the first is the resident
    one (whole: no sync, nothing read). Filled on demand instead (no preload),
    the first calls stream until a layer has used each expert once. Ids equal
    mlx-lm's either way."""
    src, prep = synth_model("qwen3_moe"), prep_model("qwen3_moe")
    assert not (prep / "usage.json").exists()
    ref_model, tokenizer = mlx_load(str(src))
    ids = tokenizer.encode(PROMPT)
    expected = greedy(ref_model, ids, n=16)
    del ref_model
    for preload in (True, False):
        source = InprocSource(prep, arena=64 << 20)
        try:
            model, _, store = load_streaming(prep, source, source.manifest.expert_bytes, preload=preload)
            complete = [store.stack(layer).complete for layer in store.cached]
            assert complete and all(complete) == preload and any(complete) == preload
            store.reset_stats()
            store.trace = []  # every call, whole or streamed
            got = greedy(model, ids, n=16)
        finally:
            source.close()
        assert got == expected, f"preload {preload}"
        whole, calls = store.stats["whole_calls"], len(store.trace)
        if preload:
            assert whole == calls > 0 and store.stats["misses"] == store.stats["fetched_bytes"] == 0
        else:
            assert whole < calls and store.stats["misses"] > 0


def test_mtp_layers_share_the_cache_only_when_drafting(prep_model):
    """A plain run gives an MTP head's expert layers none of the cache (it
    never calls them); drafting with the head shares it with them. The
    memory plan splits the same way. Tokens are the same either way."""
    from infer.runtime.budget import plan_memory
    from shared.blob import Manifest

    prep = prep_model("qwen3_next")
    manifest = Manifest.load(prep)
    mtp = {l.layer for l in manifest.layers if l.module.startswith("mtp.")}
    main = [l for l in manifest.layers if l.layer not in mtp]
    assert mtp and main
    cache = manifest.expert_bytes // 4
    runs = {}
    for mtp_cache in (False, True):
        source = InprocSource(prep, arena=64 << 20)
        model, tok, store = load_streaming(prep, source, cache, mtp_cache=mtp_cache, preload=False)
        runs[mtp_cache] = greedy(model, tok.encode(PROMPT), n=16), dict(store.stats)
        shared = len(main) + (len(mtp) if mtp_cache else 0)
        for l in main:
            assert store.stack(l.layer).capacity == min(cache // shared // l.record_bytes, l.num_experts)
        for layer in mtp:
            assert (store.stack(layer).capacity > 0) == mtp_cache
        source.close()
        plan = plan_memory(1 << 40, prep, manifest, mtp_cache=mtp_cache)
        assert (set(plan.capacity) & mtp != set()) == mtp_cache
    assert runs[False][0] == runs[True][0]
    assert runs[False][1]["misses"] < runs[True][1]["misses"]  # the main layers hold more


def _qwen3_moe_streamed(synth_model, prep_model, fraction):
    """(prompt ids, mlx-lm's 24 greedy ids, source, streamed model, store)
    for the qwen3_moe with 1/``fraction`` of its experts cached."""
    src = synth_model("qwen3_moe")
    prep = prep_model("qwen3_moe")
    ref_model, tokenizer = mlx_load(str(src))
    ids = tokenizer.encode(PROMPT)
    expected = greedy(ref_model, ids, n=24)
    del ref_model
    source = InprocSource(prep, arena=64 << 20)
    model, _, store = load_streaming(prep, source, source.manifest.expert_bytes // fraction, preload=False)
    return ids, expected, source, model, store


@pytest.mark.parametrize("hits_first", [False, True])
def test_a_decode_call_copies_its_misses_in_at_the_next_sync(synth_model, prep_model, monkeypatch,
                                                            hits_first):
    """In a forward of the whole model a decode call does not wait for its
    misses: their reads start, the call returns its (lazy) output, and they
    are copied in at the next streamed call's router, or at the end of the
    forward for the last layer, before anything is evaluated. A prefill
    waits for them in its own call. Ids stay mlx-lm's; a copy that fails at
    the settle leaves none of its experts cached, and decoding goes on."""
    from infer.runtime import streaming

    ids, expected, source, model, store = _qwen3_moe_streamed(synth_model, prep_model, 8)
    store.hits_first = hits_first
    events = []
    call, fetch = streaming.StreamingExperts.__call__, source.fetch_into

    def logged_call(self, x, indices):
        events.append(("call", self._layout.layer, x.shape[1]))
        return call(self, x, indices)

    def logged_fetch(layer, experts, sink):
        events.append(("fetch", layer, len(experts)))
        return fetch(layer, experts, sink)

    monkeypatch.setattr(streaming.StreamingExperts, "__call__", logged_call)
    monkeypatch.setattr(source, "fetch_into", logged_fetch)
    assert greedy(model, ids, n=24) == expected
    assert not store._pending
    last = max(store.prefetcher.routers)  # (a qwen3_next's MTP layer runs only when drafting)
    deferred = 0
    for i, (kind, layer, n) in enumerate(events):
        if kind != "fetch":
            continue
        before = next(e for e in reversed(events[:i]) if e[0] == "call")
        if before[2] > 8:  # a prefill's call fetched its own misses
            assert before[1] == layer
        else:  # a decode call's misses came in at the next call, or after the last
            assert before[1] > layer or (layer == before[1] == last), events[i - 3 : i + 1]
            deferred += 1
    assert deferred > 20

    # a copy that fails at the settle: the forward raises, those experts are
    # not cached, and the next forward decodes mlx-lm's ids again
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([ids]), cache=cache))
    failed = []

    def failing_fetch(layer, experts, sink):
        failed.append((layer, list(experts)))
        raise OSError("injected")

    monkeypatch.setattr(source, "fetch_into", failing_fetch)
    stacks = {l: store.stack(l) for l in store.layouts}
    with pytest.raises(OSError):
        model(mx.array([[expected[0]]]), cache=cache)
    assert failed and not store._pending
    for layer, experts in failed:
        assert not set(experts) & set(stacks[layer].position)
    monkeypatch.setattr(source, "fetch_into", fetch)
    assert greedy(model, ids, n=24) == expected
    source.close()


def _resident_then_streamed(run, ref_model, prep, fraction):
    """(run(resident model), run(streamed model), its store), with
    1/``fraction`` of the experts cached."""
    expected = run(ref_model)
    source = InprocSource(prep, arena=64 << 20)
    model, _, store = load_streaming(prep, source, source.manifest.expert_bytes // fraction, preload=False)
    got = run(model)
    source.close()
    return expected, got, store


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
@pytest.mark.parametrize("fraction", [16, 4])
def test_a_forward_left_lazy_is_not_overwritten_by_the_next(synth_model, prep_model, arch, fraction):
    """A caller may build the next forward before evaluating the last one (a
    speculative rollback feeds its accepted tokens so): the next forward's
    misses reuse positions the lazy one still reads. Every output, evaluated
    at the end, equals mlx-lm's resident one bit for bit."""
    from mlx_lm.models.cache import make_prompt_cache

    src = synth_model(arch)
    prep = prep_model(arch)
    ref_model, tokenizer = mlx_load(str(src))
    ids = tokenizer.encode(PROMPT + " " + PROMPT)
    sizes = [6] + [1, 3, 1, 1, 2] * len(ids)
    chunks, at = [], 0
    for n in sizes:
        if at >= len(ids):
            break
        chunks.append(ids[at:at + n])
        at += n

    def lazy_forwards(model):
        cache = make_prompt_cache(model)
        outs = [model(mx.array([c]), cache=cache) for c in chunks]  # none evaluated in between
        mx.eval(outs)
        return outs

    expected, got, store = _resident_then_streamed(lazy_forwards, ref_model, prep, fraction)
    assert store.stats["misses"] > len(chunks)  # positions were reused
    assert [i for i, (a, b) in enumerate(zip(expected, got)) if not mx.array_equal(a, b).item()] == []


def test_a_gather_that_fails_before_its_copies_leaves_no_expert_cached(synth_model, prep_model,
                                                                       monkeypatch):
    """A call's misses are placed (LayerStack.assign) before they are copied
    in; a failure in between (here the compact stack of a prefill that does
    not fit the cache cannot be allocated) leaves none of them cached, as a
    failed copy does: the next request on the same store (infer serve goes
    on) decodes mlx-lm's ids, not experts whose bytes never came."""
    from mlx_lm.models.cache import make_prompt_cache

    from infer.runtime import streaming

    ids, expected, source, model, store = _qwen3_moe_streamed(synth_model, prep_model, 16)
    for layer in store.layouts:
        store.stack(layer)  # made now: the only stack made below is the prefill's compact one

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("[malloc] Unable to allocate")

    monkeypatch.setattr(streaming, "LayerStack", out_of_memory)
    with pytest.raises(RuntimeError, match="allocate"):
        model(mx.array([ids]), cache=make_prompt_cache(model))
    monkeypatch.setattr(streaming, "LayerStack", LayerStack)
    cached = {layer: sorted(s.position) for layer, s in store.stacks.items() if s.position}
    got = greedy(model, ids, n=24)
    assert cached == {}
    assert got == expected

    # nor does a cold-start preload whose read fails
    for stack in store.stacks.values():
        stack.forget(list(stack.position))  # room to preload
    tried = []

    def failing_fetch(layer, experts, sink):
        tried.append((layer, list(experts)))
        raise OSError("injected")

    monkeypatch.setattr(source, "fetch_into", failing_fetch)
    with pytest.raises(OSError):
        store.preload()
    source.close()
    ((layer, experts),) = tried
    assert experts and not set(experts) & set(store.stack(layer).position)


@pytest.mark.parametrize("fraction", [16, 4])
def test_batch_generate_equals_resident(synth_model, prep_model, fraction):
    """mlx-lm's batch_generate on a streamed model: prompts of different
    lengths, calls of several rows, the same ids as the resident model."""
    from mlx_lm.generate import batch_generate

    src = synth_model("qwen3_moe")
    prep = prep_model("qwen3_moe")
    ref_model, tokenizer = mlx_load(str(src))
    prompts = [tokenizer.encode(p) for p in (PROMPT, "Once upon a time", PROMPT + " four five six seven")]

    def run(model):
        return batch_generate(model, tokenizer, prompts, max_tokens=20).texts

    expected, got, store = _resident_then_streamed(run, ref_model, prep, fraction)
    assert store.stats["misses"] > 0
    assert got == expected


@pytest.mark.parametrize("mtp_cache", [False, True])
def test_the_mtp_head_between_two_lazy_forwards(synth_model, prep_model, mtp_cache):
    """The MTP head (its own stack, the kept aside stacks it shares with the
    main layers' shape) called between forwards of two sequences, one through
    the model's __call__ (deferred copies) and one through model.model (none),
    all left lazy: the same bits as each evaluated at once."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    from infer.spec.mtp import load_mtp
    from shared.blob import Manifest

    prep = prep_model("qwen3_next")
    _, tokenizer = mlx_load(str(synth_model("qwen3_next")))
    ids = tokenizer.encode(PROMPT + " " + PROMPT)

    def run(eager):
        source = InprocSource(prep, arena=64 << 20)
        model, _, store = load_streaming(prep, source, source.manifest.expert_bytes // 16,
                                         preload=False, mtp_cache=mtp_cache)
        head = load_mtp(prep, model, store, Manifest.load(prep))
        first, second = make_prompt_cache(model), make_prompt_cache(model)
        head_cache = [KVCache() for _ in head.layers]
        outs = []
        for i in range(len(ids) - 1):
            h = model.model(mx.array([[ids[i]]]), first)
            outs.append(h)
            outs.append(head(h, model.model.embed_tokens(mx.array([[ids[i + 1]]])), head_cache))
            outs.append(model(mx.array([[ids[-1 - i]]]), cache=second))
            if eager:
                mx.eval(outs[-3:])
        mx.eval(outs)
        source.close()
        return outs, store.stats["misses"]

    eager, eager_misses = run(True)
    lazy, lazy_misses = run(False)
    assert eager_misses == lazy_misses > 0
    assert [i for i, (a, b) in enumerate(zip(eager, lazy)) if not mx.array_equal(a, b).item()] == []


def test_a_streaming_session_turns_mlx_cuda_graphs_off(prep_model, monkeypatch):
    """Where some layer streams, MLX_USE_CUDA_GRAPHS=0 is set before the
    model is loaded (read by MLX CUDA at its first evaluation); with every
    layer whole it is left alone, and so is a user's own setting."""
    from infer.runtime.budget import cached_expert_bytes
    from shared.blob import Manifest

    prep = prep_model("qwen3_moe")
    whole = cached_expert_bytes(Manifest.load(prep))
    for cache, user, want in ((whole // 4, None, "0"), (whole, None, None), (whole // 4, "1", "1")):
        monkeypatch.setenv("MLX_USE_CUDA_GRAPHS", "unset below; restored after the test")
        if user is None:
            monkeypatch.delenv("MLX_USE_CUDA_GRAPHS")
        else:
            monkeypatch.setenv("MLX_USE_CUDA_GRAPHS", user)
        source = InprocSource(prep, arena=64 << 20)
        try:
            _, _, store = load_streaming(prep, source, cache, preload=False)
            whole_layers = [store.capacity[l] == store.layouts[l].num_experts for l in store.cached]
            assert all(whole_layers) == (cache == whole)
            assert os.environ.get("MLX_USE_CUDA_GRAPHS") == want
        finally:
            source.close()


@pytest.mark.parametrize("stored", ["bfloat16", "float16"])
def test_native_copy_widens_every_16_bit_value_as_mlx_does(stored):
    """copy_regions kind 1 / 2 against MLX's astype(float32), every bit
    pattern: zeros, subnormals, infinities and NaNs included."""
    import native
    import numpy as np

    bits = np.arange(1 << 16, dtype=np.uint16)
    dtype = getattr(mx, stored)
    ref = np.array(mx.array(bits).view(dtype).astype(mx.float32))
    out = np.full(bits.size + 8, 7.0, dtype=np.float32)  # 8 guard values after the region
    kind = 1 if stored == "bfloat16" else 2
    n = native.copy_regions([out], bits.tobytes(), np.array([[0, 0, 0, bits.nbytes]], dtype=np.int64), kind)
    assert n == bits.nbytes
    got = out[: bits.size]
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), ref[~nan].view(np.uint32))  # -0.0 too
    assert (out[bits.size:] == 7.0).all()
    with pytest.raises(ValueError):  # the widened region must fit its destination
        native.copy_regions([out], bits.tobytes(), np.array([[0, 64, 0, bits.nbytes]], dtype=np.int64), kind)


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


def test_stack_keeps_what_its_simulation_keeps_over_many_evictions():
    """A real model's shape (512 experts, top 10, a quarter cached) on skewed
    random routing: after every call the stack holds exactly the experts the
    simulated rule (infer.tools.belady FreqDecayRank, a scan for each victim) holds,
    through thousands of evictions, kept and bypassed experts included."""
    import numpy as np

    from infer.tools.belady import FreqDecayRank

    layout = plan_layer(0, "m", [("fc1", "weight", "uint32", (1,), 4, 512)])
    stack = LayerStack(layout, capacity=128)
    sim = FreqDecayRank(128, LayerStack.HALF_LIFE)
    rng = np.random.default_rng(0)
    p = 1.0 / np.arange(1, 513) ** 0.8
    evicted = 0
    for _ in range(1500):
        want = sorted(rng.choice(512, size=10, replace=False, p=p / p.sum()).tolist())
        stack.tick()
        missing = [e for e in want if e not in stack]
        for e in want:
            if e in stack:
                stack.touch(e)
        before = len(stack.position)
        places = stack.assign(missing, set(want))
        evicted += before + sum(v is not None for v in places.values()) - len(stack.position)
        assert sim.request(want) == len(missing)
        assert set(stack.position) == set(sim.cached)
        assert sorted(stack.position.values()) == sorted(set(stack.position.values()))
    assert evicted > 3000
