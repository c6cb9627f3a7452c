"""Offline cache simulation on recorded routing traces: Belady's optimum and
the online policies the session cache could use.

A trace is ``ExpertStore.trace``: one ``(layer, experts)`` per expert-module
call, in call order. The session cache is a set of per-layer stacks, each
with the same fixed capacity, so every simulation here runs per layer with
that per-layer capacity and sums the misses. A call needs all of its experts
at once; an expert of the current call is never evicted to make room for
another of the same call (the store then falls back to a temporary stack).
"""

from collections import OrderedDict, defaultdict


def per_layer(trace):
    """{layer: [frozenset(experts), ...]} in call order."""
    out = defaultdict(list)
    for layer, experts in trace:
        out[layer].append(frozenset(int(e) for e in experts))
    return out


def belady_layer(requests, capacity):
    """Misses of the optimal offline policy on one layer's request sequence.

    After each request the cache keeps, among what it held and what was just
    requested, the ``capacity`` experts that are needed again soonest (an
    expert never needed again is worth nothing; one that would be needed
    later than all others is simply not kept — bypassing is allowed, which
    makes this a lower bound on any policy, LRU included)."""
    if capacity <= 0:
        return sum(len(r) for r in requests)
    # next use of each (request index, expert)
    nxt = [None] * len(requests)
    upcoming = {}
    for i in range(len(requests) - 1, -1, -1):
        nxt[i] = {e: upcoming.get(e, float("inf")) for e in requests[i]}
        for e in requests[i]:
            upcoming[e] = i
    cache = {}  # expert -> next use index
    misses = 0
    for i, req in enumerate(requests):
        misses += sum(1 for e in req if e not in cache)
        for e in req:
            cache[e] = nxt[i][e]
        if len(cache) > capacity:
            keep = sorted(cache.items(), key=lambda kv: kv[1])[:capacity]
            cache = dict(keep)
        # drop experts never used again: they only take room
        cache = {e: t for e, t in cache.items() if t != float("inf")}
    return misses


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

    def request(self, req):
        """Serve one call; returns its misses."""
        self.t += 1
        for e in req:
            self.on_access(e)
        missing = [e for e in sorted(req) if e not in self.cached]
        for e in sorted(req):
            if e in self.cached:
                self.on_hit(e)
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

    def on_access(self, e):
        self.score[e] = (self._now(e) + 1.0, self.t)

    def victim(self, keep):
        best, best_s = None, None
        for e in self.cached:
            if e in keep:
                continue
            s = self._now(e)
            if best is None or s < best_s:
                best, best_s = e, s
        return best


class FreqDecayAdmit(FreqDecay):
    """FreqDecay that caches a missed expert only when its decayed frequency
    is above the victim's (TinyLFU-style admission); otherwise the call uses
    it once from a temporary stack and the cache is left as it was."""

    def admit(self, new, victim):
        return self._now(new) > self._now(victim)


class LFUAdmit(LFU):
    def admit(self, new, victim):
        return self.count[new] > self.count[victim]


POLICIES = {
    "lru": LRU,
    "lfu": LFU,
    "decay4": lambda c: FreqDecay(c, 4.0),
    "decay16": lambda c: FreqDecay(c, 16.0),
    "decay64": lambda c: FreqDecay(c, 64.0),
    "lfu+adm": LFUAdmit,
    "decay16+adm": lambda c: FreqDecayAdmit(c, 16.0),
    "decay64+adm": lambda c: FreqDecayAdmit(c, 64.0),
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
    return [frozenset((int(layer), int(e)) for e in experts) for layer, experts in trace]


def belady_global(trace, capacity):
    """Belady with one pool of ``capacity`` experts shared by all layers."""
    return belady_layer(_global_requests(trace), capacity)


def simulate_global(trace, capacity, policy="lru", layers=1):
    """An online policy over one pool shared by all layers (decay half-lives
    are scaled by ``layers``: the pool sees every layer's call per token)."""
    if capacity <= 0:
        return sum(len(r) for _, r in trace)
    if isinstance(policy, str) and policy.startswith("decay"):
        half, _, adm = policy[5:].partition("+")
        p = (FreqDecayAdmit if adm else FreqDecay)(capacity, float(half) * layers)
    else:
        p = (POLICIES[policy] if isinstance(policy, str) else policy)(capacity)
    return sum(p.request(r) for r in _global_requests(trace))
