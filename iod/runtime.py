"""The daemon's footprint on the machine: run dir, lock file, stale sweeps,
the arena record, the start settings and the arena's size bounds.

Kept free of heavy imports: ``iod start`` checks the lock with it before it
spawns anything, so a second start is refused quickly. Files are opened
without following symlinks or waiting on FIFOs (``SAFE_OPEN``), and checked
by fstat of what was opened.
"""

import errno
import json
import os
import stat
import sys
from pathlib import Path

from shared import paths
from shared.slots import ARENA_SHARE, MIN_ARENA, arena_limit, arena_size_problem  # noqa: F401  (iod start checks --arena)
from shared.launch import SAFE_OPEN, ensure_run_dir, lock_pid_file, pid_alive, read_pid  # noqa: F401
from shared.trust import Untrusted

START_ARGS = "iod.args"  # beside the lock: the running daemon's `iod start` options
START_ARGS_MAX = 64 << 10


class AlreadyRunning(RuntimeError):
    def __init__(self, pid):
        super().__init__(f"already running (pid {pid})")
        self.pid = pid


def _open_private(path: Path, flags: int) -> int:
    """Open a file of the run dir: created 0600 if missing; an existing one
    must be a regular file of ours with mode 0600 (never chmodded)."""
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | SAFE_OPEN, 0o600)
        made = True
    except FileExistsError:
        try:
            fd = os.open(path, flags | SAFE_OPEN)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise Untrusted(f"{path} is a symlink; iod follows none") from None
            raise
        made = False
    st = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(st.st_mode):
        problem = f"{path} is not a regular file"
    elif st.st_uid != os.getuid():
        problem = f"{path} is owned by uid {st.st_uid}, not by you"
    elif not made and st.st_mode & 0o077:
        problem = f"{path} has mode {stat.S_IMODE(st.st_mode):04o}, not 0600"
    if problem:
        os.close(fd)
        raise Untrusted(problem)
    os.set_blocking(fd, True)
    return fd


def take_lock(lock_file: Path) -> int:
    """flock the lock file and write our pid in it; returns the fd (keep it
    open for the daemon's life). Raises AlreadyRunning naming the holder.
    A SIGKILLed holder's lock is released by the kernel, so it never blocks."""
    try:
        return lock_pid_file(lock_file, lambda: _open_private(lock_file, os.O_RDWR))
    except BlockingIOError:
        raise AlreadyRunning(read_pid(lock_file) or "unknown") from None


def write_arena_record(folder: Path, *names: str) -> None:
    """Name our segments (the arena, its pin table) in ``arena.name``
    (atomically), so a restart or ``iod stop`` can remove them after a
    SIGKILL on any OS."""
    _write_private(paths.arena_record_path(folder), "".join(n + "\n" for n in names).encode())


def _write_private(rec: Path, data: bytes) -> None:
    """A fresh 0600 file beside ``rec``, renamed into place (atomic)."""
    tmp = rec.with_suffix(".tmp")
    try:
        tmp.unlink()  # a leftover (or a planted symlink): never written through
    except FileNotFoundError:
        pass
    fd = _open_private(tmp, os.O_WRONLY)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, rec)


def start_args_path(folder: Path) -> Path:
    return Path(folder) / START_ARGS


def write_start_args(folder: Path, argv: list) -> None:
    """Record the options this daemon was started with (``iod start``'s
    own, as a JSON list), so ``iod restart`` starts the next one alike.
    Written like ``arena.name``: a fresh 0600 file renamed into place."""
    _write_private(start_args_path(folder), json.dumps({"start": [str(a) for a in argv]}).encode())


def read_start_args(folder: Path) -> list:
    """The options ``write_start_args`` recorded. Raises FileNotFoundError
    when there are none, ``Untrusted`` for a file that is not a regular
    0600 file of ours (a symlink is never followed), ValueError when its
    content is not what we write."""
    path = start_args_path(folder)
    try:
        fd = os.open(path, os.O_RDONLY | SAFE_OPEN)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise Untrusted(f"{path} is a symlink; iod follows none") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Untrusted(f"{path} is not a regular file")
        if st.st_uid != os.getuid():
            raise Untrusted(f"{path} is owned by uid {st.st_uid}, not by you")
        if st.st_mode & 0o077:
            raise Untrusted(f"{path} has mode {stat.S_IMODE(st.st_mode):04o}, not 0600")
        data = os.read(fd, START_ARGS_MAX + 1)
    finally:
        os.close(fd)
    try:
        if len(data) > START_ARGS_MAX:
            raise ValueError("too long")
        argv = json.loads(data)["start"]
        if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
            raise ValueError("not a list of options")
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} does not hold start options ({e})") from None
    return argv


def _read_record(rec: Path) -> list:
    """The segment names ``arena.name`` holds (none if it is not a plain file)."""
    try:
        fd = os.open(rec, os.O_RDONLY | SAFE_OPEN)
    except OSError:
        return []
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return []
        return os.read(fd, 256).decode(errors="replace").split()
    finally:
        os.close(fd)


def _segment_owner_ok(name: str) -> bool:
    """Where the segment can be looked at without opening it (Linux
    /dev/shm), only ours may be removed; elsewhere the name came from our
    own 0700 run dir."""
    if not sys.platform.startswith("linux"):
        return True
    try:
        st = os.lstat("/dev/shm" + name)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # no /dev/shm to look at: trust our own record
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid()


def sweep_stale(folder: Path, sock: Path, unlink) -> list:
    """Remove what dead daemons left: the segment named in arena.name (its
    daemon is gone: we hold the lock) and, where /dev/shm is listable,
    our-prefixed segments of ours whose pid is dead; the socket, arena.name
    and the start options. Another user's segment under our prefix is left
    alone and never blocks a start.
    Call only while holding the lock. Returns the names removed."""
    record = paths.arena_record_path(folder)
    candidates = {}  # name -> True when named by our own arena.name
    for recorded in _read_record(record):
        if paths.is_shm_name(recorded):
            candidates[recorded] = True
    if sys.platform.startswith("linux") and os.path.isdir("/dev/shm"):
        prefix = paths.shm_prefix()
        for n in os.listdir("/dev/shm"):
            if n.startswith(prefix) and paths.is_shm_name("/" + n):
                candidates.setdefault("/" + n, False)
    removed = []
    for name, ours in candidates.items():
        pid = paths.shm_pid(name)
        if pid == os.getpid() or (not ours and pid_alive(pid)) or not _segment_owner_ok(name):
            continue
        try:
            if unlink(name):
                removed.append(name)
        except OSError:
            pass  # not ours to remove after all: it cannot block our start
    for p in (record, Path(sock), start_args_path(folder)):
        try:
            p.unlink()
        except FileNotFoundError:
            pass
    return removed
