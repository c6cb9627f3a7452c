"""The iod daemon: one single-threaded state machine around a ROUTER socket.

The main thread owns every decision: sessions, pins, the read queues and the
arena. It waits in one ``zmq.Poller`` on the ROUTER socket, the reader pool's
completion pipe, a signal pipe, each session's pidfd (Linux) and the
parent's pipe (private daemons). Reader threads only pread and hash.

Queues: demand before prefetch; within each class, sessions take turns
(round robin). Exactly one read per (model, layer, expert) is queued or in
flight; later askers attach to it, and a demand on a queued prefetch promotes
it. Errors are replies (``Error`` with an ``ErrorCode``); a handler that
raises answers INTERNAL and the daemon carries on.
"""

import os
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import zmq

from shared import codec, paths
from shared import protocol as P
from shared import slots as S
from shared.blob import Manifest, ManifestError

from . import arena as arena_mod
from . import reader as reader_mod
from . import runtime
from shared.launch import pid_alive
from .stats import Latency

DEMAND, PREFETCH = 0, 1
QUEUED, INFLIGHT = 0, 1
E = P.ErrorCode


@dataclass
class Config:
    socket: Path
    arena_size: int = 512 << 20
    slot_size: int = 0
    workers: int = 4
    hashers: int = 2  # threads for checksums (0: each reader checks its own reads)
    read_rate: float = 0.0  # bytes/s, 0 = unlimited (benchmark emulation)
    max_sessions: int = 64
    max_pins: int = 4096  # per session, also capped by the arena's slot count
    max_queued: int = 8192  # per session: records queued or awaited
    max_models: int = 16
    liveness_s: float = 0.25  # pid poll period where pidfd is unavailable
    faults: str = ""
    prefault: bool = True  # commit the arena's pages at start


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
    def __init__(self, sid, ident, pid, model):
        self.id = sid
        self.ident = ident
        self.pid = pid
        self.model = model
        self.pidfd = None
        self.pins = {}  # slot index -> pin count (each Ready/AcquireOk grant is one)
        self.claims = 0  # records queued or awaited for this session
        self.requests = self.hits = self.misses = self.bytes = 0
        self.started = time.time()


class Waiter:
    """One ACQUIRE waiting for its records."""

    def __init__(self, session, req_id, layer, received, n):
        self.session = session
        self.req_id = req_id
        self.layer = layer
        self.received = received
        self.refs = {}  # expert -> SlotRef
        self.remaining = n
        self.added = []  # slots pinned by this acquire (undone on failure)
        self.failed = False


class Read:
    def __init__(self, key, model, layout):
        self.key = key
        self.model = model
        self.layout = layout
        self.cls = PREFETCH
        self.state = QUEUED
        self.slot = None
        self.queued = time.monotonic_ns()
        self.prefetchers = {}  # session id -> received ns
        self.waiters = []  # Waiter
        self.retried = False
        self.job = None

    def interested(self) -> bool:
        return bool(self.prefetchers) or any(not w.failed for w in self.waiters)


