"""Offline cache simulation on recorded routing traces: Belady's optimum and
the online policies the session cache could use.

A trace is ``ExpertStore.trace``: one ``(layer, experts)`` per expert-module
call, in call order. The session cache is a set of per-layer stacks, each
with the same fixed capacity, so every simulation here runs per layer with
that per-layer capacity and sums the misses. A call needs all of its experts
at once; an expert of the current call is never evicted to make room for
another of the same call (the store then falls back to a temporary stack).

A trace may also carry, per call, the experts it predicted for the next
layers (``scripts/bench/bench_policies.py`` records them), which the
prediction-aware pool policy (``simulate_global(..., "predict")``) uses.
docs/benchmarks.md, "Cache policy on trained routing", has the measured table.
"""

import math
from collections import OrderedDict, defaultdict

from infer.runtime.placement import decayed_rank


def per_layer(trace):
    """{layer: [frozenset(experts), ...]} in call order."""
    out = defaultdict(list)
    for call in trace:
        layer, experts = call[0], call[1]
        out[layer].append(frozenset(int(e) for e in experts))
    return out


def belady_layer(requests, capacity):
    """Misses of the optimal offline policy on one layer's request sequence.

    After each request the cache keeps, among what it held and what was just
    requested, the ``capacity`` experts that are needed again soonest (an
    expert never needed again is worth nothing; one that would be needed
    later than all others is simply not kept — bypassing is allowed, which
    makes this a lower bound on any policy, LRU included)."""
    return sum(belady_requests(requests, capacity))


def belady_requests(requests, capacity, counted=None):
    """Belady's misses per request. ``counted`` (a bool per request, default
    all): the requests whose misses count; the others (a prefill, when only
    decode is scored) are read anyway, so they cost nothing, may leave what
    they read cached, and a use there is no reason to keep an expert: the
    next use is the next counted one. Optimal for the counted misses."""
    counted = [True] * len(requests) if counted is None else list(counted)
    if capacity <= 0:
        return [len(r) if c else 0 for r, c in zip(requests, counted)]
    # next counted use of each (request index, expert)
    nxt = [None] * len(requests)
    upcoming = {}
    for i in range(len(requests) - 1, -1, -1):
        nxt[i] = {e: upcoming.get(e, float("inf")) for e in requests[i]}
        if counted[i]:
            for e in requests[i]:
                upcoming[e] = i
    cache = {}  # expert -> next use index
    out = []
    for i, req in enumerate(requests):
        out.append(sum(1 for e in req if e not in cache) if counted[i] else 0)
        for e in req:
            cache[e] = nxt[i][e]
        if len(cache) > capacity:
            keep = sorted(cache.items(), key=lambda kv: kv[1])[:capacity]
            cache = dict(keep)
        # drop experts never used again: they only take room
        cache = {e: t for e, t in cache.items() if t != float("inf")}
    return out


def belady_misses(trace, capacity):
    """Belady misses summed over layers, each with ``capacity`` experts
    (an int, or a {layer: capacity} dict)."""
    total = 0
    for layer, reqs in per_layer(trace).items():
        cap = capacity[layer] if isinstance(capacity, dict) else capacity
        total += belady_layer(reqs, cap)
    return total


class Policy:
    """An online replacement policy over one layer's stack; the ``victim``
    rule is all that differs between policies."""

    def __init__(self, capacity):
        self.capacity = capacity
        self.cached = OrderedDict()  # expert -> None, least recent first
        self.t = 0

    def on_hit(self, e):
        self.cached.move_to_end(e)

    def on_insert(self, e):
        self.cached[e] = None

    def on_access(self, e):
        pass

    def victim(self, keep):
        return next((e for e in self.cached if e not in keep), None)

    def _count(self, req):
        """Count one call's accesses and hits; returns its misses, by id."""
        self.t += 1
        for e in req:
            self.on_access(e)
        missing = [e for e in sorted(req) if e not in self.cached]
        for e in sorted(req):
            if e in self.cached:
                self.on_hit(e)
        return missing

    def request(self, req):
        """Serve one call; returns its misses."""
        missing = self._count(req)
        for e in missing:
            if len(self.cached) >= self.capacity:
                v = self.victim(req)
                if v is None:
                    break  # the rest of this call runs from a temporary stack
                if not self.admit(e, v):
                    continue  # bypass: this call uses it from a temporary stack
                del self.cached[v]
            self.on_insert(e)
        return len(missing)

    def admit(self, new, victim):
        return True


