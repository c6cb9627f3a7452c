"""`iod start | stop | restart | status`: the expert IO daemon's command line."""

import argparse
import contextlib
import io
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

from shared import paths, trust
from shared.launch import lock_holder, spawn

from . import doctor, runtime
from .argtypes import count, number, size

MB_RATE = number("a finite number of MB/s, or 0 for no cap")
SECONDS = number("seconds, 0 or more", finite=False)
PIN_SECONDS = number("seconds, more than 0 (inf: never)", positive=True, finite=False)

KILL_WAIT_S = 5.0  # after SIGKILL: the kernel ends even a stopped process at once
DRAIN_POLL_S = 1.0  # how often `iod stop --drain` asks which sessions are left
MAX_THREADS = 256  # --workers, --hashers: far past any disk's useful queue depth
# descriptors the daemon needs at the least: ~20 of its own (pipes, libzmq's),
# one per MoE layer of each open model, a connection and a pidfd per session
FD_MIN = 64


def _version():
    from importlib import metadata

    try:
        return metadata.version("iod-moe")
    except metadata.PackageNotFoundError:
        return "(not installed)"


class _VersionAction(argparse.Action):
    """--version, looked up only when asked: importlib.metadata costs an
    import of the email package at every parse (and a daemon started in a
    process that cannot import any more modules must not need it)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, **kw):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="show the version and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"iod: iod-moe {_version()}")
        parser.exit()


class _Parser(argparse.ArgumentParser):
    """A bad argument is one line on stderr and exit status 2 (no usage block)."""

    def error(self, message):
        sys.stderr.write(f"{self.prog}: {message}\n")
        sys.exit(2)


def _parser():
    fmt = argparse.ArgumentDefaultsHelpFormatter
    p = _Parser(prog="iod", description="expert IO daemon", formatter_class=fmt)
    p.add_argument("--version", action=_VersionAction)
    sub = p.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("start", help="start the daemon (detached unless --foreground)",
                        formatter_class=fmt)
    st.add_argument("--socket", type=Path, default=paths.socket_path(),
                    help="socket path (lock, arena.name and log live beside it)")
    st.add_argument("--arena", type=size, default="512M",
                    help=f"arena size, e.g. 2G: at least {runtime.MIN_ARENA >> 10} KiB, at most "
                         f"{runtime.ARENA_SHARE * 100:.0f}%% of physical memory and of /dev/shm's "
                         f"free space; committed at start")
    st.add_argument("--slot-size", type=size, default=0,
                    help="slot size (0: the first model's largest record stride)")
    st.add_argument("--workers", type=count(1, MAX_THREADS, "auto"), default=0,
                    help=f"reads in flight for prefetch, at most {MAX_THREADS} (0: the depth `iod doctor` "
                         f"found reaches the disk's ceiling, else 4); demands read beside them, "
                         f"on twice as many reader threads")
    st.add_argument("--hashers", type=count(0, MAX_THREADS), default=2,
                    help=f"checksum threads, at most {MAX_THREADS}, so readers go straight to "
                         f"the next read (0: each reader checks its own reads)")
    st.add_argument("--read-rate", type=MB_RATE, default=0.0,
                    help="MB/s cap on reads: emulates a slower device for benchmarks (0: none)")
    st.add_argument("--max-sessions", type=count(1), default=64, help="sessions at once")
    st.add_argument("--max-connections", type=count(1), default=1024,
                    help="peers connected at once; more are refused at the handshake")
    st.add_argument("--max-queued", type=count(1), default=8192, help="records queued per session")
    st.add_argument("--pin-timeout", type=PIN_SECONDS, default=5.0, metavar="S",
                    help="a session holding more than its share of the arena that says nothing "
                         "for S seconds while another waits for a slot loses its pins (a stopped "
                         "process); it gets PINS_EXPIRED, never wrong bytes")
    st.add_argument("--no-prefault", action="store_true",
                    help="do not map the arena's pages in the background at start (they fault "
                         "in on first use; the memory is committed either way)")
    st.add_argument("--foreground", action="store_true", help="run in this process")
    st.add_argument("--log", type=Path,
                    help="log file of a detached daemon (none given: iod.log beside the socket)")
    st.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    st.add_argument("--parent-fd", type=int, help=argparse.SUPPRESS)
    doctor.add_parser(sub, fmt)
    stop = sub.add_parser("stop", help="stop the daemon: SIGTERM, then SIGKILL after --grace "
                          "(--drain: let its sessions finish first)", formatter_class=fmt)
    restart = sub.add_parser("restart", help="stop the daemon (--drain: after its sessions) "
                             "and start it again with the options it was started with",
                             formatter_class=fmt)
    for sp in (stop, restart):
        sp.add_argument("--socket", type=Path, default=paths.socket_path(), help="socket path")
        sp.add_argument("--drain", nargs="?", type=SECONDS, const=math.inf,
                        default=argparse.SUPPRESS,  # absent: no drain (and no "(default: None)")
                        metavar="S", help="first drain: the daemon takes no new session and "
                        "stops after its last one ends; wait for that (at most S seconds when "
                        "given; Ctrl-C stops waiting), then stop it as without --drain")
        sp.add_argument("--grace", "--timeout", dest="grace", type=SECONDS, default=10.0,
                        help="seconds between SIGTERM and SIGKILL")
    status = sub.add_parser("status", help="the daemon's state (STATS)", formatter_class=fmt)
    status.add_argument("--socket", type=Path, default=paths.socket_path(), help="socket path")
    status.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for a reply")
    status.add_argument("--json", action="store_true",
                        help='print JSON, also when not running ({"running": false, ...})')
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    sock = Path(getattr(args, "socket", None) or paths.socket_path()).absolute()
    if args.cmd == "start":
        problem = runtime.arena_size_problem(args.arena) or fd_limit_problem()
        if problem:  # a usage error: refused before anything is made
            print(f"iod: {problem}", file=sys.stderr)
            return 2
        return start_foreground(args, sock) if args.foreground else start_detached(args, sock)
    if args.cmd == "stop":
        return stop(sock, args.grace, getattr(args, "drain", None))
    if args.cmd == "restart":
        return restart(sock, args.grace, getattr(args, "drain", None))
    if args.cmd == "doctor":
        return doctor.main(args)
    return status(sock, args.timeout, args.json)


def fd_limit_problem():
    """None when the hard descriptor limit leaves the daemon room (it raises
    its soft limit to that, never past it), else one line saying why not."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < FD_MIN:
        return (f"the descriptor limit is {hard} (ulimit -Hn): iod needs at least {FD_MIN} (its "
                f"own files, a blob file per MoE layer, two per session); raise it")
    return None


