"""Speculative decoding under streaming: draft K tokens, verify them in one pass.

A drafter (n-gram prompt lookup, or Qwen3-Next's MTP head) proposes K tokens;
the target model scores ``[last token] + drafts`` in one verify pass, the
longest prefix that matches the target's greedy choice is committed plus the
target's own next token, and the caches are rolled back to the last accepted
token. Greedy (temperature 0) only.

Two verify modes:

- ``exact=True`` (default): the K+1 tokens go through the model as K+1
  one-token forward passes, run in lockstep layer by layer (one thread per
  token, only one running at a time). At every MoE layer the experts of all
  K+1 tokens are fetched together, as one union request, and then each token
  computes with exactly the shapes and cache contents of plain one-token
  decoding, so its logits are bit-identical to non-speculative decoding by
  construction. It saves reads and round trips (the union is fetched once,
  the IO of K+1 tokens is merged), not compute.
- ``exact=False``: one batched forward pass over the K+1 tokens. Cheaper in
  compute, but a kernel may accumulate differently for M>1 rows than for one,
  so it is not exact by construction (see docs/speculative.md for the measured
  mismatch rate).

Rollback: attention KV caches are trimmed; caches that cannot be trimmed
(the Gated-DeltaNet conv and recurrent state in ``ArraysCache``, sliding-window
ring buffers) record their state after every update during a verify and are
put back to the one after the last accepted token (exact verify), or, after a
batched pass, to the state before it, with the accepted tokens fed again at
the start of the next pass.
"""

import threading
import time
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, RotatingKVCache, make_prompt_cache

from .ngram import NgramDrafter

