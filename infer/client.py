"""The iod client: one session of the expert IO daemon, with no threads.

``IodClient`` says HELLO, maps the daemon's arena read-only, and hands the
caller read-only views of expert records that stay pinned in the arena until
``release``. Prefetches are fire-and-forget; their READY notifications are
consumed whenever the client next touches the socket, so a ``fetch`` of
prefetched experts costs no round trip.

With ``iod="auto"`` the client uses the user's shared daemon when one is
running and otherwise starts a private one as its child, which stops at
``close()``, at exit, or when this process dies (it watches a pipe from us).
"""

import atexit
import mmap
import os
import shutil
import sys
import tempfile
import time
import weakref
from pathlib import Path

import zmq

import native
from shared.launch import ensure_run_dir, lock_holder, pid_alive, spawn
from shared import codec, paths, trust
from shared import protocol as P
from shared import slots as S
from shared.blob import Manifest, ManifestError, manifest_hash

E = P.ErrorCode


class IodError(RuntimeError):
    """A typed error from the daemon; ``code`` is an ``ErrorCode`` (or None)."""

    def __init__(self, message, code=None, layer=-1, expert=-1):
        super().__init__(message)
        self.code = E(code) if code is not None and code in E._value2member_map_ else code
        self.layer = layer
        self.expert = expert


class DaemonDead(IodError):
    """The daemon died or went away. Sticky: every later call raises it
    until ``reconnect()``."""


def _error_text(code, message, layer, expert):
    where = ""
    if layer >= 0 and f"layer {layer}" not in message:
        where = f"layer {layer}" + (f" expert {expert}" if expert >= 0 else "") + ": "
    name = E(code).name if code in E._value2member_map_ else str(code)
    return f"iod {name}: {where}{message}"


