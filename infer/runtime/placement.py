"""Which of a layer's experts its cache holds, and where: the session cache's
rule, kept apart from the arrays so that a replay of recorded routing
(``infer routing --trace``) runs the very rule a session runs.

Replacement: decayed frequency, misses placed best-scored first; a call
wider than the cache places one only over a victim that scores no higher. ``tick()`` once per call of the layer,
``touch`` on each hit, ``assign`` for the misses. A cache that can hold every
expert of its layer keeps expert e at position e (``identity``)."""

import heapq
import math
from collections import OrderedDict

HALF_LIFE = 16.0  # calls of the layer (tokens, in decode)


def decayed_rank(score, at, decay):
    """The log of ``score`` (taken at time ``at``) decayed to time 0: fixed
    while the score decays, it orders experts as their decayed scores do at
    any one time, and ties where they tie."""
    return math.log(score) - at * math.log(decay)


class Placement:
    """Positions of a layer's cached experts, ``capacity`` of them at most."""

    HALF_LIFE = HALF_LIFE

    def __init__(self, num_experts, capacity):
        self.num_experts = num_experts
        self.capacity = capacity
        self.identity = capacity >= num_experts
        self.t = 0
        self._score = {}  # expert -> (decayed access count, at t); also evicted ones
        self._rank = {}  # expert -> decayed_rank of that score (ranks compare as scores do)
        self._decay = 0.5 ** (1.0 / self.HALF_LIFE)
        # (rank, recency, expert) of the cached experts, lowest first: the
        # victim without a scan (a scan of 128 cached experts cost ~70 us a
        # miss); an expert's entries other than its latest are stale and skipped
        self._heap = []
        self._recency = {}  # cached expert -> the count at its last touch or insertion
        self._count = 0
        self.position = OrderedDict()  # expert -> position, least recent first
        self._free = list(range(capacity - 1, -1, -1))

    def __contains__(self, expert):
        return expert in self.position

    @property
    def complete(self) -> bool:
        return self.identity and len(self.position) == self.num_experts

    def tick(self):
        self.t += 1

    def _now(self, expert):
        s, t = self._score.get(expert, (0.0, self.t))
        return s * self._decay ** (self.t - t)

    def _access(self, expert):
        s = self._now(expert) + 1.0
        self._score[expert] = (s, self.t)
        self._rank[expert] = decayed_rank(s, self.t, self._decay)

    def _push(self, expert):
        """Enter a cached expert's rank and recency in the heap."""
        if self.identity:
            return  # never evicts
        self._count += 1
        self._recency[expert] = self._count
        heapq.heappush(self._heap, (self._rank[expert], self._count, expert))
        if len(self._heap) > 4 * len(self.position) + 64:  # mostly stale: rebuilt
            self._heap = [(self._rank[e], self._recency[e], e) for e in self.position]
            heapq.heapify(self._heap)

    def touch(self, expert):
        self.position.move_to_end(expert)
        self._access(expert)
        self._push(expert)

    def victim(self, keep):
        """The cached expert to replace: lowest decayed frequency, not in
        ``keep``; on ties the least recently used (None if all are kept)."""
        heap, kept, best = self._heap, [], None
        while heap:
            rank, recency, e = heap[0]
            if self._recency.get(e) != recency:
                heapq.heappop(heap)  # stale: touched since, or evicted
            elif e in keep:
                kept.append(heapq.heappop(heap))
            else:
                best = e
                break
        for entry in kept:
            heapq.heappush(heap, entry)
        return best

    def assign(self, missing, keep):
        """{expert: position} for a call's ``missing`` experts (None: the
        call uses it from a temporary stack); ``keep``: the experts the call
        uses. The best-scored go first, each to a free position or its
        victim's. A call that needs more experts than the stack holds places
        one only while it scores at least as high as its victim, so the stack
        keeps the ones used most; a call that fits places every miss (real
        routing reuses a just-missed expert soon: on Qwen3-30B-A3B's trace a
        quarter of them by the next token, docs/routing.md)."""
        for e in missing:
            self._access(e)
        rank = self._rank
        places = {}
        test = len(keep) > self.capacity
        for e in sorted(missing, key=lambda e: (-rank[e], e)):
            if self.identity:
                pos = e
            elif self._free:
                pos = self._free.pop()
            else:
                victim = self.victim(keep)
                if victim is None or (test and rank[victim] > rank[e]):
                    places[e] = None
                    continue
                pos = self.position.pop(victim)
                del self._recency[victim]
            self.position[e] = pos
            self._push(e)
            places[e] = pos
        return places

    def forget(self, experts):
        """Uncache ``experts`` (their copies failed): their positions free."""
        for e in experts:
            pos = self.position.pop(e, None)
            if pos is not None and not self.identity:
                self._free.append(pos)
                self._recency.pop(e, None)
