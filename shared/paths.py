"""Where iod's files live: run dir, socket, lock, shared-memory names; and
whether a command's output file can be written where it is asked for."""

import os
import re
import secrets
import string
from pathlib import Path

# macOS limits POSIX shm names to 31 characters, leading slash included.
SHM_NAME_MAX = 31


def run_dir() -> Path:
    """$IOD_RUN_DIR, else $XDG_RUNTIME_DIR/iod, else /tmp/iod-<uid>."""
    if os.environ.get("IOD_RUN_DIR"):
        return Path(os.environ["IOD_RUN_DIR"])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "iod"
    return Path(f"/tmp/iod-{os.getuid()}")


def socket_path(folder=None) -> Path:
    return Path(folder or run_dir()) / "iod.sock"


def lock_path(folder=None) -> Path:
    return Path(folder or run_dir()) / "iod.lock"


def arena_record_path(folder=None) -> Path:
    """Names the live daemon's segment, so a restart can sweep it on any OS."""
    return Path(folder or run_dir()) / "arena.name"


_ALPHABET = string.ascii_lowercase + string.digits
MIN_RANDOM = 6  # 31 bits even with a 10-digit uid and a 7-digit pid


def shm_name(pid: int = 0) -> str:
    """A fresh segment name, ``/iod.<uid>.<pid>.<random>``, filled with
    random characters up to the 31-character macOS limit: nobody can guess
    it ahead (the creator still uses O_EXCL and retries on a collision), and
    the pid lets a sweep tell a dead daemon's segment."""
    head = f"/iod.{os.getuid()}.{pid or os.getpid()}."
    n = SHM_NAME_MAX - len(head)
    assert n >= MIN_RANDOM, head
    return head + "".join(secrets.choice(_ALPHABET) for _ in range(n))


def shm_prefix() -> str:
    return f"iod.{os.getuid()}."


def is_shm_name(name: str) -> bool:
    """One of our segment names (as ``shm_name`` makes them, or the older
    ``.<serial>`` ones), so a sweep never touches anything else."""
    return bool(name) and len(name) <= SHM_NAME_MAX and \
        re.fullmatch(rf"/iod\.{os.getuid()}\.[0-9]+\.[a-z0-9]+", name) is not None


def shm_pid(name: str) -> int:
    """The creator's pid in a name ``is_shm_name`` accepts."""
    return int(name.split(".")[2])


def endpoint(sock: Path) -> str:
    return f"ipc://{sock}"


def tmp_beside(path: Path) -> Path:
    """A temporary name beside ``path``, this process's own."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def check_out(path: Path, flag: str):
    """Why ``path`` cannot be written as an output file, or None. A file is
    created and removed beside it: what is refused is refused before the work
    (a folder's mode says nothing on /proc or a read-only mount, nor to root)."""
    if path.is_dir():
        return f"{flag} {path} is a folder"
    if not path.parent.is_dir():
        return f"{flag} {path}: {path.parent} is not a folder"
    probe = tmp_beside(path)
    try:
        probe.open("x").close()
        probe.unlink()
    except OSError as e:
        return f"{flag} {path}: cannot write there ({e.strerror})"
    return None
