"""The daemon process around the core: ZeroMQ, the peer check, signals,
liveness and lifetime.

One thread owns every decision: it waits in one ``zmq.Poller`` on the
ROUTER socket, the reader pool's completion pipe, a signal pipe, the ZAP
handler, the socket monitor, each session's pidfd (Linux) and the parent's
pipe (private daemons), hands what arrives to ``iod.core.Core`` and sends
what the core queued. The loop turns at least every ``LOOP_TICK_S``, and each
turn bumps the arena's heartbeat word, which waiting sessions watch.
"""

import os
import resource
import signal
import sys
import time
from pathlib import Path

import zmq
from zmq.utils.monitor import recv_monitor_message

from shared import codec, paths
from shared import slots as S
from shared.launch import pid_alive

from . import arena as arena_mod
from . import reader as reader_mod
from . import runtime
from .core import Config, Core

MAX_CONNECTIONS = 1024  # peers connected at once; more are refused at the handshake
STOP_READS_S = 10.0  # a stop waits this long for the reads in flight
# Replies in flight to one peer, then dropped for it: the bound on the memory
# a peer that does not read costs. Replies also pass through here in bursts
# before libzmq's I/O thread moves them on, so a peer that pipelines requests
# (one loop turn answers them all) must fit too: a session has a call or two
# in flight; the hostile-input check pipelines 33 (16 lost some, measured).
REPLY_HWM = 64
REQUEST_HWM = 1024  # requests queued for us per peer (we read every loop turn)
FD_LIMIT_MAX = 1 << 20  # the descriptor limit we raise to, when the hard limit allows
FD_RESERVE_MIN = 64  # descriptors kept beside the connections: blobs, pidfds, pipes, libzmq's