def _say(fd, line):
    if fd is not None:
        try:
            os.write(fd, (line + "\n").encode())
        except OSError:
            pass


def start_foreground(args, sock: Path) -> int:
    ready_fd = args.ready_fd
    folder = sock.parent
    os.umask(0o077)  # lock, arena.name, socket: owner only
    try:
        runtime.ensure_run_dir(folder)
        lock_fd = runtime.take_lock(paths.lock_path(folder))
    except (runtime.AlreadyRunning, OSError) as e:
        print(f"iod: {e}", file=sys.stderr)
        _say(ready_fd, f"ERROR {e}")
        return 1
    import native
    from .core import Config
    from .shell import Shell

    daemon = None
    try:
        swept = runtime.sweep_stale(folder, sock, native.shm_unlink)
        if swept:
            print(f"iod: removed stale shared memory {', '.join(swept)}", file=sys.stderr)
        from shared import disk

        cfg = Config(arena_size=args.arena, slot_size=args.slot_size,
                     workers=args.workers if args.workers > 0 else disk.workers(),
                     max_sessions=args.max_sessions,
                     max_queued=args.max_queued, pin_timeout_s=args.pin_timeout)
        daemon = Shell(cfg, sock, hashers=max(args.hashers, 0), read_rate=args.read_rate * 1e6,
                       faults=os.environ.get("IOD_FAULTS", ""), prefault=not args.no_prefault,
                       parent_fd=args.parent_fd, max_connections=args.max_connections)
        daemon.open()
    except Exception as e:
        print(f"iod: cannot start: {e}", file=sys.stderr)
        _say(ready_fd, f"ERROR cannot start: {e}")
        if daemon is not None and hasattr(daemon, "arena"):
            daemon.arena.close(unlink=True)
        paths.arena_record_path(folder).unlink(missing_ok=True)
        _release_lock(folder, lock_fd)
        return 1
    try:  # for `iod restart`; a daemon that cannot record them still serves
        runtime.write_start_args(folder, start_options(args))
    except OSError as e:
        print(f"iod: cannot record the start options: {e}", file=sys.stderr)
    print(f"iod: ready (pid {os.getpid()}, socket {sock}, arena {daemon.shm_name} "
          f"{args.arena >> 20} MiB, {cfg.workers} workers, {cfg.readers} reader threads)", file=sys.stderr, flush=True)
    _say(ready_fd, f"READY {os.getpid()}")
    if ready_fd is not None:
        os.close(ready_fd)
    try:
        daemon.serve()
    finally:
        runtime.start_args_path(folder).unlink(missing_ok=True)
        _release_lock(folder, lock_fd)
    print("iod: stopped", file=sys.stderr, flush=True)
    return 0


