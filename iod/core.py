"""The daemon's core: sessions, models, the pins it grants, reads and their
completions — a state machine with no socket, signal or thread of its own.

``receive`` takes a request's frames (``handle`` a decoded message) and
queues replies in ``outbox`` as (peer identity, message); ``pump`` hands
queued reads to the injected reader (anything with ``submit(job, cls)``);
``completed`` takes a finished read back. ``iod.shell`` hosts it behind a
ZeroMQ socket; ``iod.inproc`` hosts it inside an inference process; tests
drive it with a reader that completes reads on command.

Hits never reach the core: sessions pin ready records in the arena
themselves. The core sees predictions (PREFETCH), one demand per layer call
for the records that were not ready, and the session's hello and bye.
Errors are replies (``Error`` with an ``ErrorCode``); a handler that raises
anything else answers INTERNAL and the core carries on.
"""

import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from shared import codec
from shared import protocol as P
from shared import slots as S
from shared.blob import Manifest, ManifestError
from shared.launch import pid_alive

from . import reader as reader_mod
from .sched import DEMAND, PREFETCH, Scheduler
from .stats import Latency

E = P.ErrorCode


@dataclass
class Config:
    arena_size: int = 512 << 20
    slot_size: int = 0  # 0: the first model's largest record stride
    workers: int = 4  # reads the disk wants in flight; prefetches fill at most this many
    max_sessions: int = 64
    max_queued: int = 8192  # per session: records it awaits
    max_prefetch: int = 1024  # per session: queued prefetches
    max_models: int = 16
    # a session holding more than its share that says nothing and is granted
    # nothing for this long, while a read waits for a slot, loses its pins
    pin_timeout_s: float = 5.0

    @property
    def readers(self) -> int:
        """Reader threads: one per read the core hands over (2 x workers), so
        each starts at once and, prefetches filling at most half, a demand
        always finds a reader free. With as many threads as workers, a disk
        whose ceiling comes at depth 1 got one thread (an H100's, 2026-12-07),
        and every demand waited behind the prefetch being read."""
        return 2 * self.workers


class Failure(Exception):
    """A typed refusal of a request; becomes an ``Error`` reply."""

    def __init__(self, code, message, layer=-1, expert=-1):
        super().__init__(message)
        self.code, self.layer, self.expert = code, layer, expert


class Model:
    def __init__(self, model_id, folder, manifest, mhash):
        self.id = model_id
        self.dir = folder
        self.manifest = manifest
        self.hash = mhash
        self.layouts = {l.layer: l for l in manifest.layers}
        self.fds = {}  # layer -> (fd, mode)
        self.sessions = 0
        self.dir_base = -1
        self.dir_size = sum(l.num_experts for l in manifest.layers)
        self._first = {}  # layer -> its first directory word, relative to dir_base
        n = 0
        for l in manifest.layers:
            self._first[l.layer] = n
            n += l.num_experts

    def entry(self, layer, expert) -> int:
        return self.dir_base + self._first[layer] + expert

    def open(self):
        for layer, l in self.layouts.items():
            try:  # inside the folder, a regular file, long enough (shared.blob.open_blob)
                self.fds[layer] = reader_mod.open_blob(self.dir, l)
            except (ManifestError, OSError) as e:
                raise Failure(E.BAD_MODEL, str(e), layer)

    def close(self):
        for fd, _ in self.fds.values():
            os.close(fd)
        self.fds.clear()


class Session:
    def __init__(self, sid, ident, pid, model, row, working_set, profile):
        self.id = sid
        self.ident = ident
        self.pid = pid
        self.model = model
        self.row = row  # of the pin table
        self.working_set = working_set
        self.profile = profile
        self.pidfd = None  # the shell's
        self.claims = 0  # records this session awaits
        self.contact = 0  # clock of its last request, or of our last grant to it
        self.expired = False  # its pins were taken back; it keeps its row until it ends
        self.waiters = set()
        self.now = 0  # the session's layer call number, from its last message
        self.requests = self.demands = self.hits = self.misses = self.bytes = 0
        self.started = time.time()