class LRU(Policy):
    pass


class LFU(Policy):
    """Least frequently used, counting every access since the start (also
    of experts not cached now); ties go to the least recent."""

    def __init__(self, capacity):
        super().__init__(capacity)
        self.count = defaultdict(int)

    def on_access(self, e):
        self.count[e] += 1

    def victim(self, keep):
        best = None
        for e in self.cached:  # least recent first: strict < keeps the LRU on ties
            if e not in keep and (best is None or self.count[e] < self.count[best]):
                best = e
        return best


class FreqDecay(LFU):
    """Frequency with exponential decay: each access adds 1 and the score
    halves every ``half_life`` calls of the layer; ties go to the least recent."""

    def __init__(self, capacity, half_life=16.0):
        super().__init__(capacity)
        self.decay = 0.5 ** (1.0 / half_life)
        self.score = {}  # expert -> (score, at t)

    def _now(self, e):
        s, t = self.score.get(e, (0.0, self.t))
        return s * self.decay ** (self.t - t)

    def _rank(self, e):
        """decayed_rank of ``e``'s score (-inf: never accessed)."""
        s, t = self.score.get(e, (0.0, self.t))
        return decayed_rank(s, t, self.decay) if s > 0 else -math.inf

    def on_access(self, e):
        self.score[e] = (self._now(e) + 1.0, self.t)

    def victim(self, keep):
        best, best_r = None, None
        for e in self.cached:
            if e in keep:
                continue
            r = self._rank(e)
            if best is None or r < best_r:
                best, best_r = e, r
        return best


class FreqDecayAdmit(FreqDecay):
    """FreqDecay that caches a missed expert only when its decayed frequency
    is above the victim's (TinyLFU-style admission); otherwise the call uses
    it once from a temporary stack and the cache is left as it was."""

    def admit(self, new, victim):
        return self._rank(new) > self._rank(victim)


class FreqDecayRank(FreqDecay):
    """The session cache's rule (``infer.runtime.placement.Placement``): decayed
    frequency, and a call's missed experts are placed best-scored first; in
    a call of more experts than the stack holds, each only while it scores
    at least as high as the victim it would replace (the rest run from a
    temporary stack), so such a call keeps the ones used most.
    ``admit``: when that admission test applies: "fit" (the rule: only for
    a call wider than the stack), "rank" (always: the rule before
    docs/routing.md's replays), "all" (never)."""

    def __init__(self, capacity, half_life=16.0, admit="fit"):
        super().__init__(capacity, half_life)
        self.admit = admit

    def request(self, req):
        missing = self._count(req)
        test = self.admit == "rank" or (self.admit == "fit" and len(req) > self.capacity)
        for e in sorted(missing, key=lambda e: (-self._rank(e), e)):
            if len(self.cached) >= self.capacity:
                v = self.victim(req)
                if v is None or (test and self._rank(v) > self._rank(e)) or self._kept(v, e):
                    continue  # used once from a temporary stack
                del self.cached[v]
            self.on_insert(e)
        return len(missing)

    def _kept(self, victim, new) -> bool:
        """Whether ``victim`` stays whatever the admission test says."""
        return False


class ToldNext(FreqDecayRank):
    """``oracle1``: the session cache's rule told the experts its layer's
    next call uses (``soon``, set before each ``request``; in decode, the
    next token's). Those outrank every other expert: it never evicts one of
    them for an expert the next call does not use, and it always caches a
    missed one of them over an expert the next call does not use. Among the
    rest, and among themselves, the rule's own decayed ranks decide. Told
    nothing, it is the rule."""

    def __init__(self, capacity, half_life=16.0):
        super().__init__(capacity, half_life)
        self.soon = frozenset()

    def _rank(self, e):
        return super()._rank(e) + (1e6 if e in self.soon else 0.0)

    def _kept(self, victim, new) -> bool:
        return victim in self.soon and new not in self.soon


