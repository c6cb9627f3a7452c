"""`iod start | stop | status`: the expert IO daemon's command line."""

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from shared import paths
from shared.launch import lock_holder, spawn

from . import runtime

SUFFIXES = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """ "2G", "512M", "64k", "1048576" -> bytes."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = SUFFIXES.get(t[-1:], 1)
    try:
        n = float(t[:-1] if t[-1:] in SUFFIXES else t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return int(n * mult)


def _version():
    from importlib import metadata

    try:
        return metadata.version("iod-moe")
    except metadata.PackageNotFoundError:
        return "(not installed)"


def _parser():
    p = argparse.ArgumentParser(prog="iod", description="expert IO daemon")
    p.add_argument("--version", action="version", version=f"iod: iod-moe {_version()}")
    sub = p.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("start", help="start the daemon (detached unless --foreground)")
    st.add_argument("--socket", type=Path, help="socket path (lock and arena.name live beside it)")
    st.add_argument("--arena", type=parse_size, default=parse_size("512M"), help="arena size, e.g. 2G")
    st.add_argument("--slot-size", type=parse_size, default=0,
                    help="slot size (default: the first model's largest record stride)")
    st.add_argument("--workers", type=int, default=4, help="reader threads")
    st.add_argument("--hashers", type=int, default=2,
                    help="checksum threads, so readers go straight to the next read "
                         "(0: each reader checks its own reads)")
    st.add_argument("--read-rate", type=float, default=0.0,
                    help="MB/s cap on reads: emulates a slower device for benchmarks")
    st.add_argument("--max-sessions", type=int, default=64)
    st.add_argument("--max-pins", type=int, default=4096, help="per session")
    st.add_argument("--max-queued", type=int, default=8192, help="records queued per session")
    st.add_argument("--no-prefault", action="store_true",
                    help="do not commit the arena's memory at start (pages fault in on first use)")
    st.add_argument("--foreground", action="store_true", help="run in this process")
    st.add_argument("--log", type=Path, help="log file of a detached daemon (default: run dir/iod.log)")
    st.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    st.add_argument("--parent-fd", type=int, help=argparse.SUPPRESS)
    for name in ("stop", "status"):
        c = sub.add_parser(name)
        c.add_argument("--socket", type=Path)
        c.add_argument("--timeout", type=float, default=30.0 if name == "stop" else 5.0)
        if name == "status":
            c.add_argument("--json", action="store_true")
    return p


def _socket(args) -> Path:
    return Path(args.socket).absolute() if args.socket else paths.socket_path()


def main(argv=None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    sock = _socket(args)
    if args.cmd == "start":
        return start_foreground(args, sock) if args.foreground else start_detached(args, sock)
    if args.cmd == "stop":
        return stop(sock, args.timeout)
    return status(sock, args.timeout, args.json)


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
    from .server import Config, Daemon

    daemon = None
    try:
        swept = runtime.sweep_stale(folder, sock, native.shm_unlink)
        if swept:
            print(f"iod: removed stale shared memory {', '.join(swept)}", file=sys.stderr)
        cfg = Config(socket=sock, arena_size=args.arena, slot_size=args.slot_size,
                     workers=max(args.workers, 1), hashers=max(args.hashers, 0),
                     read_rate=args.read_rate * 1e6,
                     max_sessions=args.max_sessions, max_pins=args.max_pins,
                     max_queued=args.max_queued, faults=os.environ.get("IOD_FAULTS", ""),
                     prefault=not args.no_prefault)
        daemon = Daemon(cfg, parent_fd=args.parent_fd)
        daemon.open()
    except Exception as e:
        print(f"iod: cannot start: {e}", file=sys.stderr)
        _say(ready_fd, f"ERROR cannot start: {e}")
        if daemon is not None and hasattr(daemon, "arena"):
            daemon.arena.close(unlink=True)
        _release_lock(folder, lock_fd)
        return 1
    print(f"iod: ready (pid {os.getpid()}, socket {sock}, arena {daemon.shm_name} "
          f"{args.arena >> 20} MiB, {cfg.workers} workers)", file=sys.stderr, flush=True)
    _say(ready_fd, f"READY {os.getpid()}")
    if ready_fd is not None:
        os.close(ready_fd)
    try:
        daemon.serve()
    finally:
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
    try:
        runtime.ensure_run_dir(folder)
        pid = lock_holder(paths.lock_path(folder))
    except OSError as e:
        print(f"iod: {e}", file=sys.stderr)
        return 1
    if pid:
        print(f"iod: already running (pid {pid})", file=sys.stderr)
        return 1
    extra = ["--arena", str(args.arena), "--workers", str(args.workers),
             "--hashers", str(args.hashers),
             "--read-rate", str(args.read_rate), "--max-sessions", str(args.max_sessions),
             "--max-pins", str(args.max_pins), "--max-queued", str(args.max_queued)]
    if args.slot_size:
        extra += ["--slot-size", str(args.slot_size)]
    if args.no_prefault:
        extra.append("--no-prefault")
    try:
        _, pid = spawn(sock, extra, log=args.log or folder / "iod.log")
    except RuntimeError as e:
        print(f"iod: {e}", file=sys.stderr)
        return 1
    print(f"iod started (pid {pid}, socket {sock})")
    return 0


def stop(sock: Path, timeout: float) -> int:
    lock = paths.lock_path(sock.parent)
    pid = lock_holder(lock)
    if not pid:
        print("iod is not running", file=sys.stderr)
        return 1
    if pid < 0:
        print("iod: the lock is held but names no pid", file=sys.stderr)
        return 1
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while lock_holder(lock) == pid:  # released as the daemon exits
        if time.monotonic() > deadline:
            print(f"iod: pid {pid} did not stop within {timeout:g} s", file=sys.stderr)
            return 1
        time.sleep(0.02)
    print(f"iod stopped (pid {pid})")
    return 0


def request(sock: Path, msg, timeout: float):
    """One request/reply round trip without a session (STATS)."""
    import zmq

    from shared import codec

    ctx = zmq.Context(1)
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    try:
        s.connect(paths.endpoint(sock))
        s.send_multipart(codec.encode(msg))
        if not s.poll(int(timeout * 1000)):
            raise TimeoutError(f"no reply from iod at {sock} within {timeout:g} s")
        return codec.decode(s.recv_multipart())
    finally:
        s.close()
        ctx.term()


def status(sock: Path, timeout: float, as_json: bool) -> int:
    from shared import protocol as P

    if not lock_holder(paths.lock_path(sock.parent)):
        print("iod is not running", file=sys.stderr)
        return 1
    try:
        reply = request(sock, P.Stats(1), timeout)
    except Exception as e:
        print(f"iod: {e}", file=sys.stderr)
        return 1
    if not isinstance(reply, P.StatsOk):
        print(f"iod: unexpected reply {reply}", file=sys.stderr)
        return 1
    st = reply.stats
    if as_json:
        print(json.dumps(st, indent=1, sort_keys=True))
        return 0
    print(format_status(st))
    return 0


def format_status(st: dict) -> str:
    c, a = st["counters"], st["arena"]
    lines = [
        f"iod pid {st['pid']}  up {st['uptime_s']:.0f} s  socket {st['socket']}",
        f"arena {a['name']}  {a['bytes'] >> 20} MiB  {a['slot_count']} slots of {a['slot_size']} B  "
        + "  ".join(f"{k} {v}" for k, v in a["slots"].items()),
        f"hits {c['hits']}  misses {c['misses']}  reads {c['reads']}  coalesced {c['coalesced']}  "
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
                     f"queued {s['queued']}  requests {s['requests']}  hits {s['hits']}  "
                     f"misses {s['misses']}  {s['bytes'] / 1e6:.1f} MB")
    lines.append("latency (us):      n      p50      p90      p99")
    for k, v in st["latency_us"].items():
        lines.append(f"  {k:12s} {v['n']:8d} {v['p50']:8.0f} {v['p90']:8.0f} {v['p99']:8.0f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
