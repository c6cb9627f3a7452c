"""A fresh memory cgroup nested under our own, for running a command under a
memory cap (cgroup v1 or v2, whichever the machine has with a memory
controller we may write to).

    with MemoryCgroup(800 << 20) as cg:
        proc = cg.popen([...])          # the child and its descendants are in it
        proc.wait()
        cg.stats()   # {"peak": ..., "failcnt": ..., "oom_kill": ..., "usage": ...}

``usable()`` says why not where no cgroup can be made (not root, no memory
controller, v2 without memory delegated to our subtree). Linux only.
"""

import os
import subprocess
import time
import uuid
from pathlib import Path

V1_ROOT = Path("/sys/fs/cgroup/memory")
V2_ROOTS = (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup"))


def _own_path(hierarchy: str):
    """Our cgroup's path in a hierarchy of /proc/self/cgroup ('memory' for v1,
    '' for the v2 unified one), or None."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "" and hierarchy == "":
            return path
        if hierarchy and hierarchy in controllers.split(","):
            return path
    return None


def _v1_parent():
    if not (V1_ROOT / "memory.limit_in_bytes").exists():
        return None
    own = _own_path("memory")
    for p in ([V1_ROOT / own.lstrip("/")] if own else []) + [V1_ROOT]:
        if p.is_dir() and os.access(p, os.W_OK):
            return p
    return None


def _v2_parent():
    own = _own_path("")
    if own is None:
        return None
    for root in V2_ROOTS:
        if not (root / "cgroup.controllers").exists():
            continue
        p = root / own.lstrip("/")
        try:
            if "memory" not in (p / "cgroup.controllers").read_text().split():
                continue
            if "memory" not in (p / "cgroup.subtree_control").read_text().split():
                (p / "cgroup.subtree_control").write_text("+memory")
        except OSError:
            continue
        if os.access(p, os.W_OK):
            return p
    return None


def find_parent():
    """(version, parent folder) where a nested memory cgroup can be made, or
    (None, reason)."""
    if not Path("/proc/self/cgroup").exists():
        return None, "no cgroups (not Linux)"
    p = _v1_parent()
    if p is not None:
        return 1, p
    p = _v2_parent()
    if p is not None:
        return 2, p
    if os.geteuid() != 0:
        return None, "no writable memory cgroup (not root, none delegated to this user)"
    return None, "no memory cgroup controller usable here (v1 memory not mounted, v2 memory not delegated)"


def usable():
    """None if a nested memory cgroup can be made here, else why not."""
    version, parent = find_parent()
    if version is None:
        return parent
    try:
        with MemoryCgroup(64 << 20):
            pass
    except OSError as e:
        return f"cannot make a memory cgroup under {parent}: {e}"
    return None


class MemoryCgroup:
    """A memory cgroup of ``limit`` bytes, removed on ``close()``."""

    def __init__(self, limit: int, prefix="iod-budget-"):
        version, parent = find_parent()
        if version is None:
            raise OSError(parent)
        self.version, self.limit = version, int(limit)
        self.path = parent / f"{prefix}{uuid.uuid4().hex[:12]}"
        self.path.mkdir()
        try:
            if version == 1:
                self._write("memory.limit_in_bytes", self.limit)
                # no swap on the machines this runs on; where there is, cap it too
                if (self.path / "memory.memsw.limit_in_bytes").exists():
                    try:
                        self._write("memory.memsw.limit_in_bytes", self.limit)
                    except OSError:
                        pass
            else:
                self._write("memory.max", self.limit)
                if (self.path / "memory.swap.max").exists():
                    self._write("memory.swap.max", 0)
        except OSError:
            self.path.rmdir()
            raise

    def _write(self, name, value):
        (self.path / name).write_text(f"{value}\n")

    def _read(self, name):
        return (self.path / name).read_text()

    def _keyed(self, name):
        out = {}
        for line in self._read(name).splitlines():
            k, _, v = line.partition(" ")
            if v.strip().lstrip("-").isdigit():
                out[k] = int(v)
        return out

    def enter(self, pid=0):
        """Move ``pid`` (0: this process) into the cgroup."""
        self._write("cgroup.procs", pid or os.getpid())

    def popen(self, cmd, **kw):
        """``subprocess.Popen(cmd)`` started inside the cgroup (it moves itself
        in between fork and exec, so everything it allocates is charged)."""
        procs = str(self.path / "cgroup.procs")

        def join():
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

        return subprocess.Popen(cmd, preexec_fn=join, **kw)

    def pids(self):
        return [int(x) for x in self._read("cgroup.procs").split()]

    def stats(self) -> dict:
        """peak and usage (bytes, page cache included), failcnt (times the cap
        was hit: reclaim, not necessarily an OOM), oom_kill (processes the OOM
        killer ended), and memory.stat's main counters."""
        if self.version == 1:
            oom = self._keyed("memory.oom_control")
            stat = self._keyed("memory.stat")
            return {"peak": int(self._read("memory.max_usage_in_bytes")),
                    "usage": int(self._read("memory.usage_in_bytes")),
                    # with memsw capped too, a charge fails on memsw's counter first
                    "failcnt": max(int(self._read(f)) for f in ("memory.failcnt",
                                                                 "memory.memsw.failcnt")
                                   if (self.path / f).exists()),
                    "oom_kill": oom.get("oom_kill", 0), "under_oom": oom.get("under_oom", 0),
                    "cache": stat.get("total_cache", stat.get("cache", 0)),
                    "rss": stat.get("total_rss", stat.get("rss", 0)),
                    "shmem": stat.get("total_shmem", stat.get("shmem", 0)),
                    "mapped_file": stat.get("total_mapped_file", stat.get("mapped_file", 0))}
        events = self._keyed("memory.events")
        stat = self._keyed("memory.stat")
        peak = self.path / "memory.peak"
        return {"peak": int(peak.read_text()) if peak.exists() else None,
                "usage": int(self._read("memory.current")),
                "failcnt": events.get("max", 0), "oom_kill": events.get("oom_kill", 0),
                "cache": stat.get("file", 0), "rss": stat.get("anon", 0),
                "shmem": stat.get("shmem", 0), "mapped_file": stat.get("file_mapped", 0)}

    def close(self, timeout=10.0):
        """Kill what is left inside (only processes in this cgroup, which we
        started), then remove the cgroup."""
        deadline = time.monotonic() + timeout
        while self.path.exists():
            try:
                pids = self.pids()
            except OSError:
                return
            for pid in pids:
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
            try:
                self.path.rmdir()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def drop_page_cache(paths):
    """Evict files from the page cache (posix_fadvise DONTNEED, on these files
    only), so a run in a cgroup is charged for the pages it reads rather than
    finding them already cached and charged to someone else."""
    for root in paths:
        root = Path(root)
        files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
        for f in files:
            try:
                fd = os.open(f, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
            finally:
                os.close(fd)
