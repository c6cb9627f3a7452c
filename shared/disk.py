"""Disk profiles measured by `iod doctor`: read rate against queue depth, per device.

The profile lives in one JSON file per user (``profile_path``), or per run
dir where ``$IOD_RUN_DIR`` gives a daemon one of its own, keyed by the
device a measured file lies on. The daemon reads with as many reader threads
as the deepest profiled device needs to reach its ceiling; a session plans
its prefetch with the rate of the device its model lies on.
"""

import json
import os
from dataclasses import dataclass
from pathlib import Path

KNEE = 0.9  # the knee: the smallest depth that reaches this share of the ceiling
MAX_WORKERS = 32


def profile_path() -> Path:
    """$IOD_DISK_PROFILE; else $IOD_RUN_DIR/disk.json, so a run dir's daemon
    (a test's, one per disk) is set by its own measurement and sets no other
    daemon's threads; else $XDG_CACHE_HOME/iod/disk.json, else
    ~/.cache/iod/disk.json."""
    if os.environ.get("IOD_DISK_PROFILE"):
        return Path(os.environ["IOD_DISK_PROFILE"])
    if os.environ.get("IOD_RUN_DIR"):
        return Path(os.environ["IOD_RUN_DIR"]) / "disk.json"
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "iod" / "disk.json"


@dataclass(frozen=True)
class Profile:
    device: int
    path: str  # what was read
    record_bytes: int
    mode: str  # direct, nocache, fadvise
    curve: tuple  # ((depth, bytes/s, p50 s, p99 s), ...)

    @property
    def ceiling(self) -> float:
        """The best rate measured, bytes/s."""
        return max(rate for _, rate, _, _ in self.curve)

    @property
    def knee(self) -> int:
        """The smallest queue depth that reaches KNEE of the ceiling."""
        for depth, rate, _, _ in sorted(self.curve):
            if rate >= KNEE * self.ceiling:
                return depth
        return max(d for d, *_ in self.curve)

    def rate(self, depth: int) -> float:
        """Bytes/s at ``depth`` reads in flight (the nearest measured depth below)."""
        best = min(self.curve)[1]
        for d, r, _, _ in sorted(self.curve):
            if d <= depth:
                best = r
        return best

    def to_dict(self) -> dict:
        return {"device": self.device, "path": self.path, "record_bytes": self.record_bytes,
                "mode": self.mode, "ceiling_MBps": round(self.ceiling / 1e6, 1),
                "knee_depth": self.knee,
                "curve": [{"depth": d, "MBps": round(r / 1e6, 1), "p50_ms": round(p50 * 1e3, 3),
                           "p99_ms": round(p99 * 1e3, 3)} for d, r, p50, p99 in self.curve]}

    @classmethod
    def from_dict(cls, d) -> "Profile":
        curve = tuple((int(c["depth"]), float(c["MBps"]) * 1e6, float(c["p50_ms"]) / 1e3,
                       float(c["p99_ms"]) / 1e3) for c in d["curve"])
        return cls(int(d["device"]), str(d["path"]), int(d["record_bytes"]), str(d["mode"]), curve)


def load_all(path=None) -> dict:
    """{device: Profile} from the profile file ({} when absent or unreadable)."""
    try:
        data = json.loads(Path(path or profile_path()).read_text())
        return {int(k): Profile.from_dict(v) for k, v in data.get("devices", {}).items()}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def for_path(file, path=None):
    """The profile of the device ``file`` lies on, or None."""
    try:
        dev = os.stat(file).st_dev
    except OSError:
        return None
    return load_all(path).get(dev)


def save(profile: Profile, path=None) -> Path:
    """Store ``profile`` (replacing the device's earlier one), atomically."""
    path = Path(path or profile_path())
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    profiles = load_all(path)
    profiles[profile.device] = profile
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"devices": {str(k): v.to_dict() for k, v in profiles.items()}},
                              indent=1))
    os.replace(tmp, path)
    return path


def workers(default: int = 4, path=None) -> int:
    """Reader threads for the daemon: the deepest knee among the profiled
    devices (at most MAX_WORKERS), or ``default`` when none is profiled."""
    knees = [p.knee for p in load_all(path).values()]
    return min(max(knees), MAX_WORKERS) if knees else default
