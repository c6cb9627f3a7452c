"""Speculative decoding under streaming: draft K tokens, verify them in one pass.

A drafter (n-gram prompt lookup, or Qwen3-Next's MTP head) proposes K tokens;
the target model scores ``[last token] + drafts`` in one verify pass, the
longest prefix that matches the target's greedy choice is committed plus the
target's own next token, and the caches are rolled back to the last accepted
token. Greedy (temperature 0) only. Passes that draft nothing are plain
one-token steps, pipelined as in mlx-lm's ``generate_step``.

Three verify modes (``verify=``):

- ``"exact"`` (default): the K+1 tokens go through the model as K+1
  one-token forward passes, run in lockstep layer by layer (one greenlet per
  token, on one thread, taking turns). At every MoE layer the experts of all
  K+1 tokens are fetched together, as one union request, and then each token
  computes with exactly the shapes and cache contents of plain one-token
  decoding, so its logits are bit-identical to non-speculative decoding by
  construction. It saves reads and round trips (the union is fetched once,
  the IO of K+1 tokens is merged), not compute.
- ``"rowwise"``: one batched forward pass over the K+1 tokens, with the
  operations known to compute a row differently in a batch (attention,
  causal convolutions, the gated-delta recurrence, KV buffer growth) done
  row by row as one-token decoding does them (``infer.spec.rowwise``); the
  recurrent state after every token is kept, so rollback is exact. Exact
  where the backend's remaining kernels (quantized matrix-vector products,
  gather_qmm, norms) compute each row on its own: measured, not assumed
  (``infer bench --draft-check``).
- ``"batched"``: one plain batched forward pass. Not exact by construction.

Rollback: attention KV caches are trimmed; caches that cannot be trimmed
(the Gated-DeltaNet conv and recurrent state in ``ArraysCache``, sliding-window
ring buffers) record their state after every update during a verify and are
put back to the one after the last accepted token (lockstep and row-wise
verify), or, after a plain batched pass, to the state before it, with the
accepted tokens fed again at the start of the next pass.

``draft="auto"`` decides before every pass between plain decoding and
drafting (which drafter, which K) from measured costs: ``infer.spec.policy``.
"""

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import mlx.core as mx
import numpy as np
from greenlet import greenlet
from mlx_lm.models.cache import ArraysCache, RotatingKVCache, make_prompt_cache

from infer.spec.ngram import NgramDrafter

DRAFTS = ("none", "ngram", "mtp", "auto")
VERIFY = ("exact", "rowwise", "batched")


class _RecordingArraysCache(ArraysCache):
    """ArraysCache that keeps its state after each advance while recording.
    Its arrays are replaced, never written in place, so references suffice."""

    history = None

    def snapshot(self):
        return list(self.cache)

    def restore(self, snap):
        self.cache = list(snap)

    def advance(self, N):
        super().advance(N)
        if self.history is not None:
            self.history.append((N, self.snapshot()))


class _RecordingRotatingKVCache(RotatingKVCache):
    """Sliding-window cache that keeps its state after each update while
    recording. Its ring buffer is written in place, so a snapshot holds its
    own array objects (MLX then copies on the next write, not before)."""

    history = None

    def snapshot(self):
        if self.keys is None:
            return (None, None, self.offset, self._idx)
        return (mx.array(self.keys), mx.array(self.values), self.offset, self._idx)

    def restore(self, snap):
        k, v, self.offset, self._idx = snap
        self.keys = None if k is None else mx.array(k)
        self.values = None if v is None else mx.array(v)

    def update_and_fetch(self, keys, values):
        out = super().update_and_fetch(keys, values)
        if self.history is not None:
            self.history.append((keys.shape[2], self.snapshot()))
        return out


_RECORDING = {ArraysCache: _RecordingArraysCache, RotatingKVCache: _RecordingRotatingKVCache}


def make_cache(model):
    """The model's prompt cache, with caches that cannot be trimmed (recurrent
    state, sliding windows) made able to record their states."""
    cache = make_prompt_cache(model)
    for c in cache:
        if type(c) in _RECORDING:
            c.__class__ = _RECORDING[type(c)]
    return cache


def _recording(c):
    return hasattr(c, "snapshot")


def can_roll_back(cache, n):
    """Whether every cache can be taken back after ``n`` more tokens."""
    return all(_recording(c) or c.is_trimmable() for c in cache)