def _release_lock(folder, fd):
    try:
        os.unlink(paths.lock_path(folder))
    except FileNotFoundError:
        pass
    os.close(fd)


def start_detached(args, sock: Path) -> int:
    folder = sock.parent
    lock = paths.lock_path(folder)
    try:
        runtime.ensure_run_dir(folder)
        if os.path.lexists(lock):
            trust.check_lock(lock)
        pid = lock_holder(lock)
    except OSError as e:
        print(f"iod: {e}", file=sys.stderr)
        return 1
    if pid:
        print(f"iod: already running (pid {pid})", file=sys.stderr)
        return 1
    try:
        _, pid = spawn(sock, start_options(args), log=args.log or folder / "iod.log")
    except RuntimeError as e:
        print(f"iod: {e}", file=sys.stderr)
        return 1
    print(f"iod started (pid {pid}, socket {sock})")
    return 0


def start_options(args) -> list:
    """The `iod start` options of a daemon, as a detached start passes them
    to its child and as the child records them for `iod restart`."""
    opts = ["--arena", str(args.arena), "--workers", str(args.workers),
            "--hashers", str(args.hashers),
            "--read-rate", str(args.read_rate), "--max-sessions", str(args.max_sessions),
            "--max-connections", str(args.max_connections),
            "--max-queued", str(args.max_queued), "--pin-timeout", str(args.pin_timeout)]
    if args.slot_size:
        opts += ["--slot-size", str(args.slot_size)]
    if args.no_prefault:
        opts.append("--no-prefault")
    if args.log:
        opts += ["--log", str(Path(args.log).absolute())]
    return opts


def _running_pid(sock: Path) -> int:
    """The pid holding the daemon's lock; 0 after saying why there is none
    to signal. Only a lock in a run dir of ours names a pid we may signal."""
    folder = sock.parent
    lock = paths.lock_path(folder)
    try:
        trust.check_run_dir(folder)
        if os.path.lexists(lock):
            trust.check_lock(lock)
        pid = lock_holder(lock)
    except FileNotFoundError:
        pid = 0
    except OSError as e:
        print(f"iod: {e}", file=sys.stderr)
        return 0
    if not pid:
        print("iod is not running", file=sys.stderr)
        return 0
    if pid < 0:
        print("iod: the lock is held but names no pid", file=sys.stderr)
        return 0
    return pid