class Daemon:
    def __init__(self, cfg: Config, parent_fd=None):
        self.cfg = cfg
        self.parent_fd = parent_fd
        self.folder = Path(cfg.socket).parent
        self.started = time.time()
        self.models = {}  # id -> Model
        self.model_by_dir = {}
        self.sessions = {}  # id -> Session
        self.by_ident = {}
        self.by_pidfd = {}
        self.reads = {}  # key -> Read
        self.queues = ({}, {})  # class -> {session id: deque of keys}
        self.turns = (deque(), deque())  # class -> session ids in turn order
        self.inflight = 0
        self.next_sid = 1
        self.next_mid = 1
        self.stopping = None
        self.c = dict.fromkeys(
            ("requests", "hits", "misses", "reads", "bytes_read", "coalesced", "promoted",
             "read_errors", "checksum_errors", "retries", "cancelled", "internal_errors",
             "bad_messages", "evictions", "refused_peers"), 0)
        self.busy_ns = 0
        self.busy_since = 0
        self.lat = {k: Latency() for k in ("hit", "miss", "queue_wait", "read")}
        self._check_dispatch()

    # ---- start-up and the loop -------------------------------------------------

    HANDLERS = {
        P.MsgKind.HELLO: "on_hello",
        P.MsgKind.PREFETCH: "on_prefetch",
        P.MsgKind.ACQUIRE: "on_acquire",
        P.MsgKind.RELEASE: "on_release",
        P.MsgKind.CANCEL: "on_cancel",
        P.MsgKind.STATS: "on_stats",
        P.MsgKind.BYE: "on_bye",
    }

    def _check_dispatch(self):
        missing = set(P.REQUEST_KINDS) - set(self.HANDLERS)
        assert not missing, f"no handler for {sorted(missing)}"
        self.dispatch = {k: getattr(self, name) for k, name in self.HANDLERS.items()}

    def open(self):
        """Create the arena, the reader pool and bind the socket (lock held)."""
        cfg = self.cfg
        self.arena = arena_mod.Arena(None, cfg.arena_size, cfg.prefault)  # a fresh name
        self.shm_name = self.arena.name
        runtime.write_arena_record(self.folder, self.shm_name)
        if cfg.slot_size:
            self.arena.layout(cfg.slot_size)
        self.wake_r, self.wake_w = os.pipe()
        self.sig_r, self.sig_w = os.pipe()
        for fd in (self.wake_r, self.wake_w, self.sig_r, self.sig_w):
            os.set_blocking(fd, False)
        self.pool = reader_mod.ReaderPool(
            cfg.workers, self.wake_w, cfg.read_rate, reader_mod.Faults(cfg.faults), cfg.hashers)
        self.ctx = zmq.Context(1)
        # peer check: libzmq asks this ZAP handler about every new connection
        # before any of its messages pass (ipc peers come with uid and pid)
        self.zap = self.ctx.socket(zmq.REP)
        self.zap.setsockopt(zmq.LINGER, 0)
        self.zap.bind("inproc://zeromq.zap.01")
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ZAP_DOMAIN, b"iod")
        self.sock.setsockopt(zmq.MAXMSGSIZE, codec.MAX_MESSAGE_BYTES * 2)
        # bounded per peer: a session that stops reading loses messages, not our memory
        self.sock.setsockopt(zmq.SNDHWM, 20_000)
        self.sock.setsockopt(zmq.RCVHWM, 20_000)
        self.sock.setsockopt(zmq.LINGER, 500)
        old = os.umask(0o077)
        try:
            self.sock.bind(paths.endpoint(cfg.socket))
        finally:
            os.umask(old)
        os.chmod(cfg.socket, 0o600)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.wake_r, zmq.POLLIN)
        self.poller.register(self.sig_r, zmq.POLLIN)
        self.poller.register(self.zap, zmq.POLLIN)
        self.peer_pid = 0  # of the connection the message being handled came on
        if self.parent_fd is not None:
            self.poller.register(self.parent_fd, zmq.POLLIN)
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, self._on_signal)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN) if hasattr(signal, "SIGPIPE") else None

    def _on_signal(self, signum, frame):
        self.stopping = self.stopping or f"signal {signal.Signals(signum).name}"
        try:
            os.write(self.sig_w, b"s")
        except OSError:
            pass

    def serve(self):
        last_check = time.monotonic()
        while not self.stopping:
            events = dict(self.poller.poll(self._timeout_ms()))
            if self.sock in events:
                self._drain_socket()
            if self.wake_r in events:
                self._drain_completions()
            if self.sig_r in events:
                _drain_fd(self.sig_r)
            if self.zap in events:
                self._drain_zap()
            if self.parent_fd is not None and self.parent_fd in events:
                if not os.read(self.parent_fd, 4096):
                    self.stopping = "parent exited"
            for fd in [fd for fd in events if fd in self.by_pidfd]:
                self.end_session(self.by_pidfd[fd], "process exited")
            now = time.monotonic()
            if now - last_check >= self.cfg.liveness_s:
                last_check = now
                self._check_liveness()
            self._pump()
        self.shutdown(self.stopping)

    def _drain_zap(self):
        """Admit or refuse new connections: another uid's is refused before
        any of its messages pass; admitted ones carry their pid as User-Id."""
        while True:
            try:
                req = self.zap.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            cred = _zap_peer(req[3] if len(req) > 3 else b"")
            rid = req[1] if len(req) > 1 else b""
            if cred is not None and cred[0] != os.getuid():
                self.c["refused_peers"] += 1
                print(f"iod: refused a connection from uid {cred[0]} (pid {cred[2]})",
                      file=sys.stderr, flush=True)
                self.zap.send_multipart([b"1.0", rid, b"400", b"another user", b"", b""])
            else:
                user = str(cred[2]).encode() if cred is not None else b""
                self.zap.send_multipart([b"1.0", rid, b"200", b"OK", user, b""])

    def _timeout_ms(self):
        if any(s.pidfd is None for s in self.sessions.values()):
            return int(self.cfg.liveness_s * 1000)
        return 1000

    def _check_liveness(self):
        for s in list(self.sessions.values()):
            if s.pidfd is None and not pid_alive(s.pid):
                self.end_session(s, "process exited")

    def _drain_socket(self):
        for _ in range(1000):  # bounded, so completions are not starved
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            received = time.monotonic_ns()
            self.c["requests"] += 1
            try:  # set by _drain_zap when the connection was admitted
                self.peer_pid = int(frames[-1].get("User-Id") or 0)
            except (zmq.ZMQError, ValueError):
                self.peer_pid = 0
            self._handle([f.bytes for f in frames], received)

    def _handle(self, frames, received):
        ident, body = frames[0], frames[1:]
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
            kind = codec.kind_of(msg)
            handler = self.dispatch.get(kind)
            if handler is None:
                raise Failure(E.UNKNOWN_KIND, f"{P.MsgKind(kind).name} is not a request")
            req_id = msg.req_id
            if self.pool.faults.rules and self.pool.faults.take("handler", int(kind), 0):
                raise RuntimeError("injected handler fault (IOD_FAULTS, test only)")
            handler(ident, msg, received)
        except Failure as f:
            if f.code in (E.BAD_MESSAGE, E.UNKNOWN_KIND, E.TOO_LARGE):
                self.c["bad_messages"] += 1
            if req_id is None:
                req_id = _guess_req_id(body)
            self._send(ident, P.Error(req_id, int(f.code), str(f), f.layer, f.expert))
        except Exception as e:  # a handler bug: answer, log, live on
            self.c["internal_errors"] += 1
            print(f"iod: internal error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            import traceback

            traceback.print_exc(file=sys.stderr)
            if req_id is None:
                req_id = _guess_req_id(body)
            self._send(ident, P.Error(req_id, int(E.INTERNAL), f"internal error: {type(e).__name__}", -1, -1))

    def _send(self, ident, msg):
        try:
            self.sock.send_multipart([ident] + codec.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            pass  # the peer does not read; ROUTER drops for it

    # ---- sessions ---------------------------------------------------------------

    def _session(self, ident, model_id=None) -> Session:
        s = self.by_ident.get(ident)
        if s is None:
            raise Failure(E.NO_SESSION, "no session: send HELLO first")
        s.requests += 1
        if model_id is not None and model_id != s.model.id:
            raise Failure(E.BAD_MODEL, f"model_id {model_id} is not this session's ({s.model.id})")
        return s

    def on_hello(self, ident, m: P.Hello, received):
        if m.version != P.PROTOCOL_VERSION:
            raise Failure(E.VERSION_MISMATCH,
                          f"protocol version {m.version} != daemon's {P.PROTOCOL_VERSION}")
        if self.stopping:
            raise Failure(E.SHUTTING_DOWN, "iod is shutting down")
        prior = self.by_ident.get(ident)  # a HELLO again replaces it, once valid
        if len(self.sessions) - (prior is not None) >= self.cfg.max_sessions:
            raise Failure(E.TOO_MANY_SESSIONS, f"{len(self.sessions)} sessions, the limit")
        if m.pid <= 0 or not pid_alive(m.pid):
            raise Failure(E.BAD_MESSAGE, f"pid {m.pid} is not a live process")
        if not _same_user(m.pid):
            raise Failure(E.PERMISSION, f"pid {m.pid} belongs to another user")
        if self.peer_pid and m.pid != self.peer_pid:
            raise Failure(E.PERMISSION, f"pid {m.pid} is not the process connected "
                          f"(pid {self.peer_pid})")
        model = self._model(m.model_dir)
        if not self.arena.laid_out:
            try:
                self.arena.layout(model.manifest.max_stride)
            except ValueError as e:
                raise Failure(E.BAD_MODEL, str(e))
        if prior is not None:
            self.end_session(prior, "HELLO again")
        s = Session(self.next_sid, ident, m.pid, model)
        self.next_sid += 1
        try:
            s.pidfd = os.pidfd_open(m.pid)
        except (AttributeError, OSError):
            s.pidfd = None  # polled by _check_liveness instead
        if s.pidfd is not None:
            self.by_pidfd[s.pidfd] = s
            self.poller.register(s.pidfd, zmq.POLLIN)
        self.sessions[s.id] = s
        self.by_ident[ident] = s
        model.sessions += 1
        a = self.arena
        self._send(ident, P.HelloOk(m.req_id, s.id, model.id, os.getpid(), a.name,
                                    a.slot_size, a.slot_count, a.data_offset, model.hash))

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
        try:
            model.open()
        except BaseException:
            model.close()
            raise
        self.next_mid += 1
        self.models[model.id] = model
        self.model_by_dir[folder] = model  # a changed manifest gets a new model id
        return model

    def _unload_idle_model(self):
        """Forget a model no session uses and no read touches (its arena
        slots stay until evicted; model ids are never reused)."""
        busy = {r.model.id for r in self.reads.values()}
        for m in self.models.values():
            if m.sessions == 0 and m.id not in busy:
                m.close()
                del self.models[m.id]
                if self.model_by_dir.get(m.dir) is m:
                    del self.model_by_dir[m.dir]
                return

    def on_bye(self, ident, m: P.Bye, received):
        s = self._session(ident)
        self._send(ident, P.Ok(m.req_id, len(s.pins)))
        self.end_session(s, "BYE")

    def end_session(self, s: Session, why=""):
        """Release everything a session held: pins, queued prefetches, waits."""
        if self.sessions.pop(s.id, None) is None:
            return
        self.by_ident.pop(s.ident, None)
        if s.pidfd is not None:
            self.poller.unregister(s.pidfd)
            self.by_pidfd.pop(s.pidfd, None)
            os.close(s.pidfd)
        for i in list(s.pins):
            self.arena.unpin(self.arena.slots[i], s.id, every=True)
        s.pins.clear()
        for key, r in list(self.reads.items()):
            r.prefetchers.pop(s.id, None)
            for w in r.waiters:
                if w.session is s:
                    w.failed = True
            if r.state == QUEUED and not r.interested():
                del self.reads[key]
        for cls in (DEMAND, PREFETCH):
            self.queues[cls].pop(s.id, None)
            try:
                self.turns[cls].remove(s.id)
            except ValueError:
                pass
        s.model.sessions -= 1

    # ---- requests ---------------------------------------------------------------

    def _records(self, s: Session, layer, experts):
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

    def pin_cap(self) -> int:
        """Pins plus awaited records allowed per session: an equal share of
        the slots (so sessions that all hold their share while waiting for
        more still fit in the arena: no deadlock), at most --max-pins."""
        share = self.arena.slot_count // max(len(self.sessions), 1)
        return max(min(self.cfg.max_pins, share), 1)

    def _pin_room(self, s: Session, layer, new: int):
        limit = self.pin_cap()
        if len(s.pins) + s.claims + new > limit:
            raise Failure(E.TOO_MANY_PINS, f"session holds {len(s.pins)} pins and awaits "
                          f"{s.claims}; {new} more exceed its limit of {limit} (an arena of "
                          f"{self.arena.slot_count} slots shared by {len(self.sessions)} "
                          f"sessions; a larger --arena allows more)", layer)
        if s.claims + new > self.cfg.max_queued:
            raise Failure(E.QUEUE_FULL, f"{s.claims} records queued, the limit is "
                          f"{self.cfg.max_queued}", layer)

    def on_prefetch(self, ident, m: P.Prefetch, received):
        s = self._session(ident, m.model_id)
        layout, experts = self._records(s, m.layer, m.experts)
        limit = min(self.pin_cap(), len(s.pins) + self.cfg.max_queued)
        room = max(limit - len(s.pins) - s.claims, 0)
        todo, hits = [], []
        for e in experts:
            key = (s.model.id, m.layer, e)
            slot = self.arena.lookup(key)
            if slot is not None and slot.state == S.READY:
                if s.id in slot.pins or room > 0:
                    room -= 0 if s.id in slot.pins else 1
                    hits.append(slot)
                    continue
                break
            r = self.reads.get(key)
            if r is not None and s.id in r.prefetchers:
                todo.append(None)  # already asked for
                continue
            if room <= 0:
                break
            room -= 1
            todo.append(key)
        # count = experts accepted, a prefix of the request: each gets a Ready
        self._send(ident, P.Ok(m.req_id, len(hits) + len(todo)))
        for slot in hits:
            self._pin(s, slot)
            self.arena.touch(slot)
            self._count_hit(s, slot)
            self._send(ident, P.Ready(s.model.id, m.layer, self._ref(slot, received)))
        for key in filter(None, todo):
            s.misses += 1
            self.c["misses"] += 1
            r = self._read_for(key, s.model, layout, PREFETCH, s.id)
            r.prefetchers[s.id] = received
            s.claims += 1

    def on_acquire(self, ident, m: P.Acquire, received):
        s = self._session(ident, m.model_id)
        layout, experts = self._records(s, m.layer, m.experts)
        new = 0
        for e in experts:
            slot = self.arena.lookup((s.model.id, m.layer, e))
            if slot is None or slot.state != S.READY or s.id not in slot.pins:
                new += 1
        self._pin_room(s, m.layer, new)
        w = Waiter(s, m.req_id, m.layer, received, len(experts))
        cls = DEMAND if m.demand else PREFETCH
        for e in experts:
            key = (s.model.id, m.layer, e)
            slot = self.arena.lookup(key)
            if slot is not None and slot.state == S.READY:
                self._grant(w, e, slot, hit=True)
                continue
            s.misses += 1
            self.c["misses"] += 1
            r = self._read_for(key, s.model, layout, cls, s.id)
            r.waiters.append(w)
            s.claims += 1
        if w.remaining == 0:
            self._finish(w)

    def _pin(self, s: Session, slot):
        self.arena.pin(slot, s.id)
        s.pins[slot.index] = s.pins.get(slot.index, 0) + 1

    def _unpin(self, s: Session, slot):
        n = s.pins.get(slot.index, 0)
        if n == 0:
            return
        self.arena.unpin(slot, s.id)
        if n == 1:
            del s.pins[slot.index]
        else:
            s.pins[slot.index] = n - 1

    def _count_hit(self, s, slot):
        s.hits += 1
        s.bytes += slot.size
        self.c["hits"] += 1

    def _grant(self, w: Waiter, expert, slot, hit=False, read=None):
        s = w.session
        self._pin(s, slot)
        w.added.append(slot)
        self.arena.touch(slot)
        if hit:
            self._count_hit(s, slot)
        w.refs[expert] = self._ref(slot, w.received, read)
        w.remaining -= 1

    def _finish(self, w: Waiter):
        sent = time.monotonic_ns()
        refs = [w.refs[e] for e in w.refs]
        all_hits = not any(ref[6] for ref in refs)
        for ref in refs:
            ref[8] = sent
            if ref[6]:
                self.lat["miss"].add(sent - ref[4])
            elif all_hits:  # a hit that waited for a read in the same acquire is neither
                self.lat["hit"].add(sent - ref[4])
        self._send(w.session.ident, P.AcquireOk(w.req_id, w.layer, refs))

    def _ref(self, slot, received, read=None):
        sent = time.monotonic_ns()
        model_id, layer, expert = slot.key
        if read is None:
            return [expert, slot.index, slot.generation, slot.size, received, 0, 0, 0, sent]
        j = read.job
        return [expert, slot.index, slot.generation, slot.size, received, read.queued,
                j.read_start, j.read_end, sent]

    def _read_for(self, key, model, layout, cls, sid) -> Read:
        """The one read of ``key``: existing (attach, maybe promote) or new."""
        r = self.reads.get(key)
        if r is None:
            r = self.reads[key] = Read(key, model, layout)
            r.cls = cls
        else:
            self.c["coalesced"] += 1
            if r.state == QUEUED and cls == DEMAND and r.cls == PREFETCH:
                r.cls = DEMAND
                self.c["promoted"] += 1
        if r.state == QUEUED:
            q = self.queues[r.cls].get(sid)
            if q is None:
                q = self.queues[r.cls][sid] = deque()
                self.turns[r.cls].append(sid)
            q.append(key)
        return r

    def on_release(self, ident, m: P.Release, received):
        s = self._session(ident)
        n = 0
        for pair in m.slots:
            if len(pair) != 2 or not 0 <= pair[0] < self.arena.slot_count:
                raise Failure(E.BAD_SLOT, f"bad slot reference {pair}")
        for i, gen in m.slots:
            slot = self.arena.slots[i]
            if slot.generation == gen and i in s.pins:
                self._unpin(s, slot)
                n += 1
        self._send(ident, P.Ok(m.req_id, n))

    def on_cancel(self, ident, m: P.Cancel, received):
        s = self._session(ident, m.model_id)
        n = 0
        for key, r in list(self.reads.items()):
            if r.state != QUEUED or s.id not in r.prefetchers or key[0] != s.model.id:
                continue
            if m.layer != -1 and key[1] != m.layer:
                continue
            del r.prefetchers[s.id]
            s.claims -= 1
            n += 1
            if not r.interested():
                del self.reads[key]
        self.c["cancelled"] += n
        self._send(ident, P.Ok(m.req_id, n))

    def on_stats(self, ident, m: P.Stats, received):
        if ident in self.by_ident:
            self.by_ident[ident].requests += 1
        self._send(ident, P.StatsOk(m.req_id, self.stats()))

    # ---- reads ------------------------------------------------------------------

    def _next_key(self):
        for cls in (DEMAND, PREFETCH):
            turns, queues = self.turns[cls], self.queues[cls]
            for _ in range(len(turns)):
                sid = turns[0]
                turns.rotate(-1)
                q = queues[sid]
                while q:
                    key = q.popleft()
                    r = self.reads.get(key)
                    if r is None or r.state != QUEUED or r.cls != cls:
                        continue  # stale: started, promoted, or nobody wants it now
                    return cls, sid, key
            # drop emptied session queues
            for sid in [sid for sid, q in queues.items() if not q]:
                del queues[sid]
                turns.remove(sid)
        return None

    def _pump(self):
        """Start queued reads while workers and slots are free."""
        # a few more than the workers, so a worker never waits for this thread
        while self.inflight < 2 * self.cfg.workers and not self.stopping:
            nxt = self._next_key()
            if nxt is None:
                return
            cls, sid, key = nxt
            r = self.reads[key]
            slot = self.arena.allocate(key)
            if slot is None:  # every slot pinned or filling: wait for a release
                self.queues[cls].setdefault(sid, deque()).appendleft(key)
                if sid not in self.turns[cls]:
                    self.turns[cls].appendleft(sid)
                return
            r.slot, r.state = slot, INFLIGHT
            self._submit(r, cls)

    def _submit(self, r: Read, cls=DEMAND):
        l = r.layout
        fd, mode = r.model.fds[l.layer]
        r.job = reader_mod.Job(r.key, fd, mode, self.arena.data(r.slot.index, l.stride), l.stride,
                               r.key[2] * l.stride, l.record_bytes, l.checksum(r.key[2]),
                               l.layer, r.key[2])
        if self.inflight == 0:
            self.busy_since = time.monotonic_ns()
        self.inflight += 1
        self.pool.submit(r.job, cls)

    def _drain_completions(self):
        _drain_fd(self.wake_r)
        while True:
            try:
                job = self.pool.done.get_nowait()
            except Exception:
                return
            self.inflight -= 1
            if self.inflight == 0:
                self.busy_ns += time.monotonic_ns() - self.busy_since
            self._completed(self.reads[job.key], job)

    def _completed(self, r: Read, job):
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
            del self.reads[r.key]
            self.arena.abandon(r.slot)
            self._fail(r, E[code], f"layer {layer} expert {expert}: {msg}")
            return
        del self.reads[r.key]
        self.arena.publish(r.slot, r.layout.record_bytes, r.layout.checksum(expert))
        for sid, received in r.prefetchers.items():
            s = self.sessions.get(sid)
            if s is None:
                continue
            s.claims -= 1
            self._pin(s, r.slot)
            s.bytes += r.slot.size
            ref = self._ref(r.slot, received, r)
            self.lat["miss"].add(ref[8] - received)
            self._send(s.ident, P.Ready(r.model.id, layer, ref))
        for w in r.waiters:
            w.session.claims -= 1
            if w.failed:
                continue
            w.session.bytes += r.slot.size
            self._grant(w, expert, r.slot, read=r)
            if w.remaining == 0:
                self._finish(w)

    def _fail(self, r: Read, code, message):
        layer, expert = r.key[1], r.key[2]
        for sid in r.prefetchers:
            s = self.sessions.get(sid)
            if s is not None:
                s.claims -= 1
                self._send(s.ident, P.PrefetchFailed(r.model.id, layer, expert, int(code), message))
        for w in r.waiters:
            w.session.claims -= 1
            if w.failed:
                continue
            w.failed = True
            for slot in w.added:  # undo this acquire's pins
                self._unpin(w.session, slot)
            self._send(w.session.ident, P.Error(w.req_id, int(code), message, layer, expert))

    # ---- stats and shutdown -----------------------------------------------------

    def stats(self) -> dict:
        a = self.arena
        busy = self.busy_ns + (time.monotonic_ns() - self.busy_since if self.inflight else 0)
        c = dict(self.c)
        c["evictions"] = a.evictions
        return {
            "pid": os.getpid(),
            "version": P.PROTOCOL_VERSION,
            "uptime_s": round(time.time() - self.started, 3),
            "socket": str(self.cfg.socket),
            "workers": self.cfg.workers,
            "pin_cap": self.pin_cap() if self.arena.laid_out else 0,
            "read_rate_limit_MBps": self.cfg.read_rate / 1e6,
            "arena": {"name": a.name, "bytes": a.size, "slot_size": a.slot_size,
                      "slot_count": a.slot_count, "slots": a.counts() if a.laid_out else {},
                      "prefaulted": a.prefaulted},
            "sessions": [
                {"id": s.id, "pid": s.pid, "model": s.model.id, "pins": len(s.pins),
                 "queued": s.claims, "requests": s.requests, "hits": s.hits,
                 "misses": s.misses, "bytes": s.bytes}
                for s in self.sessions.values()],
            "models": [
                {"id": m.id, "dir": str(m.dir), "hash": m.hash, "layers": len(m.layouts),
                 "read_mode": next(iter(m.fds.values()))[1] if m.fds else "",
                 "sessions": m.sessions}
                for m in self.models.values()],
            "counters": c,
            "queued_reads": sum(1 for r in self.reads.values() if r.state == QUEUED),
            "inflight_reads": self.inflight,
            "read_busy_s": busy / 1e9,
            "read_MBps": (self.c["bytes_read"] / (busy / 1e9) / 1e6) if busy else 0.0,
            "latency_us": {k: v.summary() for k, v in self.lat.items()},
        }

    def shutdown(self, reason):
        """In-flight reads finish, sessions are told, shm and socket go."""
        reason = reason or "stop"
        self.pool.stop()
        while self.inflight:
            try:
                job = self.pool.done.get_nowait()
            except Exception:
                break
            self.inflight -= 1
            r = self.reads.get(job.key)
            if r is not None:
                self._completed(r, job)
        for s in list(self.sessions.values()):
            self._send(s.ident, P.Shutdown(f"iod stopping: {reason}"))
            self.end_session(s, "shutdown")
        try:
            self.sock.close(linger=500)
            self.zap.close(linger=0)
            self.ctx.term()
        except zmq.ZMQError as e:  # still remove what we own below
            print(f"iod: closing the socket: {e}", file=sys.stderr, flush=True)
        for m in self.models.values():
            m.close()
        self.arena.close(unlink=True)
        for p in (paths.arena_record_path(self.folder), Path(self.cfg.socket)):
            try:
                p.unlink()
            except FileNotFoundError:
                pass


def _drain_fd(fd):
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _same_user(pid) -> bool:
    try:
        return os.stat(f"/proc/{pid}").st_uid == os.getuid()
    except OSError:
        return True  # no /proc (macOS): the 0700 run dir and 0600 socket guard


def _zap_peer(address: bytes):
    """(uid, gid, pid) from a ZAP request's address for an ipc peer, which
    libzmq fills from SO_PEERCRED as "host:uid:gid:pid"; None when absent."""
    parts = address.decode(errors="replace").split(":")
    if len(parts) != 4:
        return None
    try:
        return int(parts[1]), int(parts[2]), int(parts[3])
    except ValueError:
        return None


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