class LFUAdmit(LFU):
    def admit(self, new, victim):
        return self.count[new] > self.count[victim]


class ARC(Policy):
    """Adaptive replacement (Megiddo & Modha): experts seen once (``t1``) and
    more than once (``t2``), each LRU-ordered, with ghost lists of recent
    victims (``b1``, ``b2``) that move the target size ``p`` of ``t1``."""

    def __init__(self, capacity):
        super().__init__(capacity)
        self.t2 = set()  # cached experts seen at least twice; the rest of cached is t1
        self.b1 = OrderedDict()
        self.b2 = OrderedDict()
        self.p = 0.0

    def on_hit(self, e):
        super().on_hit(e)
        self.t2.add(e)

    def on_insert(self, e):
        super().on_insert(e)
        if e in self.b1:  # recency list too short: grow it
            self.p = min(self.capacity, self.p + max(1.0, len(self.b2) / len(self.b1)))
            del self.b1[e]
            self.t2.add(e)
        elif e in self.b2:  # frequency list too short: shrink t1
            self.p = max(0.0, self.p - max(1.0, len(self.b1) / len(self.b2)))
            del self.b2[e]
            self.t2.add(e)

    def victim(self, keep):
        t1 = [e for e in self.cached if e not in self.t2 and e not in keep]
        t2 = [e for e in self.cached if e in self.t2 and e not in keep]
        from_t1 = t1 and (len(self.cached) - len(self.t2) > self.p or not t2)
        v = t1[0] if from_t1 else (t2[0] if t2 else None)
        if v is not None:
            ghost = self.b2 if v in self.t2 else self.b1
            self.t2.discard(v)
            ghost[v] = None
            while len(ghost) > self.capacity:
                ghost.popitem(last=False)
        return v


POLICIES = {
    "lru": LRU,
    "lfu": LFU,
    "decay4": lambda c: FreqDecay(c, 4.0),
    "decay16": lambda c: FreqDecay(c, 16.0),
    "decay64": lambda c: FreqDecay(c, 64.0),
    "lfu+adm": LFUAdmit,
    "decay16+adm": lambda c: FreqDecayAdmit(c, 16.0),
    "decay64+adm": lambda c: FreqDecayAdmit(c, 64.0),
    "arc": ARC,
    "decay16+rank": lambda c: FreqDecayRank(c, 16.0, admit="rank"),
    "decay32+rank": lambda c: FreqDecayRank(c, 32.0, admit="rank"),
    # the rank order without the admission test, and with it only for calls
    # wider than the stack
    "decay16+order": lambda c: FreqDecayRank(c, 16.0, admit="all"),
    "decay32+order": lambda c: FreqDecayRank(c, 32.0, admit="all"),
    "decay16+fit": lambda c: FreqDecayRank(c, 16.0, admit="fit"),
    "decay32+fit": lambda c: FreqDecayRank(c, 32.0, admit="fit"),
}


def simulate(trace, capacity, policy="lru"):
    """Misses of an online policy on ``trace``, per-layer stacks of ``capacity``."""
    make = POLICIES[policy] if isinstance(policy, str) else policy
    total = 0
    for layer, reqs in per_layer(trace).items():
        cap = capacity[layer] if isinstance(capacity, dict) else capacity
        if cap <= 0:
            total += sum(len(r) for r in reqs)
            continue
        p = make(cap)
        total += sum(p.request(r) for r in reqs)
    return total


def _global_requests(trace):
    return [frozenset((int(c[0]), int(e)) for e in c[1]) for c in trace]


def belady_global(trace, capacity):
    """Belady with one pool of ``capacity`` experts shared by all layers."""
    return belady_layer(_global_requests(trace), capacity)


