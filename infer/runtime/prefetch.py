"""Prediction and prefetch: which experts the next MoE layers will route to,
and the hints that have the source read them ahead.

At each streamed call (``StreamingExperts``) the ``Prefetcher`` guesses the
experts of the next ``depth`` layers from the call's input: the next layers'
routers applied to it, or with a ``calibration`` (``infer.runtime.predict``,
from ``infer prep --calibrate``) the predictor and breadth it chose per layer
and depth. The guesses worth reading in time (``predict.plan``) go to the
source as hints; each later call scores them. ``gate``
(``infer.runtime.gate``) turns prediction off while decode passes run faster
without it. The cache (``ExpertStore``) tells the prefetcher what each call
used (``called``) and how fast its demand reads went (``note_read``).
"""

import itertools
import math
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from infer.runtime import predict
from infer.runtime.gate import PredictionGate

# rows (tokens) of a decode-sized call: one token, or a verify pass of up
# to 7 drafts; a longer call is a prefill, whose guesses are not planned
# (``prefetch``: the next layer's are read once the call has its own)
DECODE_ROWS = 8
# the highest use a guess past its predictor's breadth is planned with: below
# predict.MIN_USE, so such guesses are read in spare disk time only
SPARE_ONLY = math.nextafter(predict.MIN_USE, 0.0)
SPARE_RANKS = 2  # without a calibration: the router's top k x this, the ranks past k for spare time