class CacheCheckpoint:
    """The cache state before a pass, and the way back to any token of it.

    Trimmable caches are trimmed; the others record their state after every
    update during the pass and are put back to the one after the kept tokens.
    """

    def __init__(self, cache):
        self.cache = cache
        self.offsets = [None if _recording(c) else c.offset for c in cache]
        self.snaps = {}
        for i, c in enumerate(cache):
            if _recording(c):
                self.snaps[i] = c.snapshot()
                c.history = []

    def stop(self):
        for i in self.snaps:
            self.cache[i].history = None

    def rollback(self, keep):
        """Keep the first ``keep`` tokens fed since the checkpoint.

        Returns False when a recorded state cannot be placed after exactly
        ``keep`` tokens (a batched pass); the cache is then back at the
        checkpoint and the caller feeds the kept tokens again.
        """
        found = {}
        for i in self.snaps:
            done = 0
            for n, snap in self.cache[i].history or []:
                done += n
                if done == keep:
                    found[i] = snap
                    break
        exact = keep == 0 or len(found) == len(self.snaps)
        for i, c in enumerate(self.cache):
            if i in self.snaps:
                c.restore(found[i] if exact and keep else self.snaps[i])
                c.history = None
            else:
                c.trim(c.offset - (self.offsets[i] + (keep if exact else 0)))
        return exact


_STREAM = None


def shared_stream():
    """The stream the speculative decoder computes on, its verify passes too."""
    global _STREAM
    if _STREAM is None:
        _STREAM = mx.new_thread_unsafe_stream(mx.default_device())
    return _STREAM


def _greedy(logits):
    """Greedy ids of each row, computed per row exactly as mlx-lm's
    generate_step does for its one-token steps (logprobs, then argmax)."""
    out = []
    for j in range(logits.shape[1]):
        row = logits[:, j, :]
        logprobs = row - mx.logsumexp(row, keepdims=True)
        out.append(mx.argmax(logprobs, axis=-1))
    return out


class _Forward:
    """Target-model forward returning logits and, if asked, the hidden states."""

    def __init__(self, model, want_hidden):
        self.model = model
        self.want_hidden = want_hidden

    def __call__(self, inputs, cache):
        m = self.model
        if not self.want_hidden:
            return m(inputs, cache=cache), None
        h = m.model(inputs, cache)
        if getattr(m.args, "tie_word_embeddings", False):
            return m.model.embed_tokens.as_linear(h), h
        return m.lm_head(h), h


class Wavefront:
    """Runs n one-token forward passes in lockstep, one MoE layer at a time.

    The passes are greenlets on the calling thread (MLX's lazy arrays
    belong to one thread's streams), run in turn as the chunks of a
    layer-major prefill are (``infer.runtime.prefill``): token j's pass
    reaches an MoE layer only after token j-1's has, so every cache sees
    the same updates in the same order as step-by-step decoding. At each
    MoE layer the last token's pass fetches the union of all n tokens'
    experts with one store call; each token then computes with its own
    experts, as in one-token decoding.
    """

    def __init__(self, forward, store=None, stream=None):
        self.forward = forward
        self.store = store
        self.stream = stream or shared_stream()
        # MoE layer calls, experts fetched as unions, experts the tokens asked for
        self.union = [0, 0, 0]

    def run(self, tokens, cache):
        n = len(tokens)
        self._n = n
        self._wanted = [None] * n
        self._fetched = None
        results = [None] * n
        passes = [greenlet(partial(self._work, j, tokens[j], cache, results)) for j in range(n)]
        if self.store is not None:
            self.store.gather = self._hook
        try:
            # each pass in turn up to its next MoE layer (or its end)
            while not all(p.dead for p in passes):
                for j, p in enumerate(passes):
                    if not p.dead:
                        self._j = j
                        p.switch()
        finally:
            if self.store is not None:
                del self.store.gather
        return results

    def _work(self, j, token, cache, results):
        with mx.stream(self.stream):
            results[j] = self.forward(mx.array([[token]]), cache)

    def _hook(self, layer, wanted, split=False, decode=False, defer=False):
        # stands in for ExpertStore.gather during the run; the union is
        # copied in now (no deferral: the passes take turns on it)
        j = self._j
        self._wanted[j] = (layer, [int(e) for e in wanted])
        if j == self._n - 1:
            layers = {w[0] for w in self._wanted}
            if len(layers) != 1:
                raise RuntimeError(f"wavefront out of step: layers {sorted(layers)}")
            union = sorted(set().union(*(w[1] for w in self._wanted)))
            self.union[0] += 1
            self.union[1] += len(union)
            self.union[2] += sum(len(w[1]) for w in self._wanted)
            # the union on one stack (no bypassed experts apart: each
            # token's call takes its own experts out of it)
            arrays, positions, _ = type(self.store).gather(self.store, layer, np.array(union),
                                                           decode=decode)
            self._fetched = (arrays, dict(zip(union, positions)))
        # the other passes' turns: each computes this layer once all have its union
        greenlet.getcurrent().parent.switch()
        arrays, positions = self._fetched
        return arrays, [positions[e] for e in self._wanted[j][1]], None


