"""Whom a session trusts: only a daemon of its own uid, in a folder only it controls.

Every check raises ``Untrusted`` (a ``PermissionError``) with one line that
names the path and its owner. A symlink is never followed to a verdict: the
run dir and socket are judged by ``lstat``, the lock and the arena by
``fstat`` of what was opened (``O_NOFOLLOW``, ``O_NONBLOCK``).

A session calls ``check_daemon(socket)`` before it connects and
``check_arena_fd(fd, name)`` on the segment it maps; the daemon calls
``check_run_dir`` on its own folder (``shared.launch.ensure_run_dir``).
"""

import errno
import os
import socket
import stat
import struct
import sys
from pathlib import Path

from shared import paths


class Untrusted(PermissionError):
    """A path or peer that is not provably ours; the message is one line."""


def _who(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _mine(what: str, path, uid: int) -> None:
    me = os.getuid()
    if uid != me:
        raise Untrusted(f"{what} {path} is owned by {_who(uid)}, not by you ({_who(me)})")


def _private(what: str, path, mode: int, want: str) -> None:
    if mode & 0o077:
        raise Untrusted(f"{what} {path} has mode {stat.S_IMODE(mode):04o}, not {want}: "
                        f"others can reach it")


def check_run_dir(path) -> None:
    """A real directory (not a symlink), ours, mode 0700, in a chain of
    folders nobody else can rename it out of: each resolved ancestor is
    owned by root or us and is not writable by others unless sticky (/tmp)."""
    path = Path(path)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise Untrusted(f"run dir {path} is a symlink (to {os.readlink(path)}), owned by "
                        f"{_who(st.st_uid)}")
    if not stat.S_ISDIR(st.st_mode):
        raise Untrusted(f"run dir {path} is not a directory (owned by {_who(st.st_uid)})")
    _mine("run dir", path, st.st_uid)
    _private("run dir", path, st.st_mode, "0700")
    parent = Path(os.path.realpath(path.parent))
    for p in (parent, *parent.parents):
        st = os.stat(p)
        if st.st_uid not in (0, os.getuid()):
            raise Untrusted(f"run dir {path}: its ancestor {p} is owned by {_who(st.st_uid)}, "
                            f"who could replace it")
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise Untrusted(f"run dir {path}: its ancestor {p} (owned by {_who(st.st_uid)}) "
                            f"is writable by others (mode {stat.S_IMODE(st.st_mode):04o}) "
                            f"and not sticky")


def check_socket(path) -> None:
    """A socket file (not a symlink) owned by us. A socket cannot be
    open()ed, so lstat; inside a checked run dir nobody else can swap it.
    Its mode is the daemon's business (its peer check refuses other uids);
    who listens on it is proved by ``daemon_peer``."""
    st = os.lstat(path)
    if not stat.S_ISSOCK(st.st_mode):
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a socket"
        raise Untrusted(f"socket {path} is {kind} (owned by {_who(st.st_uid)})")
    _mine("socket", path, st.st_uid)


def check_lock(path) -> None:
    """A regular file (not a symlink, FIFO or device), ours, mode 0600."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise Untrusted(f"lock {path} is a symlink (owned by {_who(os.lstat(path).st_uid)})") \
                from None
        raise
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(st.st_mode):
        raise Untrusted(f"lock {path} is not a regular file (owned by {_who(st.st_uid)})")
    _mine("lock", path, st.st_uid)
    _private("lock", path, st.st_mode, "0600")


def _peer_cred(s) -> tuple:
    """(pid, uid) of the process at the other end of a connected AF_UNIX socket."""
    if sys.platform.startswith("linux"):
        fmt = "3i"  # struct ucred: pid, uid, gid
        pid, uid, _ = struct.unpack(fmt, s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                      struct.calcsize(fmt)))
        return pid, uid
    if sys.platform == "darwin":
        SOL_LOCAL, LOCAL_PEERCRED, LOCAL_PEERPID = 0, 1, 2  # <sys/un.h>
        # struct xucred: u_int cr_version; uid_t cr_uid; short cr_ngroups; gid_t cr_groups[16]
        raw = s.getsockopt(SOL_LOCAL, LOCAL_PEERCRED, struct.calcsize("IIh16I"))
        _, uid = struct.unpack_from("II", raw)
        pid = struct.unpack("i", s.getsockopt(SOL_LOCAL, LOCAL_PEERPID, 4))[0]
        return pid, uid
    raise Untrusted(f"cannot read the peer credentials of a unix socket on {sys.platform}")


def daemon_peer(sock_path, timeout: float = 2.0) -> tuple:
    """(pid, uid) of the process listening on ``sock_path``, read from the
    kernel (SO_PEERCRED; LOCAL_PEERCRED on macOS) over a plain AF_UNIX
    connection that is closed at once. Refuses another uid; a socket nobody
    listens on raises ConnectionRefusedError."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(timeout)
        s.connect(str(sock_path))
        pid, uid = _peer_cred(s)
    finally:
        s.close()
    if uid != os.getuid():
        raise Untrusted(f"socket {sock_path} is served by pid {pid} of {_who(uid)}, "
                        f"not by you ({_who(os.getuid())})")
    return pid, uid


def check_daemon(sock_path) -> bool:
    """Everything between a session and the daemon at ``sock_path``: the
    run dir, the lock (if any), the socket file and the listening process.
    True when a daemon of ours listens there, False when none does (no run
    dir, no socket, or a stale socket). Raises Untrusted."""
    sock = Path(sock_path)
    try:
        check_run_dir(sock.parent)
        lock = paths.lock_path(sock.parent)
        if os.path.lexists(lock):
            check_lock(lock)
        check_socket(sock)
        daemon_peer(sock)
    except (FileNotFoundError, ConnectionRefusedError):
        return False
    return True


def check_arena_fd(fd: int, name: str) -> None:
    """The opened shared-memory segment is ours and 0600."""
    st = os.fstat(fd)
    _mine("shared memory", name, st.st_uid)
    _private("shared memory", name, st.st_mode, "0600")
