"""``--draft auto``: draft only where it pays, decided from measured costs.

Drafting with drafter X and K drafts per pass pays when the tokens a pass
commits outweigh what the pass costs, in units of one plain decoding step
(t1, measured on the plain steps):

    speedup(X, K) = sum(tokens per pass) / sum(cost per pass)
    cost = T(k) / t1 + k * c(X)      (k = drafts proposed, at most K)

- ``T(k)``: the measured wall time of a verify pass over k+1 tokens, its
  reads (the union of the batch's experts, once) and rollback included,
  per drafter (an MTP head's steps can run in the verify pass's graph);
  for a k not measured yet, ``1 + beta * k`` with beta fitted on the
  drafter's measured passes. Measurements go stale after ``FRESH`` tokens.
- ``c(X)``: the drafter's own time per drafted token, over t1 (n-gram: ~0).
- tokens per pass: 1 + the drafts accepted. Acceptance comes from every
  proposal checked against the tokens that followed it: the real passes',
  and shadow proposals made during plain steps (every step and K drafts
  for n-gram, whose lookups cost nothing; one draft for MTP, within
  ``SHADOW_FRACTION`` of the decode time). Where a proposal was cut by the
  number asked for (a one-draft shadow, a pass of a smaller K) and all of
  it was right, the drafts it did not make are counted as accepted with the
  drafter's measured rate per position, until passes of that K measure it.

Passes spent to measure T(k) (probes) are limited: the first is one draft
(the least a pass can lose), and only where the acceptance seen says
drafting would pay even if a verify pass cost one plain step; a further K is
probed only where the cost fitted on the first says it would pay; drafting
itself needs two measurements of its K; and a probe runs only if what probes
lost, this probe's loss included should it accept nothing, stays under
``LOSS_FRACTION`` of the generation's decode time (its planned tokens at the
measured step time, or the time so far if longer: a short generation has
too little left to win back what a probe loses). So where nothing is
accepted (no repetition for the n-gram drafter, an untrained MTP head)
auto costs the shadow lookups only, and where the verify
costs too much (K+1 one-token passes on a CPU) it costs one probe of one
draft per ``FRESH`` tokens, and none in a generation shorter than about
1 / ``LOSS_FRACTION`` tokens. While drafting, each pass re-measures T(k) and
the acceptance, and the plain step time is re-measured every ``T1_FRESH``
tokens.
"""

import statistics
from collections import deque