@dataclass
class SpecStats:
    """What a speculative generation did; ``summary()`` gives the figures."""

    draft: str = "none"
    k: int = 0
    verify: str = "exact"
    prompt_tokens: int = 0
    committed: int = 0
    passes: int = 0  # target-model passes while decoding (plain steps included)
    plain_steps: int = 0  # passes of one token (nothing drafted)
    draft_passes: int = 0  # passes that verified at least one drafted token
    drafted: int = 0
    accepted: int = 0
    fed: int = 0  # tokens fed through the target model while decoding
    accept_lens: list = field(default_factory=list)  # accepted drafts per draft pass
    prefill_s: float = 0.0
    decode_s: float = 0.0
    draft_s: float = 0.0  # drafting (proposals), shadow proposals of auto included
    no_rollback_passes: int = 0  # passes not drafted: a cache could not roll back
    drafting: bool = True  # whether the last pass drafted
    union: list = field(default_factory=lambda: [0, 0, 0])  # see Wavefront.union
    policy: object = None  # the AutoPolicy of --draft auto
    auto_off: str = ""  # why --draft auto decoded plainly without a policy
    store_start: dict = field(default_factory=dict)  # the store's stats after the prefill
    store_end: dict = field(default_factory=dict)

    @property
    def auto(self) -> dict:
        """AutoPolicy.summary() of --draft auto (made when asked: it is not free)."""
        if self.policy is not None:
            return self.policy.summary()
        return {"off": self.auto_off} if self.auto_off else {}

    @property
    def auto_log(self):
        return self.auto.get("decisions", [])

    def summary(self):
        decoded = max(self.committed - 1, 0)
        n = max(decoded, 1)
        d = {
            k: self.store_end.get(k, 0) - self.store_start.get(k, 0)
            for k in ("hits", "misses", "fetched_bytes")
        }
        lookups = d["hits"] + d["misses"]
        calls, union, asked = self.union
        return {
            "kind": self.draft,
            "k": self.k,
            "verify": self.verify,
            "tokens": self.committed,
            "passes": self.passes,
            "plain_steps": self.plain_steps,
            "draft_passes": self.draft_passes,
            # tokens committed per decode pass (the prefill's token excluded)
            "accept_len": decoded / max(self.passes, 1),
            "accepted_per_draft_pass": self.accepted / max(self.draft_passes, 1),
            "acceptance_rate": self.accepted / max(self.drafted, 1),
            "drafted": self.drafted,
            "accepted": self.accepted,
            "fed_per_token": self.fed / n,
            "decode_tok_s": decoded / self.decode_s if self.decode_s else 0.0,
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "draft_s": self.draft_s,
            # decode only: the prefill's reads are the same with or without drafting
            "experts_per_token": d["misses"] / n,
            "lookups_per_token": lookups / n,
            "hit_rate": d["hits"] / lookups if lookups else 0.0,
            "bytes_read_per_token": d["fetched_bytes"] / n,
            # the verify batches' experts: asked for by their tokens, fetched as unions
            "union": {"layer_calls": calls, "experts_fetched": union, "experts_asked": asked,
                      "saved_fraction": 1.0 - union / asked if asked else 0.0},
            "no_rollback_passes": self.no_rollback_passes,
            "auto": self.auto,
        }


def _store_stats(store):
    return dict(store.stats) if store is not None else {}