def stop(sock: Path, grace: float, drain=None) -> int:
    """SIGTERM (and SIGCONT, so a stopped daemon handles it), SIGKILL after
    ``grace`` seconds, then remove what a killed daemon leaves: bounded
    whatever the daemon is doing. With ``drain`` (seconds, inf for no
    bound): first SIGUSR1 and wait for the daemon to end its sessions and
    exit; only past ``drain`` seconds the stop above."""
    folder = sock.parent
    lock = paths.lock_path(folder)
    pid = _running_pid(sock)
    if not pid:
        # a SIGKILLed daemon left its arena, socket and records: remove them now
        try:
            trust.check_run_dir(folder)
        except OSError:
            return 1  # said by _running_pid; not a folder to clean
        swept = _sweep_after(folder, sock)
        if swept:
            print(f"iod: removed what a killed daemon left: {', '.join(swept)}", file=sys.stderr)
        return 1
    if drain is not None:
        _signal(pid, signal.SIGUSR1)  # no new sessions; the daemon exits after its last one
        _signal(pid, signal.SIGCONT)
        try:
            left = _wait_drained(sock, lock, pid, drain)
        except KeyboardInterrupt:
            print(f"\niod: stopped waiting; pid {pid} keeps draining and exits after its last "
                  f"session", file=sys.stderr)
            return 130
        if left is None:
            swept = _sweep_after(folder, sock)
            print(f"iod drained and stopped (pid {pid})"
                  + (f"; removed {', '.join(swept)}" if swept else ""))
            return 0
        print(f"iod: pid {pid} still has {_count(left, 'session')} after {drain:g} s of "
              f"draining; stopping it", file=sys.stderr)
    how = "stopped"
    _signal(pid, signal.SIGTERM)
    _signal(pid, signal.SIGCONT)
    if not _wait_unlocked(lock, pid, grace):
        print(f"iod: pid {pid} did not stop within {grace:g} s; sending SIGKILL", file=sys.stderr)
        _signal(pid, signal.SIGKILL)
        how = "killed"
        if not _wait_unlocked(lock, pid, KILL_WAIT_S):
            print(f"iod: pid {pid} still holds the lock {KILL_WAIT_S:g} s after SIGKILL",
                  file=sys.stderr)
            return 1
    swept = _sweep_after(folder, sock)
    print(f"iod {how} (pid {pid})" + (f"; removed {', '.join(swept)}" if swept else ""))
    return 0


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def _wait_drained(sock: Path, lock: Path, pid: int, limit: float):
    """Until the draining daemon exits (None), or ``limit`` seconds pass
    (the number of sessions it still has). Says on stderr which sessions
    it waits for, again whenever that changes."""
    deadline = time.monotonic() + limit
    shown = None
    next_ask = 0.0
    left = 0
    while lock_holder(lock) == pid:
        now = time.monotonic()
        if now >= next_ask:
            next_ask = now + DRAIN_POLL_S
            sessions = _sessions(sock)
            if sessions is not None:
                left = len(sessions)
                if sessions != shown:
                    shown = sessions
                    what = ", ".join(sessions) or "reads in flight"
                    print(f"iod: draining pid {pid}: waiting for {_count(left, 'session')} "
                          f"({what})" if sessions else f"iod: draining pid {pid}: no session "
                          f"left, finishing {what}", file=sys.stderr, flush=True)
        if now > deadline:
            return left
        time.sleep(0.05)
    return None


def _sessions(sock: Path):
    """["pid P: model dir", ...] of the daemon's sessions, None when it does not answer."""
    from shared import protocol as P

    try:
        reply = request(sock, P.Stats(1), 2.0)
    except Exception:
        return None
    if not isinstance(reply, P.StatsOk):
        return None
    st = reply.stats
    dirs = {m["id"]: m["dir"] for m in st.get("models", [])}
    return [f"pid {s['pid']}: {dirs.get(s['model'], '?')}" for s in st.get("sessions", [])]