class AutoPolicy:
    WINDOW = 48  # recent proposals per drafter the acceptance is taken from
    MIN_PROPOSALS = 6  # before a drafter is judged
    MARGIN = 0.05  # predicted speedup must exceed 1 + MARGIN to draft
    LOSS_FRACTION = 0.01  # of the generation's decode time, what probes may lose
    SHADOW_FRACTION = 0.01  # of the decode time, what costly shadow proposals may take
    SHADOW_PRIOR = 0.25  # a costly drafter's step, in plain steps, until measured
    FRESH = 256  # committed tokens a verify-cost measurement stays valid
    T1_FRESH = 64  # while drafting, tokens until the plain step is measured again
    CHUNK = 8  # plain steps per chunk (pipelined, as mlx-lm's generate_step)
    REFRESH = 4  # plain steps that re-measure t1 while drafting

    def __init__(self, k_max, drafters, prior_beta=1.0):
        """``drafters``: {name: True if its proposals cost model time (MTP)}."""
        self.k_max = max(1, int(k_max))
        self.costly = dict(drafters)
        self.prior_beta = prior_beta
        # per drafter: (drafts asked for, proposed, accepted)
        self.outcomes = {n: deque(maxlen=self.WINDOW) for n in drafters}
        self.pending = []  # shadow proposals: (name, first index, proposal)
        self.history = []  # committed tokens since decoding began
        self.t1 = deque(maxlen=16)  # (seconds per plain step, committed at)
        self.passes = deque(maxlen=24)  # (drafter, k, T / t1, committed at)
        # seconds per drafted token: recent samples per costly drafter (the
        # median: a first, cold proposal must not stand for all of them)
        self.draft_times = {n: deque(maxlen=8) for n, c in drafters.items() if c}
        self.decode_s = 0.0
        self.shadow_s = 0.0
        self.probe_loss = 0.0
        self.state = ("plain",)
        self.last_t1_at = 0
        self.planned = 0  # tokens this generation may commit (committed + remaining)
        self.log = []

    # -- what the decoder reports ----------------------------------------------

    def tokens(self, new):
        """Committed tokens, in order: resolves the shadow proposals."""
        self.history.extend(int(t) for t in new)
        n = len(self.history)
        keep = []
        for name, start, asked, prop in self.pending:
            a = 0
            while a < len(prop) and start + a < n and self.history[start + a] == prop[a]:
                a += 1
            if a == len(prop) or start + a < n:  # all seen, or a mismatch seen
                self.outcomes[name].append((asked, len(prop), a))
            else:
                keep.append((name, start, asked, prop))
        self.pending = keep

    def shadow_k(self, name):
        """Drafts to propose in shadow now (0: none): K for n-gram at every
        step, one for a costly drafter while its share of the time allows
        (the MTP head's catch-up before a proposal is bounded by its
        ``MAX_BACKLOG``, so one proposal's cost stays near the estimate)."""
        if name not in self.costly:
            return 0  # a drafter this policy does not judge
        if not self.costly[name]:
            return self.k_max
        t1 = self.plain_time()
        if t1 is None:
            return 0
        cost = self.draft_cost(name)
        est = cost if cost is not None else self.SHADOW_PRIOR * t1
        return 1 if self.shadow_s + est <= self.SHADOW_FRACTION * self.decode_s else 0

    def shadow(self, name, proposal, seconds, asked=None, start=None):
        """A shadow proposal made when ``start`` tokens were committed (default:
        now; an MTP head's proposal is read a step after it is made)."""
        if name not in self.costly:
            return
        asked = len(proposal) if asked is None else asked
        start = len(self.history) if start is None else start
        self.shadow_s += seconds
        self._draft_time(name, seconds, len(proposal))
        if proposal:
            self.pending.append((name, start, asked, [int(t) for t in proposal]))
        else:
            self.outcomes[name].append((asked, 0, 0))

    def plain(self, seconds, n):
        """``n`` plain steps took ``seconds`` (shadow time excluded)."""
        self.decode_s += seconds
        if n > 0:
            self.t1.append((seconds / n, len(self.history)))
            self.last_t1_at = len(self.history)

    def other(self, seconds):
        """Decode time that measures nothing (a pass with nothing drafted)."""
        self.decode_s += seconds

    def draft_pass(self, name, k, accepted, seconds, draft_seconds, committed_tokens, probe,
                   asked=None):
        """A verify pass of ``k`` drafts from ``name`` (``accepted`` of them;
        ``asked``: the K of the pass)."""
        self.decode_s += seconds + draft_seconds
        self.outcomes[name].append((k if asked is None else asked, k, accepted))
        self._draft_time(name, draft_seconds, k)
        t1 = self.plain_time()
        if t1 and k:
            self.passes.append((name, k, seconds / t1, len(self.history)))
        if probe and t1:
            self.probe_loss += seconds + draft_seconds - committed_tokens * t1

    def _draft_time(self, name, seconds, k):
        if k and self.costly.get(name):
            self.draft_times[name].append(seconds / k)

    def draft_cost(self, name):
        """Seconds per drafted token (0 for a drafter that costs nothing,
        None while unmeasured)."""
        if not self.costly.get(name):
            return 0.0
        times = self.draft_times[name]
        return statistics.median(times) if times else None

    # -- estimates -------------------------------------------------------------

    def plain_time(self):
        return statistics.median(s for s, _ in self.t1) if self.t1 else None

    def verify_ratio(self, name, k):
        """(T(k) / t1, measured at this k) from fresh passes of ``name``, or
        (None, False)."""
        now = len(self.history)
        fresh = [(kk, r) for n, kk, r, at in self.passes if n == name and now - at <= self.FRESH]
        own = [r for kk, r in fresh if kk == k]
        if len(own) >= 2 or (own and len(fresh) == len(own)):
            return statistics.median(own), True
        if not fresh:
            return None, False
        beta = statistics.median((r - 1.0) / kk for kk, r in fresh)
        return 1.0 + max(beta, 0.0) * k, False

    def rate(self, name):
        """The drafter's acceptance per position (given the ones before it)."""
        outs = self.outcomes[name]
        tried = sum(min(a + 1, length) for _, length, a in outs)
        return sum(a for _, _, a in outs) / tried if tried else 0.0

    def predict(self, name, K, ratio):
        """Predicted speedup of drafting K with ``name``; ``ratio(k)`` gives T(k)/t1."""
        t1 = self.plain_time()
        c = (self.draft_cost(name) or 0.0) / t1 if t1 else 0.0
        p = self.rate(name)
        tokens = cost = 0.0
        for asked, length, a in self.outcomes[name]:
            k = min(length, K)
            if k == 0:
                tokens += 1.0
                cost += 1.0
                continue
            acc = min(a, k)
            if length == asked < K:
                # cut by what was asked: a pass of K would draft K
                if a == length:
                    acc += sum(p**i for i in range(1, K - length + 1))
                k = K
            tokens += 1.0 + acc
            cost += ratio(k) + c * k
        return tokens / cost if cost else 0.0

    # -- the decision ----------------------------------------------------------

    def next(self, remaining):
        """What to do next: ("plain", steps) or ("draft", name, K, probe)."""
        self.planned = len(self.history) + remaining
        t1 = self.plain_time()
        drafting = self.state[0] in ("draft", "probe")
        if t1 is None or len(self.t1) < 2:
            return self._plain(remaining)
        if drafting and len(self.history) - self.last_t1_at >= self.T1_FRESH:
            return self._plain(remaining, self.REFRESH)
        floor = 1.0 + self.MARGIN
        best, probe = (floor, None), (floor, None)
        for name, outs in self.outcomes.items():
            if len(outs) < self.MIN_PROPOSALS:
                continue
            if self.verify_ratio(name, 1)[0] is None:
                # nothing measured: worth one pass of one draft (the least it
                # can lose) if drafting would pay even at a plain step's cost
                s = max(self.predict(name, K, lambda k: 1.0) for K in range(1, self.k_max + 1))
                if s > probe[0]:
                    probe = (s, (name, 1))
                continue
            for K in range(1, self.k_max + 1):
                s = self.predict(name, K, lambda k, n=name: self.verify_ratio(n, k)[0])
                if self.confirmed(name, K):
                    if s > best[0]:
                        best = (s, (name, K))
                elif s > probe[0]:
                    probe = (s, (name, K))  # extrapolated: measure it before relying on it
        if (probe[1] is not None and probe[0] > best[0] * (1.0 + self.MARGIN)
                and self._may_probe(*probe[1])):
            return self._draft(*probe[1], probe[0], True)
        if best[1] is not None:
            return self._draft(*best[1], best[0], False)
        return self._plain(remaining)

    def confirmed(self, name, K):
        """Whether T(K) of ``name`` rests on at least two fresh passes of K."""
        now = len(self.history)
        return sum(1 for n, k, _, at in self.passes
                   if n == name and k == K and now - at <= self.FRESH) >= 2

    def _may_probe(self, name, K):
        """Whether a probe pass of K fits in the loss budget even if it
        accepts nothing (it then costs T(K) + K drafts for one token): checked
        with its own loss included, so a probe of several drafts (a few
        steps on a CPU) cannot overshoot the budget by its own cost."""
        t1 = self.plain_time() or 0.0
        ratio = self.verify_ratio(name, K)[0]
        if ratio is None:
            ratio = 1.0 + self.prior_beta * K
        c = (self.draft_cost(name) or 0.0) / t1 if t1 else 0.0
        worst = max(ratio + c * K - 1.0, 0.0) * t1
        return self.probe_loss + worst <= self.loss_budget() + 1e-12

    def loss_budget(self):
        """Seconds the probes of this generation may lose."""
        t1 = self.plain_time() or 0.0
        return self.LOSS_FRACTION * max(self.decode_s, t1 * self.planned)

    def _plain(self, remaining, n=None):
        if self.state[0] != "plain":
            self._note("plain", None, None, None)
        self.state = ("plain",)
        return ("plain", max(1, min(n or self.CHUNK, remaining)))

    def _draft(self, name, K, predicted, probe):
        state = ("probe" if probe else "draft", name, K)
        if self.state != state:
            self._note(state[0], name, K, predicted)
        self.state = state
        return ("draft", name, K, probe)

    def _note(self, what, name, K, predicted):
        t1 = self.plain_time()
        entry = {"at": len(self.history), "do": what, "drafter": name, "k": K,
                 "t1_s": t1, "predicted_speedup": predicted}
        if K:
            entry["verify_ratio"] = self.verify_ratio(name, K)[0]
        if name:
            entry["acceptance"] = self.rate(name)
        self.log.append(entry)

    def summary(self):
        return {
            "t1_s": self.plain_time(),
            "verify_ratio": {n: {k: self.verify_ratio(n, k)[0] for k in range(1, self.k_max + 1)}
                             for n in self.outcomes},
            "draft_cost_s": {n: self.draft_cost(n) for n in self.costly},
            "shadow_s": self.shadow_s,
            "probe_loss_s": self.probe_loss,
            "decode_s": self.decode_s,
            "decisions": self.log,
        }
