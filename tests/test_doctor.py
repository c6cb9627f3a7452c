"""`iod doctor`: the disk's rate against queue depth, stored where the daemon
and sessions find it; the knee picks the daemon's reader threads."""

import json
import os
import subprocess
import sys

import pytest

from shared import disk
from shared import protocol as P
from tests.iod_fixtures import LiveDaemon, Raw


def test_knee_and_rate_on_a_known_curve():
    p = disk.Profile(1, "/x", 4096, "direct", (
        (1, 100e6, 1e-3, 2e-3), (2, 180e6, 1e-3, 2e-3), (4, 300e6, 1e-3, 2e-3),
        (8, 330e6, 2e-3, 4e-3), (16, 320e6, 4e-3, 8e-3)))
    assert p.ceiling == 330e6
    assert p.knee == 4  # the first depth at >= 90% of the ceiling: 300 >= 297
    assert p.rate(1) == 100e6 and p.rate(6) == 300e6 and p.rate(64) == 320e6
    assert disk.Profile.from_dict(p.to_dict()) == p


def test_doctor_measures_stores_and_the_daemon_reads_at_the_knee(tmp_path, monkeypatch):
    store = tmp_path / "disk.json"
    monkeypatch.setenv("IOD_DISK_PROFILE", str(store))
    r = subprocess.run([sys.executable, "-m", "iod.cli", "doctor", "--dir", str(tmp_path),
                        "--scratch", str(8 << 20), "--record-size", "65536", "--seconds", "0.05",
                        "--rounds", "1", "--depths", "1,2,3", "--json",
                        "--plot", str(tmp_path / "curve.png")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [c["depth"] for c in out["curve"]] == [1, 2, 3]
    assert all(c["MBps"] > 0 and 0 < c["p50_ms"] <= c["p99_ms"] for c in out["curve"])
    assert out["record_bytes"] == 65536 and out["mode"] in ("direct", "fadvise")
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".iod-doctor")]  # scratch gone
    (prof,) = disk.load_all().values()
    assert prof.device == os.stat(tmp_path).st_dev and prof.knee == out["knee_depth"]
    assert disk.for_path(tmp_path / "curve.png") == prof
    d = LiveDaemon(args=["--arena", "16M"], env={"IOD_DISK_PROFILE": str(store)})
    try:
        assert Raw(d.socket).rt(P.Stats(1)).stats["workers"] == prof.knee
    finally:
        d.stop()


@pytest.mark.parametrize("argv", [["--dir", "/tmp", "--depths", "0"],
                                  ["--dir", "/tmp", "--seconds", "-1"],
                                  ["--model", "/nonexistent"]])
def test_bad_arguments_are_one_line(argv, tmp_path):
    r = subprocess.run([sys.executable, "-m", "iod.cli", "doctor", *argv, "--no-save"],
                       capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, IOD_DISK_PROFILE=str(tmp_path / "d.json")))
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r.stderr
