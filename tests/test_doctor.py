"""`iod doctor`: the disk's rate against queue depth, stored where the daemon
and sessions find it; the knee picks the daemon's reader threads."""

import json
import os
import subprocess
import sys

import pytest

from shared import disk
from shared import protocol as P
from shared.fixtures import LiveDaemon, Raw


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


@pytest.mark.parametrize("flag,argv", [
    ("--depths", ["--dir", "{tmp}", "--depths", "0"]),
    ("--depths", ["--dir", "{tmp}", "--depths", "1,x"]),
    ("--seconds", ["--dir", "{tmp}", "--seconds", "-1"]),
    ("--seconds", ["--dir", "{tmp}", "--seconds", "nan"]),
    ("--seconds", ["--dir", "{tmp}", "--seconds", "inf"]),
    ("--seconds", ["--dir", "{tmp}", "--seconds", "0"]),
    ("--rounds", ["--dir", "{tmp}", "--rounds", "0"]),
    ("--record-size", ["--dir", "{tmp}", "--record-size", "-5"]),
    ("--scratch", ["--dir", "{tmp}", "--scratch", "-1"]),
    ("--scratch", ["--dir", "{tmp}", "--scratch", "100"]),
    ("--plot", ["--dir", "{tmp}", "--plot", "/nonexistent/curve.png"]),
    ("--plot", ["--dir", "{tmp}", "--plot", "/proc/curve.png"]),  # a folder no file can be made in
    ("--dir", ["--dir", "{tmp}/a-file"]),
    ("--model", ["--model", "/nonexistent"])])
@pytest.mark.parametrize("save", [[], ["--no-save"]])
def test_bad_arguments_are_one_line(flag, argv, save, tmp_path):
    (tmp_path / "a-file").write_text("")
    store = tmp_path / "d.json"
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    r = subprocess.run([sys.executable, "-m", "iod.cli", "doctor", *argv, *save],
                       capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, IOD_DISK_PROFILE=str(store)))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and flag in lines[0], r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # no profile, no scratch


def _args(tmp_path, **kw):
    import argparse

    return argparse.Namespace(**{"model": None, "dir": tmp_path, "record_size": 65536,
                                 "scratch": 1 << 20, "depths": [1, 2], "seconds": 0.01,
                                 "rounds": 1, "json": False, "plot": None, "no_save": False,
                                 **kw})


def test_a_run_that_measured_nothing_stores_nothing(tmp_path, monkeypatch, capsys):
    from iod import doctor

    store = tmp_path / "d.json"
    monkeypatch.setenv("IOD_DISK_PROFILE", str(store))
    monkeypatch.setattr(doctor, "measure", lambda *a: (0.0, 0.0, 0.0))
    assert doctor.main(_args(tmp_path)) == 1
    assert "nothing stored" in capsys.readouterr().err.strip().splitlines()[-1]
    assert not store.exists() and list(tmp_path.iterdir()) == []  # scratch gone too


def test_a_failed_read_is_one_line_and_stores_nothing(tmp_path, monkeypatch, capsys):
    from iod import doctor

    store = tmp_path / "d.json"
    monkeypatch.setenv("IOD_DISK_PROFILE", str(store))

    def fail(*a):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(doctor, "measure", fail)
    assert doctor.main(_args(tmp_path)) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Input/output error" in err[0] and "nothing stored" in err[0]
    assert not store.exists() and list(tmp_path.iterdir()) == []


def test_a_reader_thread_error_reaches_the_caller(tmp_path, capsys):
    """Not a thread's traceback and a rate of 0: measure raises the error."""
    from iod import doctor

    fd = os.open(tmp_path / "w", os.O_WRONLY | os.O_CREAT)  # pread on it: EBADF
    try:
        with pytest.raises(OSError):
            doctor.measure(doctor._Records([(fd, 4, 4096)], "fadvise"), 4096, 2, 0.05)
    finally:
        os.close(fd)
    assert "Traceback" not in capsys.readouterr().err
