"""`iod start` refuses values that parse but make no daemon worth starting:
one line on stderr naming the flag, exit 2, and nothing left behind."""

import argparse
import os
import subprocess
import sys

import pytest

from shared.units import parse_size as units_parse_size


def _start(argv, tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o700, parents=True)
    r = subprocess.run([sys.executable, "-m", "iod.cli", "start", *argv],
                       capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, IOD_RUN_DIR=str(run)))
    return r, run


@pytest.mark.parametrize("flag,value", [
    ("--arena", "infG"), ("--arena", "1e400"), ("--arena", "1M"), ("--arena", "nanG"), ("--slot-size", "inf"),
    ("--max-connections", "0"), ("--max-sessions", "0"), ("--max-sessions", "-1"),
    ("--max-queued", "0"), ("--workers", "-1"), ("--workers", "100000"), ("--hashers", "-1"),
    ("--hashers", "257"), ("--read-rate", "-5"), ("--read-rate", "nan"),
    ("--read-rate", "inf")])
def test_start_refuses_a_bad_value_in_one_line(flag, value, tmp_path):
    for foreground in ([], ["--foreground"]):
        r, run = _start([flag, value, *foreground], tmp_path / str(len(foreground)))
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and flag in lines[0] and "Traceback" not in r.stderr, r.stderr
        assert list(run.iterdir()) == []  # no socket, lock, arena.name or log: nothing started


def test_what_zero_means_is_kept():
    from iod.cli import _parser

    a = _parser().parse_args(["start", "--workers", "0", "--hashers", "0", "--read-rate", "0"])
    assert (a.workers, a.hashers, a.read_rate) == (0, 0, 0.0)  # auto, readers check, no cap
    a = _parser().parse_args(["start", "--workers", "256", "--read-rate", "2.5"])
    assert (a.workers, a.read_rate) == (256, 2.5)


def test_parse_size_refuses_inf_nan_and_overflow():
    from iod.argtypes import size as parse_size

    for bad in ("inf", "infG", "-inf", "nan", "nanG", "1e400", "1e300G"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_size(bad)
        with pytest.raises(ValueError, match="not a size"):
            units_parse_size(bad)
    assert units_parse_size("1.5GiB") == 3 << 29 and units_parse_size("0") == 0


def test_doctor_takes_sizes_as_iod_start_does():
    """`--scratch` and `--record-size` take "64M" as `--arena` does (they took
    plain integers only); 0 is the default record size, not a size of 0."""
    from iod.cli import _parser

    a = _parser().parse_args(["doctor", "--dir", "/tmp", "--scratch", "64M", "--record-size", "2.5M"])
    assert (a.scratch, a.record_size) == (64 << 20, int(2.5 * (1 << 20)))
    assert _parser().parse_args(["doctor", "--dir", "/tmp", "--record-size", "0"]).record_size == 0
    for bad in (["--scratch", "0"], ["--scratch", "lots"], ["--record-size", "-1M"]):
        with pytest.raises(SystemExit):
            _parser().parse_args(["doctor", "--dir", "/tmp", *bad])