class Waiter:
    """One DEMAND waiting for its records."""

    def __init__(self, session, req_id, layer, received):
        self.session = session
        self.req_id = req_id
        self.layer = layer
        self.received = received
        self.refs = []
        self.stamps = []
        self.granted = []  # slots pinned for it (undone if it fails)
        self.pending = 0
        self.read = False  # some record had to be read from disk
        self.failed = False


class Core:
    HANDLERS = {
        P.MsgKind.HELLO: "on_hello",
        P.MsgKind.PREFETCH: "on_prefetch",
        P.MsgKind.DEMAND: "on_demand",
        P.MsgKind.STATS: "on_stats",
        P.MsgKind.BYE: "on_bye",
    }

    def __init__(self, cfg: Config, arena, reader, faults=None, clock=time.monotonic_ns):
        missing = set(P.REQUEST_KINDS) - set(self.HANDLERS)
        assert not missing, f"no handler for {sorted(missing)}"
        self.dispatch = {k: getattr(self, name) for k, name in self.HANDLERS.items()}
        self.cfg = cfg
        self.arena = arena
        self.reader = reader
        self.faults = faults or reader_mod.Faults()
        self.clock = clock
        self.sched = Scheduler(cfg.max_prefetch)
        self.outbox = []  # (ident, message)
        self.models = {}  # id -> Model
        self.model_by_dir = {}
        self.sessions = {}  # id -> Session
        self.by_ident = {}
        self.inflight = 0
        self.prefetching = 0  # of those, reads started as prefetches
        self.blocked = False  # a read waits for a slot: retry soon
        self.next_sid = 1
        self.next_mid = 1
        self.n_expired = 0  # sessions whose pins were taken back (they have no share)
        self.stopping = None
        self.draining = False
        self.info = {}  # the host's own figures for STATS (socket, read rate, ...)
        self.started = time.time()
        self.c = dict.fromkeys(
            ("requests", "demands", "prefetches", "hits", "misses", "reads", "bytes_read",
             "prefetch_reads", "read_errors", "checksum_errors", "retries", "internal_errors",
             "bad_messages", "refused_peers", "short_grants", "pins_expired"), 0)
        self.busy_ns = 0
        self.busy_since = 0
        self.lat = {k: Latency() for k in ("hit", "miss", "queue_wait", "read")}

    # ---- requests in, replies out ----------------------------------------------------

    def send(self, ident, msg):
        self.outbox.append((ident, msg))

    def receive(self, ident, body, peer_pid=0, received=None):
        """A request's frames (after the identity): decode, handle, answer."""
        received = self.clock() if received is None else received
        self.c["requests"] += 1
        req_id = None  # known once decoded; guessed from the raw body for errors
        try:
            try:
                msg = codec.decode(body)
            except codec.UnknownKind as e:
                raise Failure(E.UNKNOWN_KIND, str(e))
            except codec.TooLarge as e:
                raise Failure(E.TOO_LARGE, str(e))
            except codec.DecodeError as e:
                raise Failure(E.BAD_MESSAGE, str(e))
            req_id = getattr(msg, "req_id", None)
            self.handle(ident, msg, peer_pid, received)
        except Failure as f:
            if f.code in (E.BAD_MESSAGE, E.UNKNOWN_KIND, E.TOO_LARGE):
                self.c["bad_messages"] += 1
            self.send(ident, P.Error(req_id if req_id is not None else _guess_req_id(body),
                                     int(f.code), str(f), f.layer, f.expert))
        except Exception as e:  # a handler bug: answer, log, live on
            self.c["internal_errors"] += 1
            print(f"iod: internal error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            traceback.print_exc(file=sys.stderr)
            self.send(ident, P.Error(req_id if req_id is not None else _guess_req_id(body),
                                     int(E.INTERNAL), f"internal error: {type(e).__name__}", -1, -1))

    def handle(self, ident, msg, peer_pid=0, received=None):
        """A decoded request; raises Failure for a typed refusal."""
        kind = codec.kind_of(msg)
        handler = self.dispatch.get(kind)
        if handler is None:
            raise Failure(E.UNKNOWN_KIND, f"{P.MsgKind(kind).name} is not a request")
        if self.faults.rules and self.faults.take("handler", int(kind), 0):
            raise RuntimeError("injected handler fault (IOD_FAULTS, test only)")
        handler(ident, msg, peer_pid, self.clock() if received is None else received)

    # ---- sessions ----------------------------------------------------------------------

    def _session(self, ident, model_id=None, expired_ok=False) -> Session:
        s = self.by_ident.get(ident)
        if s is None:
            raise Failure(E.NO_SESSION, "no session: send HELLO first")
        s.requests += 1
        s.contact = self.clock()
        if s.expired and not expired_ok:
            raise Failure(E.PINS_EXPIRED, f"session {s.id}'s pins were taken back: it held more "
                          f"than its share of the arena and said nothing for "
                          f"{self.cfg.pin_timeout_s:g} s while other sessions waited for a slot; "
                          f"say HELLO again to go on")
        if model_id is not None and model_id != s.model.id:
            raise Failure(E.BAD_MODEL, f"model_id {model_id} is not this session's ({s.model.id})")
        return s

    def share(self, sessions=None) -> int:
        """Slots each session may pin or await: an equal share, so sessions
        that all hold theirs while waiting for more still fit (no deadlock)."""
        n = len(self.sessions) - self.n_expired if sessions is None else sessions
        return self.arena.slot_count // max(n, 1)

    def on_hello(self, ident, m: P.Hello, peer_pid, received):
        if m.version != P.PROTOCOL_VERSION:
            raise Failure(E.VERSION_MISMATCH,
                          f"protocol version {m.version} != daemon's {P.PROTOCOL_VERSION}")
        if self.stopping or self.draining:
            raise Failure(E.SHUTTING_DOWN, "iod is shutting down" if self.stopping
                          else "iod is draining: it finishes its sessions and takes no new ones")
        prior = self.by_ident.get(ident)  # a HELLO again replaces it, once valid
        others = len(self.sessions) - (prior is not None)
        if others >= self.cfg.max_sessions:
            raise Failure(E.TOO_MANY_SESSIONS, f"{others} sessions, the limit")
        if m.pid <= 0 or not pid_alive(m.pid):
            raise Failure(E.BAD_MESSAGE, f"pid {m.pid} is not a live process")
        if not _same_user(m.pid):
            raise Failure(E.PERMISSION, f"pid {m.pid} belongs to another user")
        if peer_pid and m.pid != peer_pid:
            raise Failure(E.PERMISSION, f"pid {m.pid} is not the process connected (pid {peer_pid})")
        model = self._model(m.model_dir)
        if model.hash != m.manifest_hash:
            raise Failure(E.MODEL_CHANGED,
                          f"{model.dir} changed since the session loaded it: manifest hash "
                          f"{m.manifest_hash}, now {model.hash}; load it again")
        if not self.arena.laid_out:
            try:
                self.arena.layout(self.cfg.slot_size or model.manifest.max_stride,
                                  self.cfg.max_sessions)
            except ValueError as e:
                raise Failure(E.BAD_MODEL, str(e))
        active = len(self.sessions) - self.n_expired - (prior is not None and not prior.expired)
        share = self.share(active + 1)
        need = max(m.working_set, 1)
        if share < need:
            raise Failure(E.TOO_MANY_SESSIONS,
                          f"an arena of {self.arena.slot_count} slots gives each of {active + 1} "
                          f"sessions {share}, fewer than the {need} one layer call needs; "
                          f"a larger --arena allows more sessions")
        if prior is not None:
            self.end_session(prior, "HELLO again")
        row = self.arena.take_row()
        s = Session(self.next_sid, ident, m.pid, model, row, need, m.profile)
        s.contact = self.clock()
        self.arena.own_row(row, s.id)
        self.next_sid += 1
        self.sessions[s.id] = s
        self.by_ident[ident] = s
        model.sessions += 1
        a = self.arena
        self.send(ident, P.HelloOk(m.req_id, s.id, model.id, os.getpid(), a.name or "",
                                   a.pins_name or "", row, a.pin_layout.rows, a.slot_size,
                                   a.slot_count, model.dir_base, model.hash))

    def _model(self, model_dir: str) -> Model:
        if not model_dir or "\x00" in model_dir or ".." in Path(model_dir).parts:
            raise Failure(E.BAD_MODEL, f"bad model path {model_dir!r}")
        try:
            folder = Path(model_dir).resolve(strict=True)
        except (OSError, RuntimeError):
            raise Failure(E.BAD_MODEL, f"{model_dir}: no such folder")
        if not folder.is_dir():
            raise Failure(E.BAD_MODEL, f"{folder} is not a folder")
        try:
            manifest, mhash = Manifest.load_with_hash(folder)  # one bounded, non-blocking read
        except (ManifestError, OSError) as e:
            raise Failure(E.BAD_MODEL, f"{folder}: {e}")
        known = self.model_by_dir.get(folder)
        if known is not None and known.hash == mhash:
            return known
        if not manifest.layers:
            raise Failure(E.BAD_MODEL, f"{folder}: manifest has no layers")
        limit = self.arena.slot_size or self.cfg.slot_size
        if limit and manifest.max_stride > limit:
            raise Failure(E.BAD_MODEL, f"{folder}: record stride {manifest.max_stride} exceeds the "
                          f"arena's slot size {limit}; restart iod with --slot-size")
        if len(self.models) >= self.cfg.max_models:
            self._unload_idle_model()
        if len(self.models) >= self.cfg.max_models:
            raise Failure(E.BAD_MODEL, f"{len(self.models)} models in use, the limit")
        model = Model(self.next_mid, folder, manifest, mhash)
        model.dir_base = self.arena.dir_alloc(model.dir_size)
        while model.dir_base is None and self._unload_idle_model():
            model.dir_base = self.arena.dir_alloc(model.dir_size)
        if model.dir_base is None:
            raise Failure(E.BAD_MODEL, f"{folder}: {model.dir_size} experts do not fit the "
                          f"arena's directory beside the models in use")
        try:
            model.open()
        except BaseException:
            model.close()
            self.arena.dir_release(model.dir_base, model.dir_size)
            raise
        self.next_mid += 1
        self.models[model.id] = model
        self.model_by_dir[folder] = model  # a changed manifest gets a new model id
        return model

    def _unload_idle_model(self) -> bool:
        """Forget a model no session uses and no read touches: its slots and
        directory words go (model ids are never reused)."""
        busy = {r.model.id for r in self.sched.reads.values()}
        for m in self.models.values():
            if m.sessions == 0 and m.id not in busy:
                for s in self.arena.slots:
                    if s.key is not None and s.key[0] == m.id:
                        self.arena.drop(s)
                m.close()
                self.arena.dir_release(m.dir_base, m.dir_size)
                del self.models[m.id]
                if self.model_by_dir.get(m.dir) is m:
                    del self.model_by_dir[m.dir]
                return True
        return False

    def on_stats(self, ident, m: P.Stats, peer_pid, received):
        s = self.by_ident.get(ident)
        if s is not None:
            s.requests += 1
            s.contact = self.clock()
        self.send(ident, P.StatsOk(m.req_id, self.stats()))

    def on_bye(self, ident, m: P.Bye, peer_pid, received):
        s = self._session(ident, expired_ok=True)
        self.send(ident, P.Ok(m.req_id, self.arena.held(s.row)))
        self.end_session(s, "BYE")

    def end_session(self, s: Session, why=""):
        """Everything a session held goes: its pins, queued prefetches, waits."""
        if self.sessions.pop(s.id, None) is None:
            return
        self.by_ident.pop(s.ident, None)
        for w in s.waiters:
            w.failed = True
        s.waiters.clear()
        self.sched.forget(s.id)
        self.arena.give_row(s.row)
        s.model.sessions -= 1
        self.n_expired -= s.expired

    # ---- prefetch and demand -----------------------------------------------------------

    def _layout(self, s: Session, layer, experts):
        layout = s.model.layouts.get(layer)
        if layout is None:
            raise Failure(E.OUT_OF_RANGE, f"layer {layer} is not in the model", layer)
        seen = dict.fromkeys(experts)
        for e in seen:
            if not 0 <= e < layout.num_experts:
                raise Failure(E.OUT_OF_RANGE,
                              f"layer {layer} expert {e} out of range 0..{layout.num_experts - 1}",
                              layer, e)
        return layout, list(seen)

    def _advance(self, s: Session, now: int):
        """The session is at layer call ``now``: prefetches due before it are late."""
        if now > s.now:
            s.now = now
            self.sched.expire(s.id, now)

    def on_prefetch(self, ident, m: P.Prefetch, peer_pid, received):
        s = self._session(ident, m.model_id)
        hints = [(h, *self._layout(s, h.layer, h.experts)) for h in m.hints]  # all valid, or none taken
        self._advance(s, m.now)
        self.c["prefetches"] += 1
        for h, layout, experts in hints:
            # due now: the call that sent it waits for these (its misses)
            urgent = h.due <= s.now
            for e in experts:
                key = (s.model.id, h.layer, e)
                if self.arena.lookup(key) is None:  # neither ready nor being read
                    self.sched.prefetch(key, s.model, layout, s.id, h.due, received, urgent)

    def on_demand(self, ident, m: P.Demand, peer_pid, received):
        s = self._session(ident, m.model_id)
        layout, experts = self._layout(s, m.layer, m.experts)
        self._advance(s, m.now)
        s.demands += 1
        self.c["demands"] += 1
        room = self.share() - self.arena.held(s.row) - s.claims
        w = Waiter(s, m.req_id, m.layer, received)
        for e in experts:
            if room <= 0:  # the session's share is used up: it gets the rest in waves
                self.c["short_grants"] += 1
                break
            room -= 1
            key = (s.model.id, m.layer, e)
            slot = self.arena.lookup(key)
            if slot is not None and slot.state == S.READY:
                self._grant(w, e, slot)
                continue
            if s.claims >= self.cfg.max_queued:
                if not w.refs and not w.pending:
                    raise Failure(E.QUEUE_FULL, f"{s.claims} records awaited, the limit is "
                                  f"{self.cfg.max_queued}", m.layer)
                break
            r = self.sched.demand(key, s.model, layout, s.id, received)
            if r.job is not None:  # a prefetch being read: its reader checks it at once
                r.job.urgent = True
            r.waiters.append(w)
            w.pending += 1
            s.claims += 1
            s.misses += 1
            self.c["misses"] += 1
        if w.pending:
            s.waiters.add(w)
        else:
            self._finish(w)

    def _grant(self, w: Waiter, expert, slot, read=None):
        s = w.session
        self.arena.pin_for(s.row, slot)
        w.granted.append(slot)
        s.bytes += slot.size
        w.refs.append(P.SlotRef(expert, slot.index, slot.generation, slot.size))
        w.read = w.read or read is not None
        if read is None:
            s.hits += 1
            self.c["hits"] += 1
        if s.profile:
            w.stamps.append([w.received, 0, 0, 0, 0] if read is None else
                            [w.received, read.queued, read.job.read_start, read.job.read_end, 0])

    def _finish(self, w: Waiter):
        sent = self.clock()
        for st in w.stamps:
            st[4] = sent
        self.lat["miss" if w.read else "hit"].add(sent - w.received)
        w.session.waiters.discard(w)
        w.session.contact = sent  # its pins' deadline runs from the grant
        self.send(w.session.ident, P.DemandOk(w.req_id, w.layer, w.refs, w.stamps))

    # ---- reads -------------------------------------------------------------------------

    def pump(self):
        """Start queued reads while workers and slots are free."""
        self.blocked = False
        while self.inflight < 2 * self.cfg.workers and not self.stopping:
            # prefetches fill at most half the reads in flight (a reader each:
            # Config.readers), so a demand that comes finds a free reader
            nxt = self.sched.next(None if self.prefetching < self.cfg.workers else DEMAND)
            if nxt is None:
                return
            sid, r = nxt
            l = r.layout
            slot = self.arena.allocate(r.key, r.model.entry(l.layer, r.key[2]))
            if slot is None:  # every slot pinned or filling: sessions unpin soon
                self.sched.put_back(sid, r)
                self.blocked = True
                return
            r.slot = slot
            if r.cls == PREFETCH:
                self.c["prefetch_reads"] += 1
                self.prefetching += 1
                r.prefetch_started = True
            self._submit(r)

    def _submit(self, r):
        l = r.layout
        fd, mode = r.model.fds[l.layer]
        r.job = reader_mod.Job(r.key, fd, mode, self.arena.data(r.slot.index, l.stride), l.stride,
                               r.key[2] * l.stride, l.record_bytes, l.checksum(r.key[2]),
                               l.layer, r.key[2])
        if self.inflight == 0:
            self.busy_since = self.clock()
        self.inflight += 1
        self.reader.submit(r.job, r.cls)

    def completed(self, job):
        """A read the reader finished (or failed)."""
        r = self.sched.reads.get(job.key)
        self.inflight -= 1
        if r is not None and r.prefetch_started and r.job is job:
            r.prefetch_started = False
            self.prefetching -= 1
        if self.inflight == 0:
            self.busy_ns += self.clock() - self.busy_since
        if r is None or r.job is not job:
            return
        job.dest.release()
        self.c["reads"] += 1
        self.c["bytes_read"] += job.got
        self.lat["queue_wait"].add(job.read_start - r.queued)
        self.lat["read"].add(job.read_end - job.read_start)
        layer, expert = r.key[1], r.key[2]
        if job.error is not None:
            code, msg = job.error
            if code == "CHECKSUM":
                self.c["checksum_errors"] += 1
                if not r.retried and not self.stopping:  # maybe transient: read once more
                    r.retried = True
                    self.c["retries"] += 1
                    self._submit(r)
                    return
            else:
                self.c["read_errors"] += 1
            self.sched.done(r)
            self.arena.abandon(r.slot)
            self._fail(r, E[code], f"layer {layer} expert {expert}: {msg}")
            return
        self.sched.done(r)
        live = [w for w in r.waiters if not w.failed]
        self.arena.publish(r.slot, r.layout.record_bytes, r.layout.checksum(expert),
                           prefetched=not live)
        self.arena.count_read()
        for w in r.waiters:
            w.session.claims -= 1
            if w.failed:
                continue
            self._grant(w, expert, r.slot, read=r)
            w.pending -= 1
            if w.pending == 0:
                self._finish(w)

    def _fail(self, r, code, message):
        layer, expert = r.key[1], r.key[2]
        for w in r.waiters:
            w.session.claims -= 1
            if w.failed:
                continue
            w.failed = True
            w.session.waiters.discard(w)
            for slot in w.granted:  # undo this demand's pins
                self.arena.unpin_for(w.session.row, slot)
            self.send(w.session.ident, P.Error(w.req_id, int(code), message, layer, expert))

    # ---- time, stats and shutdown ------------------------------------------------------

    def tick(self):
        """Once per loop turn of the host: the heartbeat sessions watch, and
        pins past their deadline while a read waits for a slot."""
        if self.arena.laid_out:
            self.arena.beat()
            if self.blocked:
                self.expire_pins()

    def expire_pins(self):
        """Shares sum to the arena, so a session within its share blocks
        nobody; one holding more (pinned while there were fewer sessions)
        that awaits nothing, has sent nothing and was granted nothing for
        ``pin_timeout_s`` has stopped reading (a stopped process, a bug): its
        pins are taken back, so the reads behind them go on. It keeps its row
        (cleared, its owner word zeroed first, which the session checks
        around each copy) until it ends; its requests get PINS_EXPIRED."""
        limit = self.cfg.pin_timeout_s * 1e9
        now = self.clock()
        share = self.share()
        for s in self.sessions.values():
            if s.waiters or now - s.contact < limit:
                continue
            held = self.arena.held(s.row)
            if held <= (0 if s.expired else share):
                continue
            if not s.expired:
                s.expired = True
                self.n_expired += 1
                self.c["pins_expired"] += 1
                print(f"iod: session {s.id} (pid {s.pid}) held {held} slots, more than its share "
                      f"of {share}, and said nothing for {self.cfg.pin_timeout_s:g} s while a read "
                      f"waited for a slot: its pins are taken back", file=sys.stderr, flush=True)
            self.sched.forget(s.id)
            self.arena.revoke_row(s.row)

    def stats(self) -> dict:
        a = self.arena
        busy = self.busy_ns + (self.clock() - self.busy_since if self.inflight else 0)
        c = dict(self.c)
        c["evictions"] = a.evictions
        c["prefetched_unused"] = a.unused_prefetches
        c["coalesced"] = self.sched.coalesced
        c["promoted"] = self.sched.promoted
        c["prefetches_dropped"] = self.sched.dropped
        pins = a.snapshot() if a.laid_out else None
        pin_timeout = self.cfg.pin_timeout_s
        return {
            "pid": os.getpid(),
            "version": P.PROTOCOL_VERSION,
            "uptime_s": round(time.time() - self.started, 3),
            "workers": self.cfg.workers,
            "readers": self.cfg.readers,
            "pin_timeout_s": pin_timeout if pin_timeout < float("inf") else None,  # JSON has no inf
            "share": self.share() if a.laid_out else 0,
            "draining": self.draining,
            "arena": {"name": a.name or "", "bytes": a.size, "slot_size": a.slot_size,
                      "slot_count": a.slot_count, "slots": a.counts(pins) if a.laid_out else {},
                      "prefaulted": a.prefaulted},
            "sessions": [
                {"id": s.id, "pid": s.pid, "model": s.model.id, "expired": s.expired,
                 "pins": a.held(s.row, pins), "awaiting": s.claims, "requests": s.requests,
                 "demands": s.demands, "hits": s.hits, "misses": s.misses, "bytes": s.bytes}
                for s in self.sessions.values()],
            "models": [
                {"id": m.id, "dir": str(m.dir), "hash": m.hash, "layers": len(m.layouts),
                 "read_mode": next(iter(m.fds.values()))[1] if m.fds else "",
                 "sessions": m.sessions}
                for m in self.models.values()],
            "counters": c,
            "queued_reads": self.sched.queued(),
            "inflight_reads": self.inflight,
            "read_busy_s": busy / 1e9,
            "read_MBps": (self.c["bytes_read"] / (busy / 1e9) / 1e6) if busy else 0.0,
            "latency_us": {k: v.summary() for k, v in self.lat.items()},
            **self.info,
        }

    def shutdown(self, reason):
        """Tell every session, end them, close the models (the host stops
        its reader first and feeds back the reads still in flight)."""
        reason = reason or "stop"
        self.stopping = self.stopping or reason
        for s in list(self.sessions.values()):
            self.send(s.ident, P.Shutdown(f"iod stopping: {reason}"))
            self.end_session(s, "shutdown")
        for m in self.models.values():
            m.close()


def _same_user(pid) -> bool:
    try:
        return os.stat(f"/proc/{pid}").st_uid == os.getuid()
    except OSError:
        return True  # no /proc (macOS): the 0700 run dir and 0600 socket guard


def _guess_req_id(body) -> int:
    """Best effort, so even an undecodable request's error names its req_id."""
    try:
        import msgpack

        d = msgpack.unpackb(bytes(body[1]), raw=False, max_array_len=codec.MAX_LIST,
                            max_map_len=codec.MAX_LIST, max_str_len=codec.MAX_STR,
                            max_bin_len=0, ext_hook=lambda c, d: None)
        r = d.get("req_id") if isinstance(d, dict) else None
        return r if type(r) is int and 0 <= r < (1 << 63) else 0
    except Exception:
        return 0
