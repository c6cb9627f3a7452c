"""The daemon's footprint on the machine: run dir, lock file, stale sweeps.

Kept free of heavy imports: ``iod start`` checks the lock with it before it
spawns anything, so a second start is refused quickly.
"""

import errno
import fcntl
import os
import stat
import sys
from pathlib import Path

from shared import paths


class AlreadyRunning(RuntimeError):
    def __init__(self, pid):
        super().__init__(f"already running (pid {pid})")
        self.pid = pid


def ensure_run_dir(folder: Path) -> Path:
    """Create the run dir with mode 0700; refuse one owned by someone else."""
    folder = Path(folder)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = folder.stat()
    if st.st_uid != os.getuid():
        raise PermissionError(f"run dir {folder} belongs to uid {st.st_uid}, not {os.getuid()}")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(folder, 0o700)
    return folder


def read_pid(lock_file: Path) -> int:
    try:
        return int(Path(lock_file).read_text().strip() or 0)
    except (OSError, ValueError):
        return 0


def lock_holder(lock_file: Path) -> int:
    """The pid of the daemon holding the lock, or 0 when nobody holds it."""
    try:
        fd = os.open(lock_file, os.O_RDONLY)
    except FileNotFoundError:
        return 0
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return read_pid(lock_file) or -1
        raise
    finally:
        os.close(fd)
    return 0


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


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # no such process, or no such pid at all
        return False
    except PermissionError:
        return True
    return True


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
