"""The iod client: one session of the expert IO daemon, with no threads.

``IodClient`` says HELLO, maps the daemon's arena read-only and its own row
of the pin table read-write, and serves ``shared.source.ExpertSource``:
records ready in the arena are pinned and copied with no message; a layer
call's other records go in one DEMAND; prefetches are fire-and-forget hints.

Every wait has a bound: while it waits for a reply the client watches the
daemon's heartbeat word in the arena. A daemon whose loop stops turning
(stopped, wedged) for ``timeout`` seconds is declared dead; one whose loop
turns but completes no read for ``progress_timeout`` seconds while a demand
waits is declared stuck. A slow disk keeps completing reads and is waited for.

With ``iod="auto"`` the client uses the user's shared daemon when one is
running and usable, and otherwise starts a private one as its child (saying
why on stderr), which stops at ``close()``, at exit, or when this process
dies (it watches a pipe from us).
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
from shared import codec, paths, trust
from shared import protocol as P
from shared import slots as S
from shared.blob import Manifest, ManifestError
from shared.launch import ensure_run_dir, lock_holder, pid_alive, spawn
from shared.source import ExpertSource, SourceError

E = P.ErrorCode
# a daemon stopped at a socket may be started again there (`iod restart`):
# a session waits this long for it before it gives up (--iod SOCKET) or,
# after a shared daemon's orderly stop, starts a private one (--iod auto)
RESTART_WAIT_S = 2.5


class IodError(SourceError):
    """A typed error from the daemon; ``code`` is an ``ErrorCode`` (or None)."""

    def __init__(self, message, code=None, layer=-1, expert=-1):
        if code is not None and code in E._value2member_map_:
            code = E(code)
        super().__init__(message, code, layer, expert)


class DaemonDead(IodError):
    """The daemon died, went away or stopped answering. Sticky: every later
    call raises it until ``reconnect()``."""


class PinsExpired(IodError):
    """The daemon took this session's pins back: it held more than its share
    of the arena and said nothing for the daemon's --pin-timeout while other
    sessions waited (a stopped process). Nothing copied since is used.
    Every later call raises it until ``reconnect()``."""

    def __init__(self, message):
        super().__init__(_error_text(E.PINS_EXPIRED, message, -1, -1), E.PINS_EXPIRED)


def _error_text(code, message, layer, expert):
    where = ""
    if layer >= 0 and f"layer {layer}" not in message:
        where = f"layer {layer}" + (f" expert {expert}" if expert >= 0 else "") + ": "
    name = E(code).name if code in E._value2member_map_ else str(code)
    return f"iod {name}: {where}{message}"


class IodClient(ExpertSource):
    """A session of ``iod`` for one prep folder.

    ``iod``: "auto" (shared daemon, else a private child daemon) or a socket
    path. ``timeout``: seconds the daemon's loop may stand still before it is
    declared dead; ``progress_timeout``: seconds a demand may wait while the
    daemon completes no read at all. ``profile``: keep per-record hop stamps
    in ``hop_log``. ``working_set``: records one layer call needs at least.
    """

    def __init__(self, model_dir, iod="auto", timeout=10.0, progress_timeout=120.0,
                 profile=False, arena="512M", workers=0, working_set=1):
        self.model_dir = Path(model_dir).resolve()
        try:
            # the identity of what this session loaded: a daemon serving
            # anything else (re-prepped folder, restarted daemon) is refused
            self.manifest, self.manifest_hash = Manifest.load_with_hash(self.model_dir)
        except (ManifestError, OSError) as e:
            raise IodError(str(e), E.BAD_MODEL) from None
        self.iod = iod
        self.timeout = float(timeout)
        self.progress_timeout = float(progress_timeout)
        self.profile = profile
        self.working_set = working_set
        self._reset_counters()
        self._arena_size = arena
        self._workers = workers
        self._private = None  # (Popen, run dir, parent pipe fd) of a daemon we started
        self._sock = None
        self._mm = self._pins_mm = None
        self._pidfd = None
        self._dead = None
        self._shut_down = False  # the daemon said it stops (SHUTDOWN)
        self.daemon_pid = 0
        self.session_id = 0
        me = weakref.ref(self)  # atexit must not keep the client (and its mapping) alive
        self._atexit = lambda: me() is not None and me().close()
        atexit.register(self._atexit)
        try:
            self._connect()
        except BaseException:  # refused or interrupted: no private daemon or run dir outlives us
            atexit.unregister(self._atexit)
            self._detach()
            self._stop_private()
            raise

    # ---- connecting ----------------------------------------------------------------

    def _connect(self):
        self._next_req = 1
        self._awaiting = set()  # req_ids of calls whose reply is wanted
        self._replies = {}
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
                    self._detach()
                    if e.code == E.MODEL_CHANGED:
                        raise
                    _say_unusable(sock, e)
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
        # a fresh connection: a failed attach before it (an unanswered HELLO
        # to the shared daemon) must not fail this one with its sticky error
        self._dead = None
        self._shut_down = False
        self.socket = sock
        self.daemon_pid = pid if pid > 0 else 0
        self._watch(self.daemon_pid)
        # the process-wide context: a client dropped without close() must not
        # leave a private context for the garbage collector, whose term()
        # blocks while the socket is still open
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 200)
        self._sock.connect(paths.endpoint(sock))
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        if self._pidfd is not None:
            self._poller.register(self._pidfd, zmq.POLLIN)
        try:
            ok = self._call(P.Hello(self._req(), P.PROTOCOL_VERSION, os.getpid(),
                                    str(self.model_dir), self.manifest_hash, self.working_set,
                                    self.profile), hello=True)
        except IodError:
            self._detach()
            raise
        if ok.manifest_hash != self.manifest_hash:
            self._detach()
            raise IodError(f"{self.model_dir} changed since this session loaded it (manifest "
                           f"hash {self.manifest_hash}, the daemon serves {ok.manifest_hash})",
                           E.MODEL_CHANGED)
        if ok.daemon_pid != self.daemon_pid:
            self.daemon_pid = ok.daemon_pid
            if self._pidfd is not None:
                self._poller.unregister(self._pidfd)
            self._watch(ok.daemon_pid)
            if self._pidfd is not None:
                self._poller.register(self._pidfd, zmq.POLLIN)
        self.session_id = ok.session_id
        self.slot_size, self.slot_count = ok.slot_size, ok.slot_count
        self.shm_name = ok.shm_name
        self._map(ok)
        self._attach_arena(self._view, self._pins_view, ok, self.manifest)
        self._owner_off = S.PinLayout(ok.slot_count, ok.pin_rows).owner(ok.pin_row)
        # slot 0's generation word and data: the checks around each copy
        self._slot0 = (self.layout.generation(0), self.layout.data(0), self.layout.slot_size)

    def _watch(self, pid):
        self._pidfd = None
        if pid > 0 and hasattr(os, "pidfd_open"):
            try:
                self._pidfd = os.pidfd_open(pid)
            except OSError:
                self._pidfd = None

    def _map(self, ok):
        # shm_open + mmap directly: never registered with the resource tracker
        try:
            self._mm = _map_segment(ok.shm_name, write=False)
            self._view = memoryview(self._mm)
            self._pins_mm = _map_segment(ok.pins_name, write=True)
            self._pins_view = memoryview(self._pins_mm)
        except OSError as e:  # trust.Untrusted included
            self._detach()
            raise IodError(f"cannot map the arena {ok.shm_name}: {e}") from None
        magic, version, slot_size, count, *_ = S.ARENA_HEADER.unpack_from(self._view, 0)
        if magic != S.ARENA_MAGIC or version != S.ARENA_VERSION or \
                (slot_size, count) != (ok.slot_size, ok.slot_count):
            self._detach()
            raise IodError(f"arena {ok.shm_name} does not match the daemon's HELLO reply",
                           E.INTERNAL)

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
            # short-lived: commit arena pages as they are used, not all at start
            proc, pid = spawn(sock, ["--arena", str(self._arena_size), "--workers",
                                     str(self._workers), "--no-prefault"],
                              log=folder / "iod.log", parent_fd=r)
        except BaseException as e:  # refused, or interrupted while it started (spawn stopped it)
            os.close(w)
            shutil.rmtree(folder, ignore_errors=True)
            if isinstance(e, RuntimeError):
                raise DaemonDead(f"cannot start a private iod: {e}") from None
            raise
        finally:
            os.close(r)
        self._private = (proc, folder, w)
        return sock, pid

    def _stop_private(self):
        if self._private is None:
            return
        proc, folder, w = self._private
        self._private = None
        # the folder goes whatever interrupts the wait (a second Ctrl-C while
        # a dead daemon is replaced): with its pipe closed the daemon stops anyway
        try:
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
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _detach(self):
        """Drop the connection and mappings (not the private daemon)."""
        self._unpin_cuda()  # before its mapping goes
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        for view, mm in (("_view", "_mm"), ("_pins_view", "_pins_mm")):
            if getattr(self, mm, None) is not None:
                try:
                    getattr(self, view).release()
                    getattr(self, mm).close()
                except BufferError:
                    pass  # the caller still holds views; the mapping goes with them
                setattr(self, mm, None)

    def reconnect(self) -> None:
        """After DaemonDead: attach to a fresh daemon (with iod="auto" the
        shared one, else one it starts; with a socket, one restarted there)
        and say HELLO again, with the manifest hash this session loaded (a
        changed prep folder is refused: MODEL_CHANGED). DaemonDead if none.
        After PinsExpired: BYE, and HELLO again to the same daemon."""
        stopping = self._shut_down
        if self._dead is None and self._sock is not None and self._expired():
            self._bye()
            # a stopping daemon lets every pin go: said (its SHUTDOWN, read
            # during the BYE) or gone by the HELLO, it leaves this session
            # to the next daemon, as a crashed one does
            stopping = stopping or self._shut_down
            if not stopping:
                self._detach()
                try:
                    return self._attach(self.socket, self.daemon_pid)
                except DaemonDead as e:
                    self._dead = e
                except IodError as e:
                    self._dead = DaemonDead(str(e))
                    raise self._dead from None
        dead, old = self._dead, self.daemon_pid
        shared = self._private is None
        self._detach()
        if self._private is not None:
            self._stop_private()
        if self.iod != "auto" or (shared and stopping):
            _await_restart(Path(self.iod) if self.iod != "auto" else paths.socket_path(), old)
        if self.iod != "auto" and old > 0 and _lock_pid(Path(self.iod)) == old:
            # the same daemon holds the socket, not a restarted one: a loop
            # that stood still (stopped, wedged) would not answer a HELLO either
            self._dead = dead or DaemonDead(f"iod daemon (pid {old}) is gone")
            raise self._dead
        try:
            self._connect()
        except IodError as e:  # still dead: a later call raises again (and may retry)
            if isinstance(e, DaemonDead) and self.iod != "auto" and dead is not None:
                e = dead  # nothing answers at the socket: why the daemon went is the news
            self._dead = e if isinstance(e, DaemonDead) else DaemonDead(str(e))
            raise e from None

    def close(self) -> None:
        """BYE, unmap, and stop the private daemon if we started it."""
        atexit.unregister(self._atexit)
        if self._sock is not None and self._dead is None:
            self._bye()
        self._detach()
        self._stop_private()
        self._dead = self._dead or DaemonDead("client closed")

    # ---- the wire ------------------------------------------------------------------

    def _req(self):
        r = self._next_req
        self._next_req += 1
        return r

    def _expired(self) -> bool:
        """The daemon took this session's pins back (its row's owner word)."""
        return self._pins_mm is not None and \
            native.load_u64(self._pins_view, self._owner_off) != self.session_id

    def _check(self):
        if self._dead is not None:
            raise self._dead
        if self._expired():
            raise PinsExpired(f"session {self.session_id}'s pins were taken back by the daemon "
                              f"(pid {self.daemon_pid}): it held more than its share of the arena "
                              f"and said nothing while other sessions waited for a slot (stopped?)")

    def _send(self, msg):
        if self._dead is not None:  # a session whose pins expired may still say BYE
            raise self._dead
        try:
            self._sock.send_multipart(codec.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            self._die(f"cannot send to iod: {e}")

    def _bye(self):
        """BYE, its reply awaited at most 2 s, with no other check: a session
        whose pins expired says it too (its row goes)."""
        msg = P.Bye(self._req())
        try:
            self._send(msg)
        except IodError:
            return
        self._awaiting.add(msg.req_id)
        end = time.monotonic() + min(self.timeout, 2.0)
        while msg.req_id not in self._replies and time.monotonic() < end:
            events = dict(self._poller.poll(50))
            if self._pidfd is not None and self._pidfd in events:
                break  # the daemon is gone
            if self._sock in events:
                self._drain()
        self._awaiting.discard(msg.req_id)
        self._replies.pop(msg.req_id, None)

    def _die(self, why):
        self._dead = DaemonDead(f"iod daemon (pid {self.daemon_pid}) is gone: {why}")
        raise self._dead

    def _call(self, msg, hello=False, limit=None):
        """Send a call and wait for its terminal reply (an Error raises)."""
        self._send(msg)
        self._awaiting.add(msg.req_id)
        try:
            reply = self._wait(msg.req_id, hello, limit)
        finally:
            self._awaiting.discard(msg.req_id)
        if isinstance(reply, P.Error):
            if reply.code == E.PINS_EXPIRED:
                raise PinsExpired(reply.message)
            raise IodError(_error_text(reply.code, reply.message, reply.layer, reply.expert),
                           reply.code, reply.layer, reply.expert)
        return reply

    def _wait(self, req_id, hello=False, limit=None):
        """Process messages until ``req_id``'s reply arrives, with deadlines:
        the daemon's loop must keep turning, and while we wait reads must
        complete (before HELLO there is no arena to watch: the process is)."""
        start = time.monotonic()
        beat, beat_at = (None, start) if hello else (self.heartbeat(), start)
        done, done_at = (None, start) if hello else (self.reads_done(), start)
        while req_id not in self._replies:
            self._check()
            events = dict(self._poller.poll(100))
            if self._sock in events:
                self._drain()
                continue
            if self._pidfd is not None and self._pidfd in events:
                self._die("process exited")
            now = time.monotonic()
            if limit is not None and now - start > limit:
                raise IodError("no reply from iod", E.INTERNAL)
            if hello:
                if now - start >= self.timeout and not self._alive():
                    self._die("no reply, and the process or socket is gone")
                if now - start >= 6 * self.timeout:
                    self._die(f"no reply to HELLO within {6 * self.timeout:g} s")
                continue
            b, d = self.heartbeat(), self.reads_done()
            if b != beat:
                beat, beat_at = b, now
            if d != done:
                done, done_at = d, now
            if not self._alive():
                self._die("the process or socket is gone")
            if now - beat_at >= self.timeout:
                self._die(f"its loop stood still for {self.timeout:g} s (stopped or wedged)")
            if now - done_at >= self.progress_timeout:
                self._die(f"it completed no read for {self.progress_timeout:g} s "
                          f"while a demand waited (stuck)")
        return self._replies.pop(req_id)

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
                continue
            if isinstance(msg, P.Shutdown):
                self._dead = DaemonDead(f"iod daemon (pid {self.daemon_pid}) shut down: "
                                        f"{msg.reason}")
                self._shut_down = True
            elif getattr(msg, "req_id", None) in self._awaiting:
                self._replies[msg.req_id] = msg  # anything else: a hint's error, a late reply

    # ---- ExpertSource ----------------------------------------------------------------

    def fetch_into(self, layer, experts, sink) -> None:
        super().fetch_into(layer, experts, lambda batch: self._copy_checked(layer, batch, sink))

    def _copy_checked(self, layer, batch, sink):
        """``sink(batch)``, proven to have read pinned records: our owner word
        before and after the copy (the daemon zeroes it before it takes pins
        back), and no slot's generation changed to another across it (a slot
        evicted and filled again has a new one). Else PinsExpired, and the
        caller forgets what the sink copied."""
        gen0, data0, size = self._slot0
        words = [gen0 + S.SLOT_HEADER_BYTES * ((o - data0) // size) for o in batch.offsets.tolist()]
        load, arena, pins, owner = native.load_u64, self._arena, self._pins_view, self._owner_off
        gens = [load(arena, w) for w in words]
        if load(pins, owner) != self.session_id:
            self._check()
        sink(batch)
        if load(pins, owner) != self.session_id:
            self._check()
        after = [load(arena, w) for w in words]
        if after != gens:
            # 0 for a moment is an eviction that lost to a pin; another
            # generation is a slot filled again (the owner word is the proof)
            moved = [i for i, (g, a) in enumerate(zip(gens, after)) if g and a and g != a]
            if not moved:
                return
            i = moved[0]
            raise PinsExpired(f"layer {layer} expert {batch.experts[i]}: slot "
                              f"{(words[i] - gen0) // S.SLOT_HEADER_BYTES} was filled again while "
                              f"this session copied it")

    def _send_prefetch(self, hints, now):
        self._send(P.Prefetch(self._req(), self.model_id, now, hints))

    def _demand(self, layer, experts):
        reply = self._call(P.Demand(self._req(), self.model_id, layer, experts, self.layer_calls))
        return reply.refs, reply.stamps

    def stats(self) -> dict:
        """The daemon's STATS dict (as ``iod status --json`` prints it)."""
        return self._call(P.Stats(self._req())).stats

    def poll(self) -> None:
        """Process everything that has arrived, without blocking."""
        self._check()
        self._drain()
        self._check()


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


def _map_segment(name, write):
    """A daemon's segment, checked (ours, 0600) on the descriptor we opened."""
    fd = native.shm_open_rw(name) if write else native.shm_open_readonly(name)
    try:
        trust.check_arena_fd(fd, name)
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if write else 0)
        return mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED, prot)
    finally:
        os.close(fd)


def _await_restart(sock: Path, old: int) -> None:
    """Wait, at most RESTART_WAIT_S, for a daemon other than ``old`` to
    listen at ``sock``: one restarted there (``iod restart``)."""
    end = time.monotonic() + RESTART_WAIT_S
    while time.monotonic() < end:
        pid = _lock_pid(sock)
        if pid > 0 and pid != old:
            try:
                if trust.check_daemon(sock):
                    return
            except (trust.Untrusted, OSError):
                return  # (the connect says why)
        time.sleep(0.05)


def _lock_pid(sock: Path) -> int:
    try:
        return lock_holder(paths.lock_path(Path(sock).parent))
    except OSError:
        return 0
