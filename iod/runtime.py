"""The daemon's footprint on the machine: run dir, lock file, stale sweeps.

Kept free of heavy imports: ``iod start`` checks the lock with it before it
spawns anything, so a second start is refused quickly.
"""

import errno
import fcntl
import os
import sys
from pathlib import Path

from shared import paths
from shared.launch import ensure_run_dir, pid_alive, read_pid  # noqa: F401


class AlreadyRunning(RuntimeError):
    def __init__(self, pid):
        super().__init__(f"already running (pid {pid})")
        self.pid = pid


def take_lock(lock_file: Path) -> int:
    """flock the lock file and write our pid in it; returns the fd (keep it
    open for the daemon's life). Raises AlreadyRunning naming the holder.
    A SIGKILLed holder's lock is released by the kernel, so it never blocks."""
    while True:
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise AlreadyRunning(read_pid(lock_file) or "unknown") from None
            raise
        # a stopping daemon may have unlinked the file we locked: lock the new one
        try:
            same = os.stat(lock_file).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    os.fchmod(fd, 0o600)
    return fd


def sweep_stale(folder: Path, sock: Path, unlink) -> list:
    """Remove what dead daemons left: the segment named in arena.name and,
    where /dev/shm is listable, our-prefixed segments of dead pids; the socket.
    Call only while holding the lock. Returns the names removed."""
    removed = []
    record = paths.arena_record_path(folder)
    names = []
    try:
        names.append(record.read_text().strip())
    except OSError:
        pass
    if sys.platform.startswith("linux") and os.path.isdir("/dev/shm"):
        prefix = paths.shm_prefix()
        names += ["/" + n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
    for name in dict.fromkeys(filter(None, names)):
        parts = name.lstrip("/").split(".")
        try:
            pid = int(parts[2])
        except (IndexError, ValueError):
            continue
        if pid != os.getpid() and not pid_alive(pid):
            if unlink(name):
                removed.append(name)
    for p in (record, Path(sock)):
        try:
            p.unlink()
        except FileNotFoundError:
            pass
    return removed