def speculative_generate(
    model,
    prompt_ids,
    draft="ngram",
    num_draft=4,
    max_tokens=256,
    mtp=None,
    exact=True,
    store=None,
    eos_ids=(),
    prefill_step_size=2048,
    ngram_max=3,
    drafter=None,
    policy=None,
    verify=None,
):
    """Greedy generation with drafting; yields ``(token id, SpecStats)``.

    ``draft``: "none" | "ngram" | "mtp" | "auto". "auto" drafts with the
    n-gram drafter and, when ``mtp`` is given, the MTP head, each only while
    the measured costs say it pays (``infer.spec.policy.AutoPolicy``; pass
    ``policy`` to use another one). ``mtp``: an ``infer.spec.mtp.MTPDrafter``
    (required for "mtp"). ``drafter``: any object with ``needs_hidden``,
    ``observe(hidden, tokens)`` and ``propose(k)``, used instead of the
    built-in ones. ``store``: the model's ExpertStore; the exact verify
    fetches the union of the batch's experts through it, and its stats give
    the bytes per token.

    ``verify``: "exact" (default; the lockstep verify: the ids equal
    non-speculative greedy decoding by construction), "rowwise" (one batched
    pass whose rows are computed as one-token passes where the kernels are
    known to differ: ``infer.spec.rowwise``; falls back to "exact" for caches it
    does not support) or "batched" (one plain batched pass). ``exact=False``
    is "batched", for older callers.
    """
    verify = verify or ("exact" if exact else "batched")
    if verify not in VERIFY:
        raise ValueError(f"unknown verify {verify!r} (choose from {', '.join(VERIFY)})")
    if draft not in DRAFTS:
        raise ValueError(f"unknown draft {draft!r} (choose from {', '.join(DRAFTS)})")
    if draft == "mtp" and mtp is None and drafter is None:
        raise ValueError("draft 'mtp' needs an MTP head")
    drafters = {}
    if drafter is not None:
        drafters["custom"] = drafter
    elif draft in ("ngram", "auto"):
        drafters["ngram"] = NgramDrafter(max_n=ngram_max)
    if drafter is None and mtp is not None and draft in ("mtp", "auto"):
        drafters["mtp"] = mtp
    k_max = 0 if draft == "none" else max(0, int(num_draft))
    asked_k, off = k_max, ""
    resident = store is None or store.all_resident
    if draft == "auto" and policy is None and verify == "exact" and resident:
        # the lockstep verify of K+1 tokens is K+1 one-token passes: with
        # nothing to read it costs K+1 plain steps or more for at most K+1
        # tokens, so drafting cannot pay; decode plainly, with no shadow
        # proposals or probes to pay for
        drafters, k_max = {}, 0
        off = "lockstep verify, every expert resident: a pass costs at least K+1 plain steps"
    if draft == "auto" and policy is None and k_max:
        from infer.spec.policy import AutoPolicy

        policy = AutoPolicy(k_max, {n: d.needs_hidden for n, d in drafters.items()},
                            prior_beta=1.0 if verify == "exact" else 0.3)
    run = _Decoder(model, drafters, verify, store, eos_ids, max_tokens, policy)
    run.stats.draft = draft
    run.stats.k = asked_k
    run.stats.auto_off = off
    yield from run.generate(prompt_ids, prefill_step_size, k_max, draft != "none")