class Shell:
    def __init__(self, cfg: Config, socket: Path, hashers=2, read_rate=0.0, faults="",
                 prefault=True, liveness_s=0.25, parent_fd=None,
                 max_connections=MAX_CONNECTIONS):
        self.cfg = cfg
        self.socket = Path(socket)
        self.folder = self.socket.parent
        self.hashers = hashers
        self.read_rate = read_rate
        self.faults = reader_mod.Faults(faults)
        self.prefault = prefault
        self.liveness_s = liveness_s  # pid poll period where pidfd is unavailable
        self.parent_fd = parent_fd
        self.max_connections = max_connections
        self.connections = 0
        self.stopping = None
        self.pidfds = {}  # session id -> pidfd
        self.by_pidfd = {}  # pidfd -> session id

    def open(self):
        """Create the arena, the reader pool and bind the socket (lock held)."""
        cfg = self.cfg
        # every connection costs a descriptor, and libzmq aborts (an assert in
        # ipc_listener.cpp) when accept() meets EMFILE: take a high limit and
        # keep the connection cap a quarter below it
        fd_limit = _raise_fd_limit()
        cap = min(self.max_connections, fd_limit - max(fd_limit // 4, FD_RESERVE_MIN))
        if cap < self.max_connections:
            print(f"iod: --max-connections {self.max_connections} lowered to {max(cap, 1)}: "
                  f"the descriptor limit is {fd_limit}", file=sys.stderr, flush=True)
            self.max_connections = max(cap, 1)
        self.arena = arena_mod.Arena(None, cfg.arena_size, self.prefault)  # fresh names
        self.shm_name = self.arena.name
        runtime.write_arena_record(self.folder, self.arena.name, self.arena.pins_name)
        if cfg.slot_size:
            self.arena.layout(cfg.slot_size, cfg.max_sessions)
        self.wake_r, self.wake_w = os.pipe()
        self.sig_r, self.sig_w = os.pipe()
        for fd in (self.wake_r, self.wake_w, self.sig_r, self.sig_w):
            os.set_blocking(fd, False)
        self.pool = reader_mod.ReaderPool(cfg.readers, self.wake_w, self.read_rate, self.faults,
                                          self.hashers)
        self.core = Core(cfg, self.arena, self.pool, self.faults)
        self.core.info = {"socket": str(self.socket), "read_rate_limit_MBps": self.read_rate / 1e6,
                          "max_connections": self.max_connections}
        self.ctx = zmq.Context(1)
        # peer check: libzmq asks this ZAP handler about every new connection
        # before any of its messages pass (ipc peers come with uid and pid)
        self.zap = self.ctx.socket(zmq.REP)
        self.zap.setsockopt(zmq.LINGER, 0)
        self.zap.bind("inproc://zeromq.zap.01")
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ZAP_DOMAIN, b"iod")
        self.sock.setsockopt(zmq.MAXMSGSIZE, codec.MAX_MESSAGE_BYTES * 2)
        # bounded per peer: a session that stops reading loses replies, not our memory
        self.sock.setsockopt(zmq.SNDHWM, REPLY_HWM)
        self.sock.setsockopt(zmq.RCVHWM, REQUEST_HWM)
        self.sock.setsockopt(zmq.LINGER, 500)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        old = os.umask(0o077)
        try:
            self.sock.bind(paths.endpoint(self.socket))
        finally:
            os.umask(old)
        os.chmod(self.socket, 0o600)
        self.poller = zmq.Poller()
        for s in (self.sock, self.wake_r, self.sig_r, self.zap, self.monitor):
            self.poller.register(s, zmq.POLLIN)
        if self.parent_fd is not None:
            self.poller.register(self.parent_fd, zmq.POLLIN)
        for s in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(s, self._on_signal)
        if self.parent_fd is not None:
            # a private daemon follows its parent, through the pipe: a terminal's
            # Ctrl-C or hang-up reaches the whole group, and a daemon that left
            # first made its parent report "daemon went away" instead of the signal
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
        else:
            signal.signal(signal.SIGINT, self._on_signal)
            if signal.getsignal(signal.SIGHUP) is signal.SIG_DFL:  # not under nohup
                signal.signal(signal.SIGHUP, self._on_signal)  # its terminal closed: stop cleanly
        signal.signal(signal.SIGPIPE, signal.SIG_IGN) if hasattr(signal, "SIGPIPE") else None

    def _on_signal(self, signum, frame):
        if signum == signal.SIGUSR1:  # drain: finish the sessions, take no new ones
            self.core.draining = True
        else:
            self.stopping = self.stopping or f"signal {signal.Signals(signum).name}"
        try:
            os.write(self.sig_w, b"s")
        except OSError:
            pass

    def serve(self):
        core = self.core
        last_check = time.monotonic()
        while not self.stopping:
            timeout = 5 if core.blocked else int(S.LOOP_TICK_S * 1000)
            events = dict(self.poller.poll(timeout))
            if self.sock in events:
                self._drain_socket()
            if self.wake_r in events:
                self._drain_completions()
            if self.sig_r in events:
                _drain_fd(self.sig_r)
            if self.zap in events:
                self._drain_zap()
            if self.monitor in events:
                self._drain_monitor()
            if self.parent_fd is not None and self.parent_fd in events:
                if not os.read(self.parent_fd, 4096):
                    self.stopping = "parent exited"
            for fd in [fd for fd in events if fd in self.by_pidfd]:
                self._end(self.by_pidfd[fd], "process exited")
            now = time.monotonic()
            if now - last_check >= self.liveness_s:
                last_check = now
                for s in list(core.sessions.values()):
                    if s.id not in self.pidfds and not pid_alive(s.pid):
                        self._end(s.id, "process exited")
            core.pump()
            core.tick()
            self._flush()
            if core.draining and not core.sessions and not core.inflight:
                self.stopping = "drained"
        self.shutdown(self.stopping)

    def _end(self, sid, why):
        s = self.core.sessions.get(sid)
        if s is not None:
            self.core.end_session(s, why)
        self._unwatch(sid)

    def _watch_sessions(self):
        """pidfds for new sessions, so a dead process ends its lease at once."""
        for s in self.core.sessions.values():
            if s.id not in self.pidfds and hasattr(os, "pidfd_open"):
                try:
                    fd = os.pidfd_open(s.pid)
                except OSError:
                    continue  # polled by pid instead
                self.pidfds[s.id] = fd
                self.by_pidfd[fd] = s.id
                self.poller.register(fd, zmq.POLLIN)
        for sid in [sid for sid in self.pidfds if sid not in self.core.sessions]:
            self._unwatch(sid)

    def _unwatch(self, sid):
        fd = self.pidfds.pop(sid, None)
        if fd is not None:
            self.poller.unregister(fd)
            self.by_pidfd.pop(fd, None)
            os.close(fd)

    def _drain_zap(self):
        """Admit or refuse new connections: another uid's, or any beyond the
        connection cap, is refused before any of its messages pass; admitted
        ones carry their pid as User-Id."""
        while True:
            try:
                req = self.zap.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            # libzmq queues a connection's ACCEPTED event before its ZAP
            # request: counting them first, the count includes this one and
            # every connection before it (admitted or still in its handshake)
            self._drain_monitor()
            cred = _zap_peer(req[3] if len(req) > 3 else b"")
            rid = req[1] if len(req) > 1 else b""
            if cred is not None and cred[0] != os.getuid():
                self.core.c["refused_peers"] += 1
                print(f"iod: refused a connection from uid {cred[0]} (pid {cred[2]})",
                      file=sys.stderr, flush=True)
                self.zap.send_multipart([b"1.0", rid, b"400", b"another user", b"", b""])
            elif self.connections > self.max_connections:
                self.core.c["refused_peers"] += 1
                self.zap.send_multipart([b"1.0", rid, b"400", b"too many connections", b"", b""])
            else:
                user = str(cred[2]).encode() if cred is not None else b""
                self.zap.send_multipart([b"1.0", rid, b"200", b"OK", user, b""])

    def _drain_monitor(self):
        while True:
            try:
                ev = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if ev["event"] == zmq.EVENT_ACCEPTED:
                self.connections += 1
            elif ev["event"] == zmq.EVENT_DISCONNECTED:
                self.connections = max(self.connections - 1, 0)

    def _drain_socket(self):
        for _ in range(1000):  # bounded, so completions are not starved
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            received = time.monotonic_ns()
            try:  # set by _drain_zap when the connection was admitted
                peer_pid = int(frames[-1].get("User-Id") or 0)
            except (zmq.ZMQError, ValueError):
                peer_pid = 0
            self.core.receive(frames[0].bytes, [f.bytes for f in frames[1:]], peer_pid, received)
        self._watch_sessions()

    def _drain_completions(self):
        _drain_fd(self.wake_r)
        while True:
            try:
                job = self.pool.done.get_nowait()
            except Exception:
                return
            self.core.completed(job)

    def _flush(self):
        out, self.core.outbox = self.core.outbox, []
        for ident, msg in out:
            try:
                self.sock.send_multipart([ident] + codec.encode(msg), zmq.NOBLOCK)
            except zmq.Again:
                pass  # the peer does not read; ROUTER drops for it

    def shutdown(self, reason):
        """Reads handed to the pool finish, sessions are told, shm and socket go."""
        reason = reason or "stop"
        self.core.stopping = reason
        if not self.pool.stop(timeout=STOP_READS_S):  # the threads are daemons: exit goes on
            print(f"iod: reads still in flight after {STOP_READS_S:g} s; stopping anyway",
                  file=sys.stderr, flush=True)
        while self.core.inflight:
            try:
                job = self.pool.done.get_nowait()
            except Exception:
                break
            self.core.completed(job)
        self.core.shutdown(reason)
        self._flush()
        for sid in list(self.pidfds):
            self._unwatch(sid)
        try:
            self.sock.disable_monitor()
            self.monitor.close(linger=0)
            self.sock.close(linger=500)
            self.zap.close(linger=0)
            self.ctx.term()
        except zmq.ZMQError as e:  # still remove what we own below
            print(f"iod: closing the socket: {e}", file=sys.stderr, flush=True)
        self.arena.close(unlink=True)
        for p in (paths.arena_record_path(self.folder), self.socket):
            try:
                p.unlink()
            except FileNotFoundError:
                pass


def _raise_fd_limit() -> int:
    """Connections cost a descriptor each: raise the soft limit to the hard
    one (at most FD_LIMIT_MAX); returns the limit now in force. macOS refuses
    more than OPEN_MAX (10240) whatever the hard limit says: then that."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = FD_LIMIT_MAX if hard == resource.RLIM_INFINITY else min(hard, FD_LIMIT_MAX)
    for want in (top, min(top, 10240)):
        if soft >= want:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            return want
        except (ValueError, OSError):
            continue
    return soft


def _drain_fd(fd):
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


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