class TokenTime(Policy):
    """A pool shared by all layers whose clock is token time: an expert's
    age is the number of calls of *its own* layer since it was last used
    there (in decode, tokens), not the number of calls of any layer. Among
    equally old experts the victim is the one whose layer is called last
    from now: an expert a layer used this token waits a whole token before
    its layer comes round again, one of the next layer is wanted next."""

    def __init__(self, capacity, order):
        super().__init__(capacity)
        self.pos = {l: i for i, l in enumerate(order)}  # layer -> place in a token
        self.calls = defaultdict(int)  # layer -> its calls so far
        self.last = {}  # (layer, expert) -> the layer's call count at its last use
        self.layer = None
        self.protected = frozenset()

    def age(self, k):
        return self.calls[k[0]] - self.last[k]

    def wait(self, k):
        """Calls of other layers before ``k``'s layer is called again."""
        n = len(self.pos)
        return (self.pos[k[0]] - self.pos[self.layer] - 1) % n

    def key(self, k):
        return (self.age(k), self.wait(k))

    def serve(self, layer, req, protected=frozenset()):
        self.layer = layer
        self.calls[layer] += 1
        for k in req:
            self.last[k] = self.calls[layer]
        self.protected = protected
        return self.request(req)

    def victim(self, keep):
        best, best_key = None, None
        for k in self.cached:
            if k in keep:
                continue
            key = (k not in self.protected, *self.key(k))
            if best is None or key > best_key:
                best, best_key = k, key
        return best


class TokenDecay(TokenTime):
    """Decayed frequency in token time (half-life in calls of the expert's
    own layer); ties go to the expert whose layer comes round last."""

    def __init__(self, capacity, order, half_life=16.0):
        super().__init__(capacity, order)
        self.decay = 0.5 ** (1.0 / half_life)
        self.score = {}

    def serve(self, layer, req, protected=frozenset()):
        now = self.calls[layer] + 1  # this call's count, once served
        for k in req:
            s, t = self.score.get(k, (0.0, now))
            self.score[k] = (s * self.decay ** (now - t) + 1.0, now)
        return super().serve(layer, req, protected)

    def key(self, k):
        s, t = self.score[k]
        return (-s * self.decay ** (self.calls[k[0]] - t), self.wait(k))


def predicted_keys(call, depth=None):
    """The (layer, expert) pairs a recorded call predicted for the layers
    after it (a trace entry's third field: [[layer, depth, experts], ...])."""
    if len(call) < 3:
        return frozenset()
    return frozenset((int(l), int(e)) for l, d, experts in call[2]
                     if depth is None or d <= depth for e in experts)


GLOBAL_POLICIES = {
    "least-stale": lambda c, order: TokenTime(c, order),
    "decay16-token": lambda c, order: TokenDecay(c, order, 16.0),
    "predict": lambda c, order: TokenTime(c, order),  # protects the predicted experts
}


def simulate_global(trace, capacity, policy="lru", layers=1):
    """An online policy over one pool shared by all layers. ``lru`` and
    ``decay*`` run in call time (decay half-lives scaled by ``layers``: the
    pool sees every layer's call per token); the ``GLOBAL_POLICIES`` run in
    token time, ``predict`` protecting the experts predicted for the next
    layers (recorded with the trace)."""
    if capacity <= 0:
        return sum(len(c[1]) for c in trace)
    if policy in GLOBAL_POLICIES:
        p = GLOBAL_POLICIES[policy](capacity, sorted({int(c[0]) for c in trace}))
        predict = policy == "predict"
        return sum(p.serve(int(c[0]), frozenset((int(c[0]), int(e)) for e in c[1]),
                           predicted_keys(c) if predict else frozenset()) for c in trace)
    if isinstance(policy, str) and policy.startswith("decay"):
        half, _, adm = policy[5:].partition("+")
        p = (FreqDecayAdmit if adm else FreqDecay)(capacity, float(half) * layers)
    else:
        p = (POLICIES[policy] if isinstance(policy, str) else policy)(capacity)
    return sum(p.request(r) for r in _global_requests(trace))