class _Decoder:
    """One speculative generation: the model, its cache, the drafters."""

    def __init__(self, model, drafters, verify, store, eos_ids, max_tokens, policy):
        from infer.spec import rowwise

        self.model = model
        self.drafters = drafters
        self.store = store
        self.eos = {int(e) for e in eos_ids}
        self.max_tokens = max_tokens
        self.policy = policy
        self.want_hidden = any(d.needs_hidden for d in drafters.values())
        self.stream = shared_stream()
        self.forward = _Forward(model, want_hidden=self.want_hidden)
        self.cache = make_cache(model)
        if verify == "rowwise" and not rowwise.supported(model, self.cache):
            verify = "exact"  # a cache it cannot roll back or compute row by row
        self.verify = verify
        self.wave = Wavefront(self.forward, store, self.stream) if verify == "exact" else None
        self.rowwise = rowwise.RowwisePass(model) if verify == "rowwise" else None
        self.union = [0, 0, 0]  # of the batched passes (see Wavefront.union)
        self.stats = SpecStats(verify=verify)
        self.pre = []  # accepted tokens to feed again (batched verify, recurrent caches)
        self.y = None  # the last committed token, not yet fed to the model
        # (next token, hidden): a plain step built past the end of
        # a chunk so the pipeline does not drain at every decision of auto;
        # a pass that drafts next keeps it as a step of its own
        self.ahead = None
        # auto's shadow proposals of an MTP head, queued and not read yet:
        # (drafter, drafts, asked, tokens committed then, seconds to build)
        self.shadows = []

    def observe(self, hidden, tokens):
        for d in self.drafters.values():
            d.observe(hidden if d.needs_hidden else None, tokens)
        if self.policy is not None:
            self.policy.tokens(tokens)

    def generate(self, prompt_ids, prefill_step_size, k_max, drafting):
        stats, stream, forward, cache = self.stats, self.stream, self.forward, self.cache
        prompt = [int(t) for t in prompt_ids]
        stats.prompt_tokens = len(prompt)
        # Prefill exactly as mlx-lm's generate_step: all but the last prompt
        # token in chunks, then a one-token step.
        tic = time.perf_counter()
        hiddens = []
        with mx.stream(stream):
            rest = prompt
            while len(rest) > 1:
                n = min(prefill_step_size, len(rest) - 1)
                _, h = forward(mx.array(rest[:n])[None], cache)
                mx.eval([c.state for c in cache])
                if h is not None:
                    hiddens.append(h)
                rest = rest[n:]
            logits, h = forward(mx.array(rest)[None], cache)
            y = _greedy(logits)[0]
            mx.eval(y, [c.state for c in cache])
            y = int(y.item())
            if h is not None:
                hiddens.append(h)
        stats.committed = 1
        self.y = y
        with mx.stream(stream):
            for d in self.drafters.values():
                if d.needs_hidden:
                    d.observe(mx.concatenate(hiddens, axis=1), prompt[1:] + [y])
                    if self.policy is not None:
                        d.propose(0)  # the head reads the prompt now, as part of the prefill
                else:
                    d.observe(None, prompt + [y])
        stats.prefill_s = time.perf_counter() - tic
        stats.store_start = stats.store_end = _store_stats(self.store)
        yield y, stats
        if y in self.eos or self.max_tokens <= 1:
            return
        while stats.committed < self.max_tokens:
            remaining = self.max_tokens - stats.committed
            until = None
            if self.policy is not None:
                action = self.policy.next(remaining)
            elif drafting and k_max:
                name = next(iter(self.drafters))
                d = self.drafters[name]
                action = ("draft", name, k_max, False)
                if self.ahead is None and getattr(d, "may_abstain", False) and not d.propose(k_max):
                    # nothing to draft: pipelined plain steps until there is
                    action = ("plain", remaining)
                    until = lambda d=d: bool(d.propose(k_max))
            else:
                action = ("plain", remaining)
            new = []
            if action[0] == "plain" and self.policy is None:
                # nothing times these steps: each token goes out when committed
                stop = yield from self.plain_steps(action[1], until)
            elif action[0] == "plain":
                new, stop = self.plain(action[1], until)
            else:
                new, stop = self.draft_pass(*action[1:])
            stats.store_end = _store_stats(self.store)
            stats.union = [a + b for a, b in zip(self.wave.union if self.wave else (0, 0, 0),
                                                 self.union)]
            stats.policy = self.policy
            for t in new:
                yield t, stats
            if stop:
                return

    def _stop(self, new):
        """``new`` cut at eos or max_tokens; (tokens, whether generation ends)."""
        for i, t in enumerate(new):
            if t in self.eos or self.stats.committed + i + 1 >= self.max_tokens:
                return new[: i + 1], True
        return new, False

    def _feed_pre(self):
        if self.pre:
            # batched rollback of a recurrent state: advance over the
            # accepted tokens again before anything else
            self.forward(mx.array(self.pre)[None], self.cache)
            self.stats.fed += len(self.pre)
            self.pre = []

    def _shadow(self):
        """Shadow proposals of auto's drafters at this position. An MTP head's
        is queued behind the step in flight and read at the next step, so it
        costs the head's compute, not a drained pipeline."""
        self._read_shadows()
        for name, d in self.drafters.items():
            k = self.policy.shadow_k(name)
            if not k:
                continue
            t0 = time.perf_counter()
            if d.needs_hidden:
                drafts = d.propose_lazy(k)
                mx.async_eval(drafts)
                start = len(self.policy.history)
                self.shadows.append((name, drafts, k, start, time.perf_counter() - t0))
            else:
                prop = [int(t) for t in d.propose(k)]
                dt = time.perf_counter() - t0
                self.policy.shadow(name, prop, dt, asked=k)
                self.stats.draft_s += dt

    def _read_shadows(self):
        """Reads the queued shadow proposals; returns the seconds they cost:
        building their graphs and waiting for their compute, which runs after
        the step that was in flight when they were queued."""
        total = 0.0
        for name, drafts, k, start, build_s in self.shadows:
            t0 = time.perf_counter()
            prop = [int(t) for t in drafts.tolist()]
            dt = build_s + time.perf_counter() - t0
            self.policy.shadow(name, prop, dt, asked=k, start=start)
            self.stats.draft_s += dt
            total += dt
        self.shadows = []
        return total

    def plain(self, n, until=None):
        """``plain_steps`` as (tokens, whether generation ends)."""
        out, steps = [], self.plain_steps(n, until)
        while True:
            try:
                out.append(next(steps)[0])
            except StopIteration as end:
                return out, end.value

    def plain_steps(self, n, until=None):
        """Up to ``n`` one-token steps, pipelined as in mlx-lm's generate_step
        (the next step's graph is built before this step's token is read),
        yielding (token, stats) when committed; returns whether generation ends.
        Under auto the step after the last is built too (``self.ahead``), and
        so it is when ``until()``, asked after each committed token, ends the
        steps early (a drafter has something to propose again)."""
        stats, forward, cache, stream = self.stats, self.forward, self.cache, self.stream
        n = min(n, self.max_tokens - stats.committed)
        t0 = time.perf_counter()
        shadow_s = 0.0
        done, stop = 0, False
        with mx.stream(stream):
            self._feed_pre()
            if self.ahead is not None:
                nxt, h = self.ahead
                self.ahead = None
            else:
                logits, h = forward(mx.array([[self.y]]), cache)
                nxt = _greedy(logits)[0]
                mx.async_eval(nxt)
        for i in range(n):
            # the stream is entered per step: the caller runs between yields
            with mx.stream(stream):
                cur, cur_h = nxt, h
                last = i + 1 == n
                ahead = (last and self.policy is not None
                         and stats.committed + 1 < self.max_tokens)
                if not last or ahead:
                    logits, h = forward(cur[None], cache)
                    nxt = _greedy(logits)[0]
                    mx.async_eval(nxt)
                t, stop = self._commit_step(cur, cur_h)
                done += 1
                if not stop and until is not None and not last and until():
                    self.ahead = (nxt, h)  # the next step, already built
                    last = True
                elif not stop and ahead:
                    self.ahead = (nxt, h)
                if not stop and self.policy is not None:
                    ts = time.perf_counter()
                    self._shadow()
                    shadow_s += time.perf_counter() - ts
            yield t, stats
            if stop or last:
                break
        dt = time.perf_counter() - t0
        stats.decode_s += dt
        stats.drafting = False
        if self.policy is not None:
            self.policy.plain(dt - shadow_s, done)
        return stop

    def _commit_step(self, token, hidden):
        """Commits the token of a plain step (``token``: its array, ``hidden``:
        the hidden state that gave it); returns (token, whether generation ends)."""
        stats = self.stats
        t = int(token.item())
        _, stop = self._stop([t])
        stats.committed += 1
        stats.passes += 1
        stats.plain_steps += 1
        stats.fed += 1
        self.y = t
        if not stop:
            self.observe(hidden, [t])
        return t, stop

    def _commit_ahead(self):
        """The next pass drafts: the plain step built ahead of it is kept (its
        token is the greedy one), not computed again. Returns (tokens, stop)."""
        if self.ahead is None:
            return [], False
        nxt, h = self.ahead
        self.ahead = None
        t, stop = self._commit_step(nxt, h)
        return [t], stop

    def _verify(self, inputs, ckpt):
        """Logits (and hidden states) of the verify pass over ``inputs`` (ints,
        or an array whose drafts are not evaluated yet: batched passes only)."""
        from infer.spec.rowwise import RowwiseUnsupported, grow_kv

        cache = self.cache
        n = len(inputs) if isinstance(inputs, list) else inputs.size
        if self.rowwise is not None:
            grow_kv(cache, n)
            try:
                with self.rowwise, self._counting_union(n):
                    logits, hidden = self.forward(mx.array(inputs)[None], cache)
                    mx.eval(logits)
                return logits, hidden
            except RowwiseUnsupported:
                # the model takes a path it cannot compute row by row: undo
                # what the pass did, and verify in lockstep from now on
                ckpt.rollback(0)
                ckpt.__init__(cache)
                self.rowwise = None
                self.verify = self.stats.verify = "exact"
                self.wave = Wavefront(self.forward, self.store, self.stream)
        if self.wave is not None:
            if not isinstance(inputs, list):
                inputs = [int(t) for t in inputs.tolist()]
            rows = self.wave.run(inputs, cache)
            logits = mx.concatenate([r[0] for r in rows], axis=1)
            hidden = mx.concatenate([r[1] for r in rows], axis=1) if self.want_hidden else None
            return logits, hidden
        grow_kv(cache, n)
        with self._counting_union(n):
            logits, hidden = self.forward(mx.array(inputs)[None], cache)
            mx.eval(logits)
        return logits, hidden

    @contextmanager
    def _counting_union(self, n):
        """The union figures of a batched pass: one store call per MoE layer
        fetches the union of the n tokens' experts, each token asked for its
        top k (the lockstep's Wavefront counts them the same way)."""
        store = self.store
        if store is None:
            yield
            return
        gather = store.gather

        def counted(layer, wanted, split=False, decode=False, defer=False):
            self.union[0] += 1
            self.union[1] += len(wanted)
            self.union[2] += n * store.prefetcher.routers.get(layer, (None, len(wanted)))[1]
            return gather(layer, wanted, split, decode, defer)

        store.gather = counted
        try:
            yield
        finally:
            del store.gather

    def draft_pass(self, name, k, probe=False):
        """Draft up to ``k`` tokens with ``name``, verify them, commit."""
        stats, forward, cache = self.stats, self.forward, self.cache
        drafter = self.drafters[name]
        t0 = time.perf_counter()
        shadow_s = self._read_shadows()
        with mx.stream(self.stream):
            first, stop = self._commit_ahead()
        ahead_s = time.perf_counter() - t0 - shadow_s
        if stop:
            stats.decode_s += time.perf_counter() - t0
            if self.policy is not None:
                self.policy.other(ahead_s)
            return first, True
        k = min(k, self.max_tokens - stats.committed - 1)
        if k and not can_roll_back(cache, k + 1):
            k = 0
            stats.no_rollback_passes += 1
        # drafts that a batched verify takes unevaluated: one host sync per pass
        lazy = k > 0 and self.wave is None and hasattr(drafter, "propose_lazy")
        with mx.stream(self.stream):
            td = time.perf_counter()
            if lazy:
                pending = drafter.propose_lazy(k)
                drafts = [None] * k
            else:
                drafts = [int(t) for t in drafter.propose(k)] if k > 0 else []
            draft_s = time.perf_counter() - td
            stats.draft_s += draft_s
            if self.policy is not None:
                # the other drafters' proposals here, to keep their acceptance known
                for other, d in self.drafters.items():
                    if other != name and not d.needs_hidden:
                        k_max = self.policy.k_max
                        self.policy.shadow(other, [int(t) for t in d.propose(k_max)], 0.0, k_max)
            self._feed_pre()
            inputs = [self.y] + drafts
            ckpt = CacheCheckpoint(cache) if drafts else None
            if lazy:
                y = mx.array([self.y], dtype=pending.dtype)
                logits, hidden = self._verify(mx.concatenate([y, pending]), ckpt)
            elif drafts:
                logits, hidden = self._verify(inputs, ckpt)
            else:
                logits, hidden = forward(mx.array(inputs)[None], cache)
            targets = _greedy(logits)
            if lazy:
                mx.eval(targets, pending)
                drafts = [int(t) for t in pending.tolist()]
                inputs = [self.y] + drafts
            else:
                mx.eval(targets)
            targets = [int(t.item()) for t in targets]
            a = 0
            while a < len(drafts) and drafts[a] == targets[a]:
                a += 1
            new = drafts[:a] + [targets[a]]
            if ckpt is not None:
                if a < len(drafts) and not ckpt.rollback(1 + a):
                    self.pre = inputs[: 1 + a]
                ckpt.stop()
            mx.eval([c.state for c in cache])
            new, stop = self._stop(new)
            if not stop:
                self.observe(hidden[:, : len(new), :] if hidden is not None else None, new)
        stats.passes += 1
        stats.fed += len(inputs)
        if drafts:
            stats.draft_passes += 1
            stats.drafted += len(drafts)
            stats.accepted += a
            stats.accept_lens.append(a)
        else:
            stats.plain_steps += 1
        stats.committed += len(new)
        stats.drafting = bool(drafts)
        self.y = new[-1]
        dt = time.perf_counter() - t0
        stats.decode_s += dt
        if self.policy is not None:
            # the step kept from ahead measures nothing: the pass is the rest
            self.policy.other(ahead_s)
            if drafts:
                self.policy.draft_pass(name, len(drafts), a, dt - draft_s - shadow_s - ahead_s,
                                       draft_s, len(new), probe, asked=k)
            else:
                self.policy.other(dt - shadow_s - ahead_s)
        return first + new, stop


