"""Launching the daemon and telling whether it lives: what both processes need.

``iod start`` and the sessions that start a private daemon use ``spawn``;
both read the lock file to find the daemon's pid (``lock_holder``).
Kept free of heavy imports so ``iod start`` can refuse a second start quickly.
"""

import errno
import fcntl
import os
import select
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shared import trust

# never follow a symlink, never wait on a FIFO: every file iod opens by name
SAFE_OPEN = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


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
        fd = os.open(lock_file, os.O_RDONLY | SAFE_OPEN)
    except OSError:
        return 0
    try:
        return int(os.read(fd, 64).decode().strip() or 0)
    except (OSError, ValueError):
        return 0
    finally:
        os.close(fd)


def lock_pid_file(path, opener) -> int:
    """flock ``path`` (opened by ``opener()``, which returns an fd) and write
    our pid in it; returns the fd, to keep open while the lock is held.
    Raises BlockingIOError (the fd closed) while another process holds it:
    ``read_pid(path)`` names it. A holder removes the file as it lets go, so
    the file locked may no longer be the one the name gives: then the name's
    is locked instead. The kernel releases a killed holder's lock."""
    while True:
        fd = opener()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException:
            os.close(fd)
            raise
        try:
            same = os.lstat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def lock_holder(lock_file: Path) -> int:
    """The pid of the daemon holding the lock, or 0 when nobody holds it."""
    try:
        fd = os.open(lock_file, os.O_RDONLY | SAFE_OPEN)
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
    """Create the run dir with mode 0700, or accept an existing one that is
    a real directory of ours, mode 0700, that nobody else can swap
    (``trust.check_run_dir``). Raises ``trust.Untrusted`` otherwise.
    Nothing is followed or chmodded but a folder made here: a wrong mode on
    a folder we did not make is refused with a clear line, since the folder
    may be shared with other files (a home directory given as --socket's)."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    else:
        st = os.lstat(folder)
        if stat.S_IMODE(st.st_mode) != 0o700:  # a umask that took owner bits
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            try:
                if os.fstat(fd).st_ino == st.st_ino:
                    os.fchmod(fd, 0o700)
            finally:
                os.close(fd)
    trust.check_run_dir(folder)
    return folder


def open_log(path) -> int:
    """The log, opened for appending: a regular file of ours, created 0600;
    a symlink, FIFO or someone else's file is refused (Untrusted)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | SAFE_OPEN, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise trust.Untrusted(f"log {path} is a symlink; iod writes through none") from None
        raise
    st = os.fstat(fd)
    try:
        if not stat.S_ISREG(st.st_mode):
            raise trust.Untrusted(f"log {path} is not a regular file")
        if st.st_uid != os.getuid():
            raise trust.Untrusted(f"log {path} is owned by uid {st.st_uid}, not by you")
    except trust.Untrusted:
        os.close(fd)
        raise
    os.set_blocking(fd, True)
    return fd


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
    try:
        out = os.fdopen(open_log(log), "ab") if log else subprocess.DEVNULL
    except OSError as e:
        os.close(r)
        os.close(w)
        raise RuntimeError(str(e)) from None
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
    except BaseException:  # interrupted while it starts: the child must not outlive this
        _stop_child(proc)
        raise
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


def _stop_child(proc, grace_s=5.0):
    """SIGTERM (the daemon then removes its socket and shared memory), and
    SIGKILL if it is still there after ``grace_s``."""
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


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


def start_daemon(arena, read_rate_mb, workers=4):
    """A daemon of a benchmark's own (a private run dir under /tmp), stopped by closing
    the returned pipe end. Returns (proc, pid, socket, folder, pipe w)."""
    folder = Path(tempfile.mkdtemp(prefix="iodb-", dir="/tmp"))
    sock = folder / "iod.sock"
    r, w = os.pipe()
    try:
        proc, pid = spawn(sock, ["--arena", str(arena), "--workers", str(workers),
                                 "--read-rate", str(read_rate_mb)],
                          log=folder / "iod.log", parent_fd=r)
    except BaseException:  # a daemon that did not start leaves nothing behind
        os.close(w)
        shutil.rmtree(folder, ignore_errors=True)
        raise
    finally:
        os.close(r)
    return proc, pid, sock, folder, w


def stop_daemon(d):
    proc, _, _, folder, w = d
    os.close(w)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    shutil.rmtree(folder, ignore_errors=True)
