"""Which read goes next: demand before prefetch, sessions taking turns.

Exactly one read per (model, layer, expert) is queued or in flight; later
askers attach to it, and a demand on a queued prefetch promotes it. Within a
class, sessions take turns (round robin), so one session's burst does not
starve another's. A session's queued prefetches are bounded: past the bound
the oldest are dropped, and each carries the layer call at which the session
expects to use it, so prefetches that come due without being read are
dropped too (the session has moved on).

Pure bookkeeping: no IO, no clock, no arena. ``iod.core`` decides.
"""

from collections import deque

DEMAND, PREFETCH = 0, 1
QUEUED, INFLIGHT = 0, 1


class Read:
    """The one read of a record, and who waits for it."""

    __slots__ = ("key", "model", "layout", "cls", "state", "slot", "queued", "waiters",
                 "prefetchers", "retried", "job", "prefetch_started")

    def __init__(self, key, model, layout, cls, queued_ns):
        self.key = key
        self.model = model
        self.layout = layout
        self.cls = cls
        self.state = QUEUED
        self.slot = None
        self.queued = queued_ns
        self.waiters = []  # iod.core.Waiter, one per demand that needs it
        self.prefetchers = {}  # session id -> call number the record is due at
        self.retried = False
        self.job = None
        self.prefetch_started = False  # counted among the core's prefetch reads in flight

    def wanted(self) -> bool:
        return bool(self.prefetchers) or any(not w.failed for w in self.waiters)


class Scheduler:
    def __init__(self, max_prefetch: int = 1024):
        self.max_prefetch = max_prefetch  # queued prefetches per session
        self.reads = {}  # key -> Read, queued or in flight
        self._queues = ({}, {})  # class -> {session id: deque of keys}
        self._turns = (deque(), deque())  # class -> session ids in turn order
        self._prefetching = {}  # session id -> deque of keys it prefetches (oldest first)
        self.promoted = self.coalesced = self.dropped = 0

    def demand(self, key, model, layout, sid, now_ns) -> Read:
        """The read of ``key`` for a session's demand: existing (attached,
        promoted if it was a queued prefetch) or new."""
        r = self.reads.get(key)
        if r is None:
            r = self.reads[key] = Read(key, model, layout, DEMAND, now_ns)
            self._enqueue(r, sid)
            return r
        self.coalesced += 1
        if r.state == QUEUED:
            self._promote(r)
            self._enqueue(r, sid)  # in this session's turn too (a stale duplicate is skipped)
        return r

    def _promote(self, r: Read) -> bool:
        """A queued prefetch becomes a demand read; whether it was one."""
        if r.cls != PREFETCH:
            return False
        r.cls = DEMAND
        self.promoted += 1
        return True

    def prefetch(self, key, model, layout, sid, due, now_ns, urgent=False) -> bool:
        """Queue (or join) a prefetch of ``key`` due at call ``due``; False
        when the session already asked for it. An ``urgent`` one (due at the
        session's current call, which will demand it) is read as a demand
        read, ahead of every prefetch; a queued prefetch is promoted."""
        r = self.reads.get(key)
        if r is not None and urgent and r.state == QUEUED and self._promote(r):
            self._enqueue(r, sid)
        if r is not None and sid in r.prefetchers:
            r.prefetchers[sid] = max(r.prefetchers[sid], due)
            return False
        if r is None:
            r = self.reads[key] = Read(key, model, layout, DEMAND if urgent else PREFETCH, now_ns)
            self._enqueue(r, sid)
        else:
            self.coalesced += 1
            if r.state == QUEUED and r.cls == PREFETCH:
                self._enqueue(r, sid)
        r.prefetchers[sid] = due
        mine = self._prefetching.setdefault(sid, deque())
        mine.append(key)
        while len(mine) > self.max_prefetch:
            self._drop_interest(sid, mine.popleft())
        return True

    def expire(self, sid, now) -> int:
        """Drop the session's queued prefetches due before call ``now``."""
        mine = self._prefetching.get(sid)
        if not mine:
            return 0
        n = 0
        for key in list(mine):
            r = self.reads.get(key)
            if r is None or sid not in r.prefetchers:
                mine.remove(key)
            elif r.state == QUEUED and r.prefetchers[sid] < now:
                mine.remove(key)
                n += self._drop_interest(sid, key)
        return n

    def _drop_interest(self, sid, key) -> int:
        r = self.reads.get(key)
        if r is None or sid not in r.prefetchers:
            return 0
        del r.prefetchers[sid]
        if r.state == QUEUED and not r.wanted():
            del self.reads[key]  # its queue entry is skipped when met
        self.dropped += 1
        return 1

    def _enqueue(self, r: Read, sid) -> None:
        q = self._queues[r.cls].get(sid)
        if q is None:
            q = self._queues[r.cls][sid] = deque()
            self._turns[r.cls].append(sid)
        q.append(r.key)

    def next(self, cls=None):
        """(session id, read): the next read to start (demand before
        prefetch, or only ``cls``), marked in flight; None when none is queued."""
        for c in (DEMAND, PREFETCH) if cls is None else (cls,):
            turns, queues = self._turns[c], self._queues[c]
            for _ in range(len(turns)):
                sid = turns[0]
                turns.rotate(-1)
                q = queues[sid]
                while q:
                    key = q.popleft()
                    r = self.reads.get(key)
                    if r is None or r.state != QUEUED or r.cls != c:
                        continue  # stale: started, promoted, or nobody wants it now
                    r.state = INFLIGHT
                    return sid, r
            for sid in [sid for sid, q in queues.items() if not q]:
                del queues[sid]
                turns.remove(sid)
        return None

    def put_back(self, sid, r: Read) -> None:
        """No slot for ``r`` yet: first in line again, in its session's turn."""
        r.state = QUEUED
        turns, queues = self._turns[r.cls], self._queues[r.cls]
        if sid not in queues:
            queues[sid] = deque()
        else:
            turns.remove(sid)
        turns.appendleft(sid)
        queues[sid].appendleft(r.key)

    def done(self, r: Read) -> None:
        self.reads.pop(r.key, None)

    def forget(self, sid) -> None:
        """A session ended: its prefetch interest and queues go (its
        waiters are failed by the core)."""
        for key in self._prefetching.pop(sid, ()):
            self._drop_interest(sid, key)
        for c in (DEMAND, PREFETCH):
            q = self._queues[c].pop(sid, None)
            if q is not None:
                self._turns[c].remove(sid)
                for key in q:  # reads others still want go to their queue; the rest go
                    r = self.reads.get(key)
                    if r is None or r.state != QUEUED:
                        continue
                    owner = self._owner(r)
                    if owner is None:
                        del self.reads[key]
                    else:
                        self._enqueue(r, owner)

    def _owner(self, r: Read):
        for w in r.waiters:
            if not w.failed:
                return w.session.id
        return next(iter(r.prefetchers), None)

    def queued(self, cls=None) -> int:
        return sum(1 for r in self.reads.values() if r.state == QUEUED
                   and (cls is None or r.cls == cls))