DRAFTS = ("none", "ngram", "mtp", "auto")


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
    """One stream that the lockstep verify's threads share (they take turns)."""
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

    Token j's pass runs only after token j-1's pass has reached the same MoE
    layer, so every cache sees the same updates in the same order as
    step-by-step decoding. At each MoE layer the last token's thread fetches
    the union of all n tokens' experts with one store call; each token then
    computes with its own experts, as in one-token decoding.
    """

    def __init__(self, forward, store=None, stream=None):
        self.forward = forward
        self.store = store
        self.stream = stream or shared_stream()

    def run(self, tokens, cache):
        n = len(tokens)
        self._n = n
        self._error = None
        self._wanted = [None] * n
        self._fetched = None
        # one event per token: a handoff wakes only the next thread
        self._turn = [threading.Event() for _ in range(n)]
        self._turn[0].set()
        self._local = threading.local()
        results = [None] * n
        if self.store is not None:
            self.store.gather = self._hook
        try:
            threads = [
                threading.Thread(target=self._work, args=(j, tokens[j], cache, results))
                for j in range(n)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            if self.store is not None:
                del self.store.gather
        if self._error is not None:
            raise self._error
        return results

    def _wait(self, j):
        self._turn[j].wait()
        self._turn[j].clear()
        if self._error is not None:
            raise _Aborted()

    def _pass(self, j):
        self._turn[(j + 1) % self._n].set()

    def _work(self, j, token, cache, results):
        self._local.j = j
        try:
            self._wait(j)
            with mx.stream(self.stream):
                logits, hidden = self.forward(mx.array([[token]]), cache)
                results[j] = (logits, hidden)
            self._pass(j)
        except _Aborted:
            pass
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            if self._error is None:
                self._error = e
            for ev in self._turn:
                ev.set()

    def _hook(self, layer, wanted):
        # stands in for ExpertStore.gather during the run
        j = self._local.j
        self._wanted[j] = (layer, [int(e) for e in wanted])
        if j == self._n - 1:
            layers = {w[0] for w in self._wanted}
            if len(layers) != 1:
                raise RuntimeError(f"wavefront out of step: layers {sorted(layers)}")
            union = sorted(set().union(*(w[1] for w in self._wanted)))
            arrays, positions = type(self.store).gather(self.store, layer, np.array(union))
            self._fetched = (arrays, dict(zip(union, positions)))
        self._pass(j)
        self._wait(j)
        arrays, positions = self._fetched
        return arrays, [positions[e] for e in self._wanted[j][1]]


class _Aborted(Exception):
    pass


@dataclass
class SpecStats:
    """What a speculative generation did; ``summary()`` gives the figures."""

    draft: str = "none"
    k: int = 0
    exact: bool = True
    prompt_tokens: int = 0
    committed: int = 0
    passes: int = 0  # target-model passes while decoding
    draft_passes: int = 0  # passes that verified at least one drafted token
    drafted: int = 0
    accepted: int = 0
    fed: int = 0  # tokens fed through the target model while decoding
    accept_lens: list = field(default_factory=list)  # accepted drafts per draft pass
    prefill_s: float = 0.0
    decode_s: float = 0.0
    draft_s: float = 0.0
    no_rollback_passes: int = 0  # passes not drafted: a cache could not roll back
    drafting: bool = True  # the current decision of --draft auto
    auto_log: list = field(default_factory=list)
    store_start: dict = field(default_factory=dict)
    store_end: dict = field(default_factory=dict)

    def summary(self):
        n = max(self.committed, 1)
        decoded = max(self.committed - 1, 0)
        d = {
            k: self.store_end.get(k, 0) - self.store_start.get(k, 0)
            for k in ("hits", "misses", "fetched_bytes")
        }
        lookups = d["hits"] + d["misses"]
        return {
            "kind": self.draft,
            "k": self.k,
            "exact": self.exact,
            "tokens": self.committed,
            "passes": self.passes,
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
            "experts_per_token": d["misses"] / n,
            "lookups_per_token": lookups / n,
            "hit_rate": d["hits"] / lookups if lookups else 0.0,
            "bytes_read_per_token": d["fetched_bytes"] / n,
            "no_rollback_passes": self.no_rollback_passes,
            "auto": self.auto_log,
        }


class AutoPolicy:
    """``--draft auto``: keep drafting only while it costs less per token.

    Probes ``probe`` plain one-token steps and ``probe`` drafting passes,
    compares the measured wall time per committed token (which includes the
    stalls of cache misses and the drafter's own cost), keeps the cheaper
    for the next ``recheck`` tokens, then probes again.
    """

    def __init__(self, probe=6, recheck=96):
        self.probe = probe
        self.recheck = recheck
        self.phase = "plain"
        self.samples = {"plain": [], "draft": []}
        self.until = 0
        self.choice = True

    def drafting(self, committed):
        if self.phase == "decided":
            if committed < self.until:
                return self.choice
            self.phase, self.samples = "plain", {"plain": [], "draft": []}
        return self.phase == "draft"

    def record(self, seconds, tokens, committed, log):
        if self.phase == "decided":
            return
        key = self.phase
        self.samples[key].append((seconds, tokens))
        if len(self.samples[key]) < self.probe:
            return
        if key == "plain":
            self.phase = "draft"
            return
        # skip the first sample of each phase: it pays the switch's warm-up
        cost = {
            k: sum(s for s, _ in v[1:]) / max(sum(t for _, t in v[1:]), 1)
            for k, v in self.samples.items()
        }
        self.choice = cost["draft"] < cost["plain"]
        self.phase, self.until = "decided", committed + self.recheck
        log.append({
            "at": committed,
            "plain_s_per_token": cost["plain"],
            "draft_s_per_token": cost["draft"],
            "drafting": self.choice,
        })


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
    auto_probe=6,
    auto_recheck=96,
    drafter=None,
):
    """Greedy generation with drafting; yields ``(token id, SpecStats)``.

    ``draft``: "none" | "ngram" | "mtp" | "auto" (n-gram lookup, or MTP when
    ``mtp`` is given, switched off while it does not pay). ``mtp``: an
    ``infer.mtp.MTPDrafter`` (required for "mtp"). ``drafter``: any object
    with ``needs_hidden``, ``observe(hidden, tokens)`` and ``propose(k)``,
    used instead of the built-in ones. ``store``: the model's
    ExpertStore; with ``exact`` the verify fetches the union of the batch's
    experts through it, and its stats give the bytes per token. The ids equal
    non-speculative greedy decoding; with ``exact=False`` up to floating-point
    differences of batched verification.
    """
    if draft not in DRAFTS:
        raise ValueError(f"unknown draft {draft!r} (choose from {', '.join(DRAFTS)})")
    if draft == "mtp" and mtp is None:
        raise ValueError("draft 'mtp' needs an MTP head")
    if drafter is None:
        use_mtp = mtp is not None and draft in ("mtp", "auto")
        drafter = mtp if use_mtp else NgramDrafter(max_n=ngram_max)
    use_mtp = drafter.needs_hidden
    k_max = 0 if draft == "none" else max(0, int(num_draft))
    policy = AutoPolicy(auto_probe, auto_recheck) if draft == "auto" else None
    kind = f"auto:{'mtp' if use_mtp else 'ngram'}" if draft == "auto" else draft
    stats = SpecStats(draft=kind, k=k_max, exact=exact)
    eos = {int(e) for e in eos_ids}
    stream = shared_stream()
    forward = _Forward(model, want_hidden=use_mtp)
    wave = Wavefront(forward, store, stream) if exact else None
    cache = make_cache(model)
    prompt = [int(t) for t in prompt_ids]
    stats.prompt_tokens = len(prompt)
    stats.store_start = _store_stats(store)

    # Prefill exactly as mlx-lm's generate_step: all but the last prompt token
    # in chunks, then a one-token step.
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
    stats.prefill_s = time.perf_counter() - tic
    stats.committed = 1
    with mx.stream(stream):
        if use_mtp:
            drafter.observe(mx.concatenate(hiddens, axis=1), prompt[1:] + [y])
        else:
            drafter.observe(None, prompt + [y])
    stats.store_end = _store_stats(store)
    yield y, stats
    if y in eos or max_tokens <= 1:
        return

    pre = []  # accepted tokens to feed again (batched mode, recurrent caches)
    committed = 1
    while committed < max_tokens:
        t0 = time.perf_counter()
        drafting = policy.drafting(committed) if policy else k_max > 0
        stats.drafting = drafting
        k = min(k_max, max_tokens - committed - 1) if drafting else 0
        while k and not can_roll_back(cache, k + 1):
            k -= 1  # a sliding-window cache about to wrap: draft less or none
        if drafting and k_max and not k and committed < max_tokens - 1:
            stats.no_rollback_passes += 1
        with mx.stream(stream):
            td = time.perf_counter()
            drafts = [int(t) for t in drafter.propose(k)] if k > 0 else []
            stats.draft_s += time.perf_counter() - td
            if pre:
                # batched rollback of a recurrent state: advance over the
                # accepted tokens again before checkpointing
                forward(mx.array(pre)[None], cache)
                stats.fed += len(pre)
                pre = []
            inputs = [y] + drafts
            ckpt = CacheCheckpoint(cache) if drafts else None
            if drafts and exact:
                rows = wave.run(inputs, cache)
                logits = mx.concatenate([r[0] for r in rows], axis=1)
                hidden = mx.concatenate([r[1] for r in rows], axis=1) if use_mtp else None
            else:
                logits, hidden = forward(mx.array(inputs)[None], cache)
            targets = _greedy(logits)
            mx.eval(targets)
            targets = [int(t.item()) for t in targets]
            a = 0
            while a < len(drafts) and drafts[a] == targets[a]:
                a += 1
            new = drafts[:a] + [targets[a]]
            fed_valid = 1 + a
            if ckpt is not None:
                if a < len(drafts) and not ckpt.rollback(fed_valid):
                    pre = inputs[:fed_valid]
                ckpt.stop()
            mx.eval([c.state for c in cache])
        stats.passes += 1
        stats.fed += len(inputs)
        if drafts:
            stats.draft_passes += 1
            stats.drafted += len(drafts)
            stats.accepted += a
            stats.accept_lens.append(a)
        # stop at eos or at max_tokens
        stop = False
        for i, t in enumerate(new):
            if t in eos or committed + i + 1 >= max_tokens:
                new, stop = new[: i + 1], True
                break
        if not stop:
            with mx.stream(stream):
                drafter.observe(hidden[:, : len(new), :] if use_mtp else None, new)
        committed += len(new)
        stats.committed = committed
        y = new[-1]
        dt = time.perf_counter() - t0
        stats.decode_s += dt
        if policy:
            policy.record(dt, len(new), committed, stats.auto_log)
        stats.store_end = _store_stats(store)
        for t in new:
            yield t, stats
        if stop:
            return


def check_draft(draft, model_dir, temp=0.0):
    """Why ``--draft`` cannot be used with this model and temperature, as a
    ValueError with one line; nothing when it can."""
    from .mtp import MTP_FILE, has_mtp

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
                 num_draft=4, max_tokens=256, manifest=None, exact=True):
        from .mtp import MTPDrafter, has_mtp, load_mtp

        self.model, self.tokenizer = model, tokenizer
        self.prompt = list(prompt_ids)
        self.max_tokens = max_tokens
        mtp = None
        if draft in ("mtp", "auto") and has_mtp(model_dir):
            head = load_mtp(model_dir, model, store, manifest)
            mtp = MTPDrafter(head, model)
        self.kwargs = dict(draft=draft, num_draft=num_draft, mtp=mtp, exact=exact,
                           store=store, eos_ids=tokenizer.eos_token_ids)
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


# -- measurement: python -m infer.speculative --model DIR ---------------------------

BENCH_PROMPTS = {
    "code": "Continue this code:\n" + "".join(
        f"def add_{i}(x):\n    return x + {i}\n\n" for i in range(8)
    ),
    "list": "Continue the list: " + ", ".join(["red", "green", "blue", "yellow"] * 6),
    "free": "The lighthouse keeper counted the ships that passed in the night",
}


def _bench_parser():
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m infer.speculative",
        description="speculative decoding against plain greedy decoding, in one process",
    )
    p.add_argument("--model", required=True, help="prep folder")
    p.add_argument("--draft", default="ngram", choices=("ngram", "mtp"))
    p.add_argument("--k", default="1,2,3,4", help="draft lengths, comma separated")
    p.add_argument("--modes", default="exact,fast", help="exact, fast or both")
    p.add_argument("--prompts", default="code,free", help=f"of {','.join(BENCH_PROMPTS)}")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--cache", type=float, default=0.25, help="expert cache, fraction of all experts")
    p.add_argument("--read-rate", type=float, default=0.0,
                   help="emulate a slower device: MB/s for the reads (0: as fast as it goes)")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--mismatch", action="store_true",
                   help="only compare batched-pass logits with one-token steps, bit for bit")
    return p


def mismatch_rows(model, prompt_ids, n_tokens, k):
    """How often a batched pass of k+1 tokens differs from one-token steps.

    Generates ``n_tokens`` greedily one token at a time, then feeds the same
    tokens again in chunks of k+1 from the same prefill, and compares the
    logits row by row. Returns (rows, rows with any bit different, rows whose
    greedy id differs, largest absolute difference).
    """
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
        step_rows.append(np.array(logits[0, -1]))
        seq.append(int(_greedy(logits)[0].item()))
    cache, batched_rows = prefill(), []
    for i in range(0, n_tokens, k + 1):
        logits, _ = fwd(mx.array(seq[i : min(i + k + 1, n_tokens)])[None], cache)
        mx.eval(logits)
        batched_rows.extend(np.array(logits[0]))
    differ = sum(not np.array_equal(a, b) for a, b in zip(step_rows, batched_rows))
    argmax = sum(int(a.argmax() != b.argmax()) for a, b in zip(step_rows, batched_rows))
    maxdiff = max(float(np.abs(a - b).max()) for a, b in zip(step_rows, batched_rows))
    return len(step_rows), differ, argmax, maxdiff


def bench_main(argv=None):
    import json
    import statistics
    import sys

    from .loader import check_prep_folder, load_streaming
    from .mtp import MTPDrafter, has_mtp, load_mtp
    from .run import encode_prompt
    from iod.inproc import InprocSource

    args = _bench_parser().parse_args(argv)
    manifest = check_prep_folder(args.model)
    if args.draft == "mtp" and not has_mtp(args.model):
        print(f"{args.model} has no MTP head", file=sys.stderr)
        return 2
    source = InprocSource(args.model, workers=1, read_rate=args.read_rate * 1e6)
    cache_bytes = int(manifest.expert_bytes * args.cache)
    model, tokenizer, store = load_streaming(args.model, source, cache_bytes)
    head = load_mtp(args.model, model, store, manifest) if args.draft == "mtp" else None
    if args.mismatch:
        for name in args.prompts.split(","):
            ids = encode_prompt(tokenizer, BENCH_PROMPTS[name])
            for k in [int(k) for k in args.k.split(",")]:
                n, differ, argmax, maxdiff = mismatch_rows(model, ids, args.max_tokens, k)
                print(f"{name:5s} K={k}: {differ}/{n} logit rows differ bitwise, "
                      f"{argmax} greedy ids differ, max |diff| {maxdiff:.3g}", flush=True)
        source.close()
        return 0

    def once(ids, draft, k, exact):
        store.stacks.clear()  # every run starts with an empty expert cache
        mtp = MTPDrafter(head, model) if head is not None and draft == "mtp" else None
        out, stats = [], None
        for t, stats in speculative_generate(
            model, ids, draft=draft, num_draft=k, max_tokens=args.max_tokens,
            mtp=mtp, exact=exact, store=store,
        ):
            out.append(t)
        return out, stats.summary()

    rows = []
    ks = [int(k) for k in args.k.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    for name in args.prompts.split(","):
        ids = encode_prompt(tokenizer, BENCH_PROMPTS[name])
        configs = [("none", 0, True)] + [(args.draft, k, m == "exact") for k in ks for m in modes]
        results = {c: [] for c in configs}
        # interleave the configurations run by run, so load drifts hit all alike
        for _ in range(args.runs):
            for c in configs:
                results[c].append(once(ids, *c))
        base_ids = results[configs[0]][0][0]
        base_tps = statistics.median(s["decode_tok_s"] for _, s in results[configs[0]])
        for c in configs:
            tps = [s["decode_tok_s"] for _, s in results[c]]
            s = results[c][0][1]
            first_diff = next(
                (i for i, (a, b) in enumerate(zip(results[c][0][0], base_ids)) if a != b), None
            )
            row = {
                "prompt": name, "kind": c[0], "k": c[1],
                "mode": "exact" if c[2] else "fast",
                "accept_len": s["accept_len"], "acceptance_rate": s["acceptance_rate"],
                "decode_tok_s": statistics.median(tps), "decode_tok_s_runs": tps,
                "baseline_decode_tok_s": base_tps,
                "speedup": statistics.median(tps) / base_tps if base_tps else 0.0,
                "experts_per_token": s["experts_per_token"],
                "bytes_read_per_token": s["bytes_read_per_token"],
                "hit_rate": s["hit_rate"], "draft_s": s["draft_s"], "decode_s": s["decode_s"],
                "same_ids": results[c][0][0] == base_ids, "first_diff": first_diff,
                "tokens": len(results[c][0][0]),
            }
            rows.append(row)
            print(
                f"{name:5s} {c[0]:5s} K={c[1]} {row['mode']:5s} accept_len {row['accept_len']:.2f} "
                f"tok/s {row['decode_tok_s']:.2f} [{min(tps):.2f}-{max(tps):.2f}] "
                f"x{row['speedup']:.2f} experts/tok {row['experts_per_token']:.1f} "
                f"MB/tok {row['bytes_read_per_token'] / 1e6:.2f} same_ids {row['same_ids']}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": str(args.model), "max_tokens": args.max_tokens,
                       "cache": args.cache, "read_rate": args.read_rate, "runs": args.runs,
                       "rows": rows}, f, indent=1)
    source.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(bench_main())