def check_draft(draft, model_dir, temp=0.0):
    """Why ``--draft`` cannot be used with this model and temperature, as a
    ValueError with one line; nothing when it can."""
    from infer.spec.mtp import MTP_FILE, has_mtp

    if draft not in DRAFTS:
        raise ValueError(f"--draft must be one of {', '.join(DRAFTS)}")
    if draft == "none":
        return
    if temp != 0:
        raise ValueError("--draft verifies greedy choices: use it with --temp 0")
    if draft == "mtp" and not has_mtp(model_dir):
        raise ValueError(
            f"--draft mtp: {model_dir} has no MTP head (a qwen3_next model with {MTP_FILE}); "
            "use --draft ngram"
        )


class DraftedStream:
    """``mlx_lm.stream_generate``'s responses, from speculative decoding.

    Iterate for ``GenerationResponse`` objects (the eos token, if reached,
    comes last with ``finish_reason == "stop"``, as in mlx-lm); ``stats`` is
    the ``SpecStats`` of the run.
    """

    def __init__(self, model, tokenizer, prompt_ids, model_dir, store, draft="ngram",
                 num_draft=4, max_tokens=256, manifest=None, exact=True, verify=None):
        from infer.spec.mtp import MTPDrafter, has_mtp, load_mtp

        self.model, self.tokenizer = model, tokenizer
        self.prompt = list(prompt_ids)
        self.max_tokens = max_tokens
        mtp = None
        if draft in ("mtp", "auto") and has_mtp(model_dir):
            head = load_mtp(model_dir, model, store, manifest)
            mtp = MTPDrafter(head, model)
        self.kwargs = dict(draft=draft, num_draft=num_draft, mtp=mtp, exact=exact,
                           verify=verify, store=store, eos_ids=tokenizer.eos_token_ids)
        self.stats = None

    def __iter__(self):
        from mlx_lm.generate import GenerationResponse

        detok = self.tokenizer.detokenizer
        detok.reset()
        eos = set(self.tokenizer.eos_token_ids)
        n_prompt = len(self.prompt)
        tic = time.perf_counter()
        token = None
        prompt_tps = 0.0
        for n, (token, self.stats) in enumerate(speculative_generate(
            self.model, self.prompt, max_tokens=self.max_tokens, **self.kwargs
        )):
            if n == 0:
                prompt_tps = n_prompt / (time.perf_counter() - tic)
                tic = time.perf_counter()
            if token in eos:
                break
            detok.add_token(token)
            if n + 1 == self.max_tokens:
                break
            yield GenerationResponse(
                text=detok.last_segment, token=token, logprobs=None, from_draft=False,
                prompt_tokens=n_prompt, prompt_tps=prompt_tps, generation_tokens=n + 1,
                generation_tps=(n + 1) / max(time.perf_counter() - tic, 1e-9),
                peak_memory=mx.get_peak_memory() / 1e9, finish_reason=None,
            )
        if token is None:
            return
        detok.finalize()
        yield GenerationResponse(
            text=detok.last_segment, token=token, logprobs=None, from_draft=False,
            prompt_tokens=n_prompt, prompt_tps=prompt_tps, generation_tokens=n + 1,
            generation_tps=(n + 1) / max(time.perf_counter() - tic, 1e-9),
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason="stop" if token in eos else "length",
        )


