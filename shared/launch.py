"""Launching the daemon and telling whether it lives: what both processes need.

``iod start`` and the sessions that start a private daemon use ``spawn``;
both read the lock file to find the daemon's pid (``lock_holder``).
Kept free of heavy imports so ``iod start`` can refuse a second start quickly.
"""

import errno
import fcntl
import os
import select
import stat
import subprocess
import sys
import time
from pathlib import Path


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


def spawn(sock: Path, extra=(), log=None, parent_fd=None, env=None):
    """Start ``iod start --foreground`` as a child and wait until it is ready
    while watching it. Returns (Popen, pid); raises RuntimeError with the
    child's reason if it fails to start.

    The child runs in ``/``, so a source tree in the caller's current
    directory never shadows the installed package."""
    r, w = os.pipe()
    cmd = [sys.executable, "-m", "iod.cli", "start", "--foreground", "--socket",
           str(Path(sock).absolute()), "--ready-fd", str(w), *extra]
    fds = [w]
    if parent_fd is not None:
        cmd += ["--parent-fd", str(parent_fd)]
        fds.append(parent_fd)
    out = os.fdopen(os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab") if log \
        else subprocess.DEVNULL
    try:
        proc = subprocess.Popen(cmd, pass_fds=fds, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=out if log else None, start_new_session=parent_fd is None,
                                env=env, cwd="/")
    finally:
        os.close(w)
        if log:
            out.close()
    try:
        line = _read_line(r, timeout=60.0)
    finally:
        os.close(r)
    if line.startswith("READY"):
        return proc, int(line.split()[1])
    if proc.poll() is None and not line:
        proc.kill()
    proc.wait()
    reason = line.removeprefix("ERROR ").strip() or _last_log_line(log) or \
        f"daemon exited with status {proc.returncode}"
    raise RuntimeError(reason)


def _last_log_line(log) -> str:
    """The last line the child wrote to its log (its reason, when it died early)."""
    if not log:
        return ""
    try:
        lines = Path(log).read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1].strip() if lines else ""


def _read_line(fd, timeout) -> str:
    """Read the child's one status line; EOF means it died (or closed the pipe)."""
    buf = b""
    deadline = time.monotonic() + timeout
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            return ""
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        buf += chunk
    return buf.decode(errors="replace").split("\n")[0]