class IodClient:
    """A session of ``iod`` for one prep folder.

    ``iod``: "auto" (shared daemon, else a private child daemon) or a socket
    path. ``timeout``: seconds without a reply after which the daemon's
    liveness is checked; a live but slow daemon is waited for.
    ``profile``: keep per-record hop stamps in ``hop_log``.
    """

    def __init__(self, model_dir, iod="auto", timeout=5.0, profile=False, arena="512M",
                 workers=4):
        self.model_dir = Path(model_dir).resolve()
        try:
            self.manifest = Manifest.load(self.model_dir)
        except ManifestError as e:
            raise IodError(str(e), E.BAD_MODEL) from None
        self.iod = iod
        self.timeout = float(timeout)
        self.profile = profile
        self.hop_log = []
        self.counters = dict.fromkeys(
            ("acquired", "ready_used", "demand_requests", "prefetch_requests", "prefetched",
             "released", "stale", "shed", "prefetch_failed", "errors", "bytes_copied",
             "stall_ns"), 0)
        self._arena_size = arena
        self._workers = workers
        self._private = None  # (Popen, run dir, parent pipe fd) of a daemon we started
        self._ctx = None
        self._sock = None
        self._mm = None
        self._pidfd = None
        self._dead = None
        self.daemon_pid = 0
        self.session_id = 0
        me = weakref.ref(self)  # atexit must not keep the client (and its mapping) alive
        self._atexit = lambda: me() is not None and me().close()
        atexit.register(self._atexit)
        self._connect()

    # ---- connecting ----------------------------------------------------------------

    def _reset_state(self):
        self._held = {}  # (layer, expert) -> (slot, generation, size)
        self._unused = set()  # held from a Ready, not yet returned by fetch
        self._requested = {}  # (layer, expert) -> req_id of the PREFETCH
        self._pending = {}  # req_id -> (kind, layer, experts, send ns)
        self._replies = {}  # req_id -> terminal reply awaited by a blocking call
        self._prefetch_sent = {}  # req_id -> pending entry, kept for hop stamps (profile only)
        self._next_req = 1

    def _connect(self):
        self._reset_state()
        self._dead = None
        if self.iod == "auto":
            sock = paths.socket_path()
            try:  # only a daemon of our uid, in a folder only we control
                pid = _lock_pid(sock) if trust.check_daemon(sock) else 0
            except OSError as e:
                pid = _say_unusable(sock, e)
            if pid > 0:
                try:
                    return self._attach(sock, pid)
                except IodError as e:  # gone, full, or its arena cannot take this model
                    _say_unusable(sock, e)
                    self._detach()
            sock, pid = self._start_private()
            return self._attach(sock, pid)
        sock = Path(self.iod)
        if not sock.exists():
            raise DaemonDead(f"no iod daemon at {sock} (no such socket)")
        pid = _lock_pid(sock)
        if pid == 0 and paths.lock_path(sock.parent).exists():
            raise DaemonDead(f"no iod daemon at {sock} (not running)")
        try:
            if not trust.check_daemon(sock):
                raise DaemonDead(f"no iod daemon at {sock} (nothing listens)")
        except trust.Untrusted as e:
            raise IodError(f"refusing the iod daemon at {sock}: {e}") from None
        self._attach(sock, pid)

    def _attach(self, sock: Path, pid: int):
        self.socket = sock
        self.daemon_pid = pid if pid > 0 else 0
        self._watch(self.daemon_pid)
        # the process-wide context: a client dropped without close() must not
        # leave a private context for the garbage collector, whose term()
        # blocks while the socket is still open
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 200)
        self._sock.setsockopt(zmq.RCVHWM, 100_000)
        self._sock.connect(paths.endpoint(sock))
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        if self._pidfd is not None:
            self._poller.register(self._pidfd, zmq.POLLIN)
        try:
            req = self._send(P.Hello(self._req(), P.PROTOCOL_VERSION, os.getpid(),
                                     str(self.model_dir)), "hello")
            ok = self._wait(req)
        except IodError:
            self._detach()
            raise
        if isinstance(ok, P.Error):
            self._detach()
            raise IodError(_error_text(ok.code, ok.message, ok.layer, ok.expert), ok.code,
                           ok.layer, ok.expert)
        mine = manifest_hash(self.model_dir)
        if ok.manifest_hash != mine:
            self._detach()
            raise IodError(f"manifest hash mismatch for {self.model_dir}: client {mine}, "
                           f"daemon {ok.manifest_hash}", E.BAD_MODEL)
        if ok.daemon_pid != self.daemon_pid:
            self.daemon_pid = ok.daemon_pid
            if self._pidfd is not None:
                self._poller.unregister(self._pidfd)
            self._watch(ok.daemon_pid)
            if self._pidfd is not None:
                self._poller.register(self._pidfd, zmq.POLLIN)
        self.session_id, self.model_id = ok.session_id, ok.model_id
        self.slot_size, self.slot_count, self.data_offset = ok.slot_size, ok.slot_count, ok.data_offset
        self.shm_name = ok.shm_name
        self._map(ok.shm_name)

    def _watch(self, pid):
        self._pidfd = None
        if pid > 0 and hasattr(os, "pidfd_open"):
            try:
                self._pidfd = os.pidfd_open(pid)
            except OSError:
                self._pidfd = None

    def _map(self, name):
        # shm_open + mmap directly: never registered with the resource tracker
        try:
            fd = native.shm_open_readonly(name)
            try:
                trust.check_arena_fd(fd, name)  # ours and 0600, or refused
                size = os.fstat(fd).st_size
                self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
            finally:
                os.close(fd)
        except OSError as e:  # trust.Untrusted included
            self._detach()
            raise IodError(f"cannot map the arena {name}: {e}") from None
        self._view = memoryview(self._mm)
        magic, version, slot_size, count, data_off, _ = S.ARENA_HEADER.unpack_from(self._view, 0)
        if magic != S.ARENA_MAGIC or (slot_size, count, data_off) != (
                self.slot_size, self.slot_count, self.data_offset):
            raise IodError(f"arena {name} does not match the daemon's HELLO reply", E.INTERNAL)

    def _start_private(self):
        """A daemon of our own, in a private run dir, that dies with us."""
        base = paths.run_dir()
        try:
            ensure_run_dir(base)
            _sweep_private_dirs(base)
            folder = Path(tempfile.mkdtemp(prefix="p", dir=base))
        except OSError:
            folder = Path(tempfile.mkdtemp(prefix="iod-"))
        sock = folder / "iod.sock"
        if len(str(sock)) > 100:  # AF_UNIX path limit
            shutil.rmtree(folder, ignore_errors=True)
            folder = Path(tempfile.mkdtemp(prefix="iod-"))
            sock = folder / "iod.sock"

        r, w = os.pipe()
        try:
            arena = str(self._arena_size)
            # short-lived: commit arena pages as they are used, not all at start
            proc, pid = spawn(sock, ["--arena", arena, "--workers", str(self._workers),
                                     "--no-prefault"], log=folder / "iod.log", parent_fd=r)
        except RuntimeError as e:
            os.close(w)
            shutil.rmtree(folder, ignore_errors=True)
            raise DaemonDead(f"cannot start a private iod: {e}") from None
        finally:
            os.close(r)
        self._private = (proc, folder, w)
        return sock, pid

    def _stop_private(self):
        if self._private is None:
            return
        proc, folder, w = self._private
        self._private = None
        os.close(w)  # EOF on the child's parent pipe: graceful stop
        try:
            proc.wait(timeout=10)
        except Exception:
            proc.terminate()
            try:
                proc.wait(timeout=2)
            except Exception:
                proc.kill()
                proc.wait()
        shutil.rmtree(folder, ignore_errors=True)

    def _detach(self):
        """Drop the connection and mapping (not the private daemon)."""
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = self._ctx = None
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        if self._mm is not None:
            try:
                self._view.release()
                self._mm.close()
            except BufferError:
                pass  # the caller still holds views; the mapping goes with them
            self._mm = None

    def reconnect(self) -> None:
        """After DaemonDead: attach to (or, with iod="auto", start) a fresh
        daemon and say HELLO again. Views from the old daemon are invalid."""
        self._detach()
        if self._private is not None:
            self._stop_private()
        self._connect()

    def close(self) -> None:
        """BYE, unmap, and stop the private daemon if we started it."""
        atexit.unregister(self._atexit)
        if self._sock is not None and self._dead is None:
            try:
                req = self._send(P.Bye(self._req()), "bye")
                self._wait(req, limit=min(self.timeout, 2.0))
            except IodError:
                pass
        self._detach()
        self._stop_private()
        self._dead = self._dead or DaemonDead("client closed")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- the wire ------------------------------------------------------------------

    def _req(self):
        r = self._next_req
        self._next_req += 1
        return r

    def _send(self, msg, kind, layer=-1, experts=()):
        if self._dead is not None:
            raise self._dead
        self._pending[msg.req_id] = (kind, layer, experts, time.monotonic_ns())
        try:
            self._sock.send_multipart(codec.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            self._die(f"cannot send to iod: {e}")
        return msg.req_id

    def _die(self, why):
        self._dead = DaemonDead(f"iod daemon (pid {self.daemon_pid}) is gone: {why}")
        raise self._dead

    def _alive(self) -> bool:
        if self._private is not None and self._private[0].poll() is not None:
            return False
        if self.daemon_pid and not pid_alive(self.daemon_pid):
            return False
        return self.socket.exists()

    def _drain(self):
        sock = self._sock
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # cheaper than catching Again
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = codec.decode(frames)
            except codec.DecodeError:
                self.counters["errors"] += 1
                continue
            self._on_message(msg, time.monotonic_ns())

    def _wait(self, req_id, limit=None):
        """Process messages until ``req_id``'s terminal reply arrives."""
        quiet_since = time.monotonic()
        end = None if limit is None else time.monotonic() + limit
        while req_id not in self._replies:
            if self._dead is not None:
                raise self._dead
            events = dict(self._poller.poll(int(min(self.timeout, 1.0) * 1000)))
            if self._sock in events:
                self._drain()
                quiet_since = time.monotonic()
                continue
            if self._pidfd is not None and self._pidfd in events:
                self._die("process exited")
            now = time.monotonic()
            if end is not None and now > end:
                raise IodError("no reply from iod", E.INTERNAL)
            if now - quiet_since >= self.timeout:
                if not self._alive():
                    self._die("no reply, and the process or socket is gone")
                if not self.daemon_pid and limit is None:
                    self._die(f"no reply within {self.timeout:g} s")
                quiet_since = now  # alive but slow: keep waiting
        return self._replies.pop(req_id)

    def _on_message(self, msg, t_recv):
        if isinstance(msg, P.Ready):
            self._on_ready(msg, t_recv)
        elif isinstance(msg, P.PrefetchFailed):
            self._requested.pop((msg.layer, msg.expert), None)
            self.counters["prefetch_failed"] += 1
        elif isinstance(msg, P.Shutdown):
            self._dead = DaemonDead(f"iod daemon (pid {self.daemon_pid}) shut down: {msg.reason}")
        elif isinstance(msg, P.AcquireOk):
            pend = self._pending.pop(msg.req_id, None)
            extra = []
            for ref in msg.slots:
                key = (msg.layer, ref[0])
                old = self._held.get(key)
                self._held[key] = (ref[1], ref[2], ref[3])
                self._unused.discard(key)
                if old is not None:  # each grant is a pin: keep one per record
                    extra.append(old[:2])
                self._log(pend, msg.layer, ref, t_recv, "acquire")
            self._send_release(extra)
            self._replies[msg.req_id] = msg
        else:
            pend = self._pending.pop(getattr(msg, "req_id", -1), None)
            kind = pend[0] if pend else None
            if kind == "prefetch":
                experts = pend[2]
                n = msg.count if isinstance(msg, P.Ok) else 0
                for e in experts[n:]:  # not accepted by the daemon
                    if self._requested.get((pend[1], e)) == msg.req_id:
                        del self._requested[(pend[1], e)]
                if isinstance(msg, P.Error):
                    self.counters["errors"] += 1
            elif kind in ("release", "cancel"):
                if isinstance(msg, P.Error):
                    self.counters["errors"] += 1
            elif kind is not None:
                self._replies[msg.req_id] = msg

    def _on_ready(self, msg, t_recv):
        ref = msg.slot
        key = (msg.layer, ref[0])
        req = self._requested.pop(key, None)
        if key in self._held:  # held already: this grant's pin is one too many
            self._send_release([[ref[1], ref[2]]])
            return
        if req is None:  # cancelled or released meanwhile: not wanted
            self._send_release([[ref[1], ref[2]]])
            return
        self._held[key] = (ref[1], ref[2], ref[3])
        self._unused.add(key)
        pend = self._pending.get(req) or self._prefetch_sent.get(req)
        self._log(pend, msg.layer, ref, t_recv, "prefetch")

    def _log(self, pend, layer, ref, t_recv, kind):
        if self.profile:
            self.hop_log.append({
                "kind": kind, "layer": layer, "expert": ref[0], "size": ref[3],
                "client_send": pend[3] if pend else 0, "received": ref[4], "queued": ref[5],
                "read_start": ref[6], "read_end": ref[7], "sent": ref[8], "client_recv": t_recv,
            })

    def _send_release(self, pairs):
        if pairs and self._dead is None:
            self.counters["released"] += len(pairs)
            self._send(P.Release(self._req(), [list(p) for p in pairs]), "release")

    # ---- the API -------------------------------------------------------------------

    def _check(self):
        if self._dead is not None:
            raise self._dead

    def prefetch(self, layer, experts) -> None:
        """Ask for records to be read ahead; fire and forget. Experts already
        pinned or requested by this client are skipped."""
        self._check()
        self._drain()
        todo = [int(e) for e in dict.fromkeys(experts)
                if (layer, int(e)) not in self._held and (layer, int(e)) not in self._requested]
        if not todo:
            return
        req = self._req()
        for e in todo:
            self._requested[(layer, e)] = req
        self.counters["prefetch_requests"] += 1
        self.counters["prefetched"] += len(todo)
        self._send(P.Prefetch(req, self.model_id, layer, todo), "prefetch", layer, todo)
        if self.profile:  # the Ok reply drops the pending entry before the Readys come
            self._prefetch_sent[req] = self._pending[req]

    def fetch(self, layer, experts) -> dict:
        """Read-only views of each expert's record bytes, pinned until
        ``release``. Blocks only for records not already ready."""
        self._check()
        t0 = time.monotonic_ns()
        experts = [int(e) for e in dict.fromkeys(experts)]
        self._drain()
        for attempt in range(3):
            missing = [e for e in experts if (layer, e) not in self._held]
            if missing:
                self.counters["demand_requests"] += 1
                req = self._send(P.Acquire(self._req(), self.model_id, layer, missing, True),
                                 "acquire", layer, missing)
                reply = self._wait(req)
                if isinstance(reply, P.Error) and reply.code == E.TOO_MANY_PINS and \
                        self._shed_unused(layer, experts):
                    continue  # prefetched records nobody used held the room: retry
                if isinstance(reply, P.Error):
                    self.counters["errors"] += 1
                    raise IodError(_error_text(reply.code, reply.message, reply.layer, reply.expert),
                                   reply.code, reply.layer, reply.expert)
                self.counters["acquired"] += len(missing)
            stale = [e for e in experts if not self._fresh(self._held[(layer, e)])]
            if not stale:
                break
            self.counters["stale"] += len(stale)
            for e in stale:
                self._held.pop((layer, e))
        else:
            raise IodError(f"layer {layer}: slots stayed stale after 3 acquires", E.BAD_SLOT, layer)
        out = {}
        used = 0
        for e in experts:
            slot, gen, size = self._held[(layer, e)]
            if (layer, e) in self._unused:
                self._unused.discard((layer, e))
                used += 1
            off = self.data_offset + slot * self.slot_size
            out[e] = self._view[off: off + size]
        self.counters["ready_used"] += used
        self.counters["stall_ns"] += time.monotonic_ns() - t0
        return out

    def _shed_unused(self, layer, keep) -> bool:
        """Release pins of prefetched records not yet fetched (except ``keep``
        of ``layer``); True if there were any."""
        keep = {(layer, e) for e in keep}
        drop = [k for k in self._unused if k not in keep]
        if not drop:
            return False
        self._unused.difference_update(drop)
        self._send_release([self._held.pop(k)[:2] for k in drop])
        self.counters["shed"] += len(drop)
        return True

    def _fresh(self, held) -> bool:
        slot, gen, _ = held
        off = S.header_offset(slot) + S.GENERATION_OFFSET
        return native.load_acquire_u64(self._view, off) == gen

    def release(self, layer, experts) -> None:
        """Drop this client's pins on the records (no wait for the reply)."""
        self._check()
        pairs = []
        for e in dict.fromkeys(experts):
            held = self._held.pop((layer, int(e)), None)
            if held is not None:
                self._unused.discard((layer, int(e)))
                pairs.append(held[:2])
        self._send_release(pairs)

    def cancel(self, layer=-1) -> None:
        """Drop this client's queued prefetches of ``layer`` (-1: all), and
        the pins of prefetched records it never fetched."""
        self._check()
        self._drain()
        for key in [k for k in self._requested if layer == -1 or k[0] == layer]:
            del self._requested[key]  # a Ready that still comes is released
        unused = [k for k in self._unused if layer == -1 or k[0] == layer]
        pairs = [self._held.pop(k)[:2] for k in unused]
        self._unused.difference_update(unused)
        self._send(P.Cancel(self._req(), self.model_id, layer), "cancel", layer)
        self._send_release(pairs)

    def poll(self) -> None:
        """Process everything that has arrived, without blocking."""
        self._check()
        self._drain()
        self._check()

    def stats(self) -> dict:
        """The daemon's STATS dict (as ``iod status --json`` prints it)."""
        self._check()
        req = self._send(P.Stats(self._req()), "stats")
        reply = self._wait(req)
        if isinstance(reply, P.Error):
            raise IodError(reply.message, reply.code)
        return reply.stats

    def ready(self, layer) -> list:
        """Experts of ``layer`` pinned for us right now (after a poll)."""
        return sorted(e for (l, e) in self._held if l == layer)

    @property
    def pinned(self) -> int:
        return len(self._held)


def _sweep_private_dirs(base: Path, min_age_s: float = 60.0) -> None:
    """Remove private run dirs whose daemon is gone (a SIGKILLed client and
    daemon leave one behind); young ones may belong to a daemon starting now."""
    now = time.time()
    for d in base.glob("p*"):
        try:
            if d.is_dir() and now - d.stat().st_mtime > min_age_s and \
                    not lock_holder(paths.lock_path(d)):
                shutil.rmtree(d, ignore_errors=True)
        except OSError:
            pass


_said = set()


def _say_unusable(sock, why) -> int:
    """Say once on stderr why a private daemon is started instead of the
    shared one; returns 0 (no shared daemon to use)."""
    line = f"iod: the shared daemon at {sock} is not usable ({why}); starting a private one"
    if line not in _said:
        _said.add(line)
        print(line, file=sys.stderr, flush=True)
    return 0


def _lock_pid(sock: Path) -> int:
    try:
        return lock_holder(paths.lock_path(Path(sock).parent))
    except OSError:
        return 0