# -- measurement (infer bench --draft-check) ----------------------------------------

def mismatch_rows(model, prompt_ids, n_tokens, k, verify="batched"):
    """How often a batched pass of k+1 tokens differs from one-token steps.

    Generates ``n_tokens`` greedily one token at a time, then feeds the same
    tokens again in chunks of k+1 from the same prefill (``verify``:
    "batched" plain batched passes, "rowwise" ``infer.spec.rowwise`` passes), and
    compares the logits row by row. Returns (rows, rows with any bit
    different, rows whose greedy id differs, largest absolute difference).
    """
    from infer.spec.rowwise import RowwisePass, RowwiseUnsupported, grow_kv, supported

    fwd = _Forward(model, want_hidden=False)
    ids = [int(t) for t in prompt_ids]

    def prefill():
        cache = make_cache(model)
        fwd(mx.array(ids[:-1])[None], cache)
        mx.eval([c.state for c in cache])
        return cache

    cache, seq, step_rows = prefill(), [ids[-1]], []
    for _ in range(n_tokens):
        logits, _ = fwd(mx.array([[seq[-1]]]), cache)
        mx.eval(logits)
        step_rows.append(np.array(logits[0, -1].astype(mx.float32)))  # exact: numpy has no bfloat16
        seq.append(int(_greedy(logits)[0].item()))
    cache, batched_rows = prefill(), []
    if verify == "rowwise" and not supported(model, cache):
        return len(step_rows), None, None, None
    for i in range(0, n_tokens, k + 1):
        chunk = seq[i : min(i + k + 1, n_tokens)]
        grow_kv(cache, len(chunk))
        if verify == "rowwise":
            try:
                with RowwisePass(model):
                    logits, _ = fwd(mx.array(chunk)[None], cache)
                    mx.eval(logits)
            except RowwiseUnsupported:
                return len(step_rows), None, None, None
        else:
            logits, _ = fwd(mx.array(chunk)[None], cache)
        mx.eval(logits)
        batched_rows.extend(np.array(logits[0].astype(mx.float32)))
    differ = sum(not np.array_equal(a, b) for a, b in zip(step_rows, batched_rows))
    argmax = sum(int(a.argmax() != b.argmax()) for a, b in zip(step_rows, batched_rows))
    maxdiff = max(float(np.abs(a - b).max()) for a, b in zip(step_rows, batched_rows))
    return len(step_rows), differ, argmax, maxdiff
