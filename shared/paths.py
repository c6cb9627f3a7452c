"""Where iod's files live: run dir, socket, lock, shared-memory names."""

import os
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


def shm_name(pid: int, serial: int = 0) -> str:
    name = f"/iod.{os.getuid()}.{pid}.{serial}"
    assert len(name) <= SHM_NAME_MAX, name
    return name


def shm_prefix() -> str:
    return f"iod.{os.getuid()}."


def endpoint(sock: Path) -> str:
    return f"ipc://{sock}"