class Prefetcher:
    """Guesses and hints for ``cache`` (an ``ExpertStore``): see the module docstring."""

    MIN_PRECISION = 0.25  # of guesses, for prefetch to go on (see prefetch_pays)
    PREFETCH_WARMUP = 64  # guessed experts scored before the precision decides
    PRECISION_DECAY = 0.99  # per scored guess set: prefetch_pays follows the last ~100
    CLOCK_DECAY = 0.9  # per decode-sized layer call: the compute time follows the last ~10

    def __init__(self, cache, depth=3, calibration=None):
        self.cache = cache
        self.layouts = cache.layouts
        self.depth = depth
        self.calibration = calibration  # an infer.runtime.predict.Calibration, or None
        # (layer, next layers) -> their linear maps side by side (W, b), as
        # MLX arrays, made on first use
        self._maps = {}
        self.routers = {}  # layer -> (router module, top k)
        self.next_layers = {}  # layer -> the MoE layers after it, in order
        self._order = {}  # layer -> its place among them
        # bytes/s the source reads at: set from the `iod doctor` profile
        # (set_disk) or by the caller; else measured on demand reads
        self.disk_rate = None
        self.disk_ceiling = None  # iod doctor's best rate for that disk (bytes/s)
        self.layer_s = None  # decayed time per MoE layer less its IO waits (decode-sized calls)
        self._recent = {}  # layer -> the experts of its last call of one token's size (<= 2 top-k)
        self.gate = PredictionGate()  # whether prediction pays its host time (measured)
        self.reset_stats()

    def reset_stats(self):
        """Zeroed prediction scores and read-rate figures."""
        # per depth: [true positives, predicted, actual]
        self.prediction = [[0, 0, 0] for _ in range(max(self.depth, 3) + 1)]
        self._predicted = {}  # layer -> {depth: (set of experts, prefetchable)}
        # per depth: decayed [right, guessed] of prefetchable (decode-sized)
        # guesses, which decide whether prefetch pays (prefill's are left out:
        # guessing most of a layer is always right and says nothing)
        self._precision = [[0.0, 0.0] for _ in range(max(self.depth, 3) + 1)]
        self._hinted = {}  # layer -> experts hinted for its next call
        self._mark = None  # (time, IO seconds, layer) at the last streamed call's router
        self._read = [0.0, 0.0]  # decayed [bytes, seconds] of demand reads
        self._last_layer = None  # the layer of the last streamed call

    def set_routers(self, routers):
        self.routers = routers
        order = sorted(routers)
        self.next_layers = {l: order[i + 1 :] for i, l in enumerate(order)}
        self._order = {l: i for i, l in enumerate(order)}

    def set_disk(self, folder):
        """The read rate of the disk ``folder``'s blobs lie on, as `iod doctor`
        measured it at the daemon's queue depth (its knee); None if unprofiled."""
        from shared import disk

        layout = next(iter(self.layouts.values()), None)
        prof = disk.for_path(Path(folder) / layout.file) if layout is not None else None
        self.disk_rate = prof.rate(prof.knee) if prof is not None else None
        self.disk_ceiling = prof.ceiling if prof is not None else None
        return self.disk_rate

    def predict(self, layer, x):
        """Lazy guesses for the next layers: [(layer, depth, ids, use per rank
        or None, breadth)]. The predictor's guess is the first ``breadth`` ids;
        where the calibration measured how often each rank is used, the ids go
        on to its last measured rank (reads for spare disk time:
        ``predict.plan``). ``ids``, best first, are numpy (the recent
        experts) or lazy, (MLX array [rows, guesses, ranks], j, n): the first
        n ranks of its guess j, read back by ``read_guesses``. The linear maps
        of one call go as one matmul and one sort: on MLX CUDA each op is a
        kernel launch, and a call guesses up to ``depth`` layers."""
        out, linear = [], {}  # linear: experts -> [(place in out, next layer, ranks)]
        cal = self.calibration
        module = self.layouts[layer].module if layer in self.layouts else None
        rows = x.size // x.shape[-1]
        for d, nxt in enumerate(self.next_layers.get(layer, [])[: self.depth], 1):
            if nxt in self.cache.stacks and self.cache.stacks[nxt].complete:
                continue  # a whole layer: nothing to read, nothing to score
            router, k = self.routers[nxt]
            name, breadth = cal.choice.get((module, d), ("router", k)) if cal else ("router", k)
            use = cal.use.get((module, d, name)) if cal else None
            recent = self._recent.get(nxt) if name == "temporal" else None
            if name == "temporal" and recent is None:
                name, use = "router", None
            if name == "linear" and (module, self.layouts[nxt].module) not in cal.maps:
                name, use, breadth = "router", None, k  # fitted for other layers (an MTP head's)
            if use is not None:
                wide = max(breadth, len(use))
            elif name == "router":  # uncalibrated: the router's next ranks too, for spare disk time
                wide = min(SPARE_RANKS * breadth, self.layouts[nxt].num_experts)
            else:
                wide = breadth
            if name == "linear":
                linear.setdefault(self.layouts[nxt].num_experts, []).append((len(out), nxt, wide))
                ids = None
            elif name == "temporal":
                ids = np.array(recent)[None]
                breadth = len(recent)  # the recent experts are the guess, all of them
            else:
                scores = router(x)
                if isinstance(scores, tuple):  # routers that select, e.g. DeepSeek's
                    ids, use = scores[0], None
                    ids = (ids.reshape(rows, 1, ids.shape[-1]), 0, ids.shape[-1])
                else:
                    ids = (predict.ranked(scores, wide).reshape(rows, 1, wide), 0, wide)
            out.append((nxt, d, ids, use, breadth))
        for n_experts, group in linear.items():
            key = (layer, tuple(nxt for _, nxt, _ in group))
            if key not in self._maps:
                wbs = [cal.maps[(module, self.layouts[nxt].module)] for _, nxt, _ in group]
                self._maps[key] = (mx.array(np.concatenate([w for w, _ in wbs], axis=1)),
                                   mx.array(np.concatenate([b for _, b in wbs])))
            w, b = self._maps[key]
            scores = predict.linear_scores(x.reshape(rows, x.shape[-1]), w, b)
            order = predict.ranked(scores.reshape(rows, len(group), n_experts), max(g[2] for g in group))
            for j, (i, _, wide) in enumerate(group):
                out[i] = (*out[i][:2], (order, j, wide), *out[i][3:])
        return out

    @staticmethod
    def read_guesses(indices, guesses):
        """A call's routed ``indices`` and its ``guesses``' lazy ids read back
        in one sync (on MLX CUDA each host read of device memory costs):
        (ids, the guesses with numpy ids)."""
        flat, readback = Prefetcher.lazy_ids(guesses)
        if flat is None:
            return np.array(indices), guesses
        host = np.array(mx.concatenate([indices.reshape(-1).astype(mx.uint32), flat]))
        return host[: indices.size].reshape(indices.shape), readback(host[indices.size :])

    @staticmethod
    def lazy_ids(guesses):
        """(flat, readback): the ``guesses``' lazy ids as one flat uint32 MLX
        array (None if none is lazy), and ``readback(host)``, which takes that
        array's values (numpy) to the guesses with numpy ids."""
        lazy, place = [], {}
        for g in guesses:
            if isinstance(g[2], tuple) and id(g[2][0]) not in place:
                place[id(g[2][0])] = len(lazy)
                lazy.append(g[2][0])
        if not lazy:
            return None, lambda host: guesses
        ends = [0, *itertools.accumulate(a.size for a in lazy)]
        shapes = [a.shape for a in lazy]

        def readback(host):
            arrays = [host[a:b].reshape(shape) for shape, a, b in zip(shapes, ends, ends[1:])]
            out = []
            for g in guesses:
                ids = g[2]
                if isinstance(ids, tuple):
                    arr, j, n = ids
                    ids = arrays[place[id(arr)]][:, j, :n]
                out.append((*g[:2], ids, *g[3:]))
            return out

        flat = [a.reshape(-1).astype(mx.uint32) for a in lazy]
        return (flat[0] if len(flat) == 1 else mx.concatenate(flat)), readback

    def prefetch(self, guesses, misses=None):
        """Score ``guesses`` when their layers are called, and hint the source
        to read the ones ``plan`` finds worth reading in time. ``misses``,
        (layer, experts) the calling layer waits for, go first in the same
        message (due now: the daemon reads them as demand reads).

        A prefill's call (more than DECODE_ROWS tokens) hints the next
        layer's guessed experts, every one not cached, unplanned, those
        most rows guessed first, at most half the arena's slots (more would
        evict each other before use in a small arena): it comes here once
        its own experts are in and computing, so the disk reads the next
        layer's while this one computes instead of after its router (a long
        chunk needs most of them; on an H100, 2026-12-07, a 3,716-token
        prefill at 25% spent 67% of its time waiting for reads that started
        at each router)."""
        candidates, ahead = [], []
        for layer, d, ids, use, breadth in guesses:
            rows = np.array(ids).reshape(-1, ids.shape[-1])
            small = rows.shape[0] <= DECODE_ROWS
            guess = set(rows[:, :breadth].ravel().tolist())
            # scored: the predictor's guess, not the ranks past it
            self._predicted.setdefault(layer, {})[d] = (guess, small)
            if not small and d == 1:
                ahead = self._read_ahead(layer, rows[:, :breadth])
            if not small or not self.prefetch_pays(d):
                continue  # still scored: prefetch resumes if guesses improve
            right, guessed = self._precision[d] if d < len(self._precision) else (1.0, 1.0)
            online = right / guessed if guessed >= self.PREFETCH_WARMUP else 1.0
            # each expert's best rank over the rows: the first it takes in
            # rank order (built from the end: a dict keeps the last value)
            n, width = rows.shape
            rank = dict(zip(rows.T.ravel()[::-1].tolist(), np.repeat(np.arange(width), n)[::-1].tolist()))
            fresh = self._fresh(layer, rank.keys())
            for e in sorted(fresh, key=lambda e: (rank[e], e)):  # plan breaks ties in this order
                r = rank[e]
                p = float(use[r]) if use is not None and r < len(use) else online
                if r >= breadth:  # past the predictor's guess: read in spare disk time only
                    p = min(p, SPARE_ONLY)
                candidates.append((p, d, layer, e))
        hints = ahead
        if candidates:
            rec = self.layouts[candidates[0][2]].record_bytes
            # hints outstanding for the layers planned (the calling layer's own
            # are being used now, and may not be counted off yet)
            pending = sum(len(self._hinted.get(g[0], ())) for g in guesses)
            chosen = predict.plan(candidates, self.reads_in, rec, pending)
            by_layer = {}
            for _, d, layer, e in chosen:
                by_layer.setdefault((layer, d), []).append(e)
            hints = [(layer, sorted(experts), d) for (layer, d), experts in sorted(by_layer.items())]
        if not hints:
            if misses:
                self.start_reads(*misses)
            return
        first = [(misses[0], list(misses[1]), 0)] if misses else []
        sent = self.cache.call_source("prefetch_many", first + hints)
        for (layer, _, _), hinted in zip(hints, sent[len(first):]):
            self._hinted.setdefault(layer, set()).update(hinted)
            self.cache.stats["prefetched"] += len(hinted)
            self.cache.stats["prefetched_bytes"] += len(hinted) * self.layouts[layer].record_bytes

    def _read_ahead(self, layer, guessed):
        """A prefill's hint for the next ``layer``: of the experts in
        ``guessed`` (its rows' guesses), the fresh ones, most rows' first,
        at most half the arena's slots; [] or [(layer, experts, 1)]."""
        experts, rows = np.unique(guessed, return_counts=True)
        fresh = self._fresh(layer, experts.tolist())
        order = [e for _, e in sorted(zip(-rows, experts.tolist())) if e in fresh]
        layout = getattr(self.cache.source, "layout", None)
        if layout is not None:
            order = order[: layout.slot_count // 2]
        return [(layer, sorted(order), 1)] if order else []

    def _fresh(self, layer, experts):
        """Of ``experts``, those a read would bring: not cached, not hinted,
        not ready in the arena."""
        fresh = set(experts) - self.cache.stack(layer).position.keys() - self._hinted.get(layer, set())
        if fresh and self.cache.source is not None:
            fresh = set(self.cache.call_source("not_ready", layer, fresh))
        return fresh

    def start_reads(self, layer, experts):
        """Have the source start reading ``experts`` (a call's misses) now, so
        they arrive while the call computes its cached experts."""
        self.cache.call_source("prefetch", layer, experts, 0)

    def read_rate(self):
        """Bytes/s reads are planned with: the profiled disk's, else the rate
        measured on demand reads, else None (unknown: no limit)."""
        if self.disk_rate:
            return self.disk_rate
        nbytes, secs = self._read
        return nbytes / secs if secs > 0 else None

    def reads_in(self, depth, record_bytes):
        """Records the source can read before the layer ``depth`` calls ahead
        asks for them (inf while the rate or the compute time is unmeasured)."""
        rate = self.read_rate()
        if rate is None or self.layer_s is None:
            return float("inf")
        return depth * self.layer_s * rate / record_bytes

    def begin_call(self, layer, rows):
        """At a streamed call's router, before its guesses: whether this call
        of ``rows`` tokens predicts. A decode-sized call at a layer before the
        last streamed call's starts a pass for the gate (timed if one token);
        a larger call's pass is not timed. (A model with one streamed layer
        starts no pass: its gate stays as it began.)"""
        if self.depth == 0:
            return False
        if rows > DECODE_ROWS:
            self.gate.discard()
        elif self._last_layer is not None and layer < self._last_layer:
            self.gate.start_pass(time.monotonic(), timed=rows == 1)
        self._last_layer = layer
        return self.gate.on

    def clock(self, layer, small):
        """At a streamed call's router, after its sync: the time since the
        previous streamed call's router in the same pass, less the IO waited
        for in between, per layer passed, updates ``layer_s`` for
        decode-sized calls. That is the time the disk has for reads ahead
        while a layer runs: its attention, its experts and the calls' host
        work (hints go out at a call, before its own host work is done)."""
        now = time.monotonic()
        if self._mark is not None and small:
            t, io, prev = self._mark
            passed = self._order.get(layer, 0) - self._order.get(prev, 0)
            if passed > 0:  # a later layer of the same pass
                dt = max(now - t - (self.cache.io_s - io), 0.0) / passed
                a = self.CLOCK_DECAY
                self.layer_s = dt if self.layer_s is None else a * self.layer_s + (1 - a) * dt
        self._mark = (now, self.cache.io_s, layer)

    def prefetch_pays(self, depth):
        """Whether guesses at ``depth`` are right often enough to be read
        ahead: a wrong guess costs a read (and, when reads are the bottleneck,
        a demand read's turn), a right one saves a stall. Measured, not
        assumed: prefetch runs until ``PREFETCH_WARMUP`` guesses are scored,
        then only while their recent precision (decode-sized guesses, decayed
        by ``PRECISION_DECAY`` per guess) is at least ``MIN_PRECISION``."""
        if depth >= len(self._precision):
            return True
        right, guessed = self._precision[depth]
        return guessed < self.PREFETCH_WARMUP or right >= self.MIN_PRECISION * guessed

    def score(self, layer, actual):
        """Score the guesses made for this call; returns their union."""
        guessed = set()
        for d, (guess, small) in self._predicted.pop(layer, {}).items():
            guessed |= guess
            if d >= len(self.prediction):
                continue
            row = self.prediction[d]
            right = len(guess & actual)
            row[0] += right
            row[1] += len(guess)
            row[2] += len(actual)
            if small and d < len(self._precision):
                g = self._precision[d]
                g[0] = g[0] * self.PRECISION_DECAY + right
                g[1] = g[1] * self.PRECISION_DECAY + len(guess)
        return guessed

    def count_prefetch(self, layer, actual):
        """Hinted records this call did not use: read (or queued) for nothing.
        Returns the experts hinted for this call."""
        hinted = self._hinted.pop(layer, None)
        if hinted:
            unused = len(hinted - actual)
            self.cache.stats["prefetch_used"] += len(hinted) - unused
            self.cache.stats["prefetch_unused"] += unused
            self.cache.stats["prefetch_unused_bytes"] += unused * self.layouts[layer].record_bytes
        return hinted

    def count_misses(self, layer, missing, hinted, guessed):
        """A call's misses: ready in the arena (read ahead, or left by an
        earlier read), hinted but not read yet (late), guessed but not hinted
        (the plan or the precision gate left them out), or never guessed."""
        if self.cache.source is None:
            return
        waiting = set(self.cache.call_source("not_ready", layer, missing))
        unhinted = waiting - hinted
        self.cache.stats["miss_ready"] += len(missing) - len(waiting)
        self.cache.stats["miss_late"] += len(waiting & hinted)
        self.cache.stats["miss_unplanned"] += len(unhinted & guessed)
        self.cache.stats["miss_cold"] += len(unhinted - guessed)

    def prediction_stats(self):
        """Recall and precision of the prediction, per depth."""
        out = {}
        for d, (tp, predicted, actual) in enumerate(self.prediction):
            if actual:
                out[d] = {
                    "recall": tp / actual,
                    "precision": tp / predicted if predicted else 0.0,
                }
        return out

    def called(self, layer, wanted):
        """A call of ``layer`` uses ``wanted``: score the guesses made for it
        and count the hints it did not use. Returns (the experts guessed for
        it, those hinted for it or None)."""
        guessed = self.score(layer, set(wanted)) if self._predicted else set()
        hinted = self.count_prefetch(layer, set(wanted)) if self._hinted else None
        if len(wanted) <= 2 * self.routers.get(layer, (None, len(wanted)))[1]:
            self._recent[layer] = wanted
        return guessed, hinted

    def note_read(self, nbytes, seconds):
        """A demand read of ``nbytes`` waited ``seconds``: the read rate seen
        by demand (decayed). Arena hits make it look faster, so a profiled
        disk (set_disk) is preferred."""
        a = self.CLOCK_DECAY
        self._read = [a * self._read[0] + nbytes, a * self._read[1] + seconds]