def restart(sock: Path, grace: float, drain=None) -> int:
    """Stop the daemon (``drain``: as `iod stop --drain`), then start it
    detached with the options it recorded at its start (``iod.args``)."""
    pid = _running_pid(sock)
    if not pid:
        return 1
    path = runtime.start_args_path(sock.parent)
    try:
        opts = runtime.read_start_args(sock.parent)
    except FileNotFoundError:
        print(f"iod: pid {pid} recorded no start options ({path}); stop it and start it with "
              f"`iod start`", file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:
        print(f"iod: {e}", file=sys.stderr)
        return 1
    argv = ["start", "--socket", str(sock), *opts]
    err = io.StringIO()
    try:  # checked before the daemon is stopped: a bad record stops nothing
        with contextlib.redirect_stderr(err):
            _parser().parse_args(argv)
    except SystemExit:
        why = err.getvalue().strip().splitlines()[-1:] or ["?"]
        print(f"iod: {path} holds options `iod start` refuses: {why[0]}", file=sys.stderr)
        return 1
    rc = stop(sock, grace, drain)
    if rc != 0:
        return rc
    return main(argv)


def _signal(pid: int, sig) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _wait_unlocked(lock: Path, pid: int, timeout: float) -> bool:
    """Until the daemon's lock is free (released as it exits, even by SIGKILL)."""
    deadline = time.monotonic() + timeout
    while lock_holder(lock) == pid:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _sweep_after(folder: Path, sock: Path) -> list:
    """Holding the lock ourselves: remove the segment in arena.name, the
    socket and arena.name, then the lock. A graceful stop left nothing;
    a SIGKILL left them all. Nothing if a new daemon took the lock first."""
    import native

    try:
        fd = runtime.take_lock(paths.lock_path(folder))
    except (runtime.AlreadyRunning, OSError):
        return []
    try:
        return runtime.sweep_stale(folder, sock, native.shm_unlink)
    finally:
        _release_lock(folder, fd)


def request(sock: Path, msg, timeout: float):
    """One request/reply round trip without a session (STATS)."""
    import zmq

    from shared import codec

    # the process-wide context, never terminated here: a Ctrl-C that lands in
    # a private context's term() can leave it for the interpreter's exit to
    # wait on (suspected in a drain test that hung once under load)
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    try:
        s.connect(paths.endpoint(sock))
        s.send_multipart(codec.encode(msg))
        if not s.poll(int(timeout * 1000)):
            raise TimeoutError(f"no reply from iod at {sock} within {timeout:g} s")
        return codec.decode(s.recv_multipart())
    finally:
        s.close()


def status(sock: Path, timeout: float, as_json: bool) -> int:
    """STATS of the daemon; with ``as_json`` a JSON object in every state
    (``running`` false, or true with ``error`` when it does not answer)."""
    from shared import protocol as P

    def fail(msg, pid=0):
        if as_json:
            print(json.dumps({"running": pid > 0, "pid": pid if pid > 0 else None,
                              "socket": str(sock), "error": msg}, sort_keys=True))
        print("iod is not running" if msg == "not running" else f"iod: {msg}", file=sys.stderr)
        return 1

    pid = 0
    try:
        pid = lock_holder(paths.lock_path(sock.parent))
        if not pid:
            return fail("not running")
        if not trust.check_daemon(sock):
            return fail(f"not answering: nothing listens on {sock}", pid)
    except OSError as e:
        return fail(str(e), pid)
    try:
        reply = request(sock, P.Stats(1), timeout)
    except Exception as e:
        return fail(str(e), pid)
    if not isinstance(reply, P.StatsOk):
        return fail(f"unexpected reply {reply}", pid)
    st = reply.stats
    if as_json:
        print(json.dumps({"running": True, **st}, indent=1, sort_keys=True))
        return 0
    print(format_status(st))
    return 0


def format_status(st: dict) -> str:
    c, a = st["counters"], st["arena"]
    lines = [
        f"iod pid {st['pid']}  up {st['uptime_s']:.0f} s  socket {st['socket']}"
        + ("  draining" if st.get("draining") else ""),
        f"arena {a['name']}  {a['bytes'] >> 20} MiB  {a['slot_count']} slots of {a['slot_size']} B  "
        + "  ".join(f"{k} {v}" for k, v in a["slots"].items()),
        f"demands {c['demands']}  prefetch hints {c['prefetches']}  reads {c['reads']} "
        f"(prefetch {c['prefetch_reads']}, unused {c['prefetched_unused']})  "
        f"coalesced {c['coalesced']}  "
        f"bytes read {c['bytes_read'] / 1e6:.1f} MB  read {st['read_MBps']:.0f} MB/s while busy  "
        f"errors io {c['read_errors']} checksum {c['checksum_errors']}",
        "models:",
    ]
    for m in st["models"]:
        lines.append(f"  #{m['id']} {m['dir']}  {m['layers']} layers  {m['read_mode']}  "
                     f"{m['sessions']} sessions")
    lines.append("sessions:")
    for s in st["sessions"]:
        lines.append(f"  #{s['id']} pid {s['pid']} model {s['model']}  pins {s['pins']}  "
                     f"awaiting {s['awaiting']}  demands {s['demands']}  ready at demand "
                     f"{s['hits']}  read {s['misses']}  {s['bytes'] / 1e6:.1f} MB granted")
    lines.append("latency (us):      n      p50      p90      p99")
    for k, v in st["latency_us"].items():
        lines.append(f"  {k:12s} {v['n']:8d} {v['p50']:8.0f} {v['p90']:8.0f} {v['p99']:8.0f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
