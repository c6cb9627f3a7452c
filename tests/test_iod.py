"""The iod daemon, spawned as its own process, driven over its real socket."""

import os
import shutil

import pytest

from shared.fixtures import LiveDaemon, Raw, record_bytes, shm_entries, unpin_refs, wait_for
from shared import protocol as P
from shared.blob import Manifest


@pytest.fixture
def daemon():
    d = LiveDaemon(args=["--arena", "32M", "--workers", "2"])
    yield d
    d.stop()
    assert not shm_entries(d.pid), "shm left behind"


def test_round_trip_every_kind(daemon, model):
    r = Raw(daemon.socket)
    h = r.hello(model)
    assert isinstance(h, P.HelloOk) and h.daemon_pid == daemon.pid and h.slot_count > 0
    # both segments are named in arena.name, for a sweep after a crash
    assert (daemon.folder / "arena.name").read_text().split() == [h.shm_name, h.pins_name]
    assert 0 <= h.pin_row < h.pin_rows
    m = Manifest.load(model)
    r.send(P.Prefetch(r.req(), h.model_id, 0, [P.Hint(1, [3, 4], 1)]))  # a hint: no reply
    a = r.rt(P.Demand(r.req(), h.model_id, 0, [0, 5], 1))
    assert isinstance(a, P.DemandOk) and sorted(ref.expert for ref in a.refs) == [0, 5]
    assert a.stamps == []  # timestamps travel only to profiling sessions
    for ref in a.refs:
        assert ref.size == m.layer(0).record_bytes
    st = r.rt(P.Stats(r.req())).stats
    assert st["sessions"][0]["pins"] == 2 and st["counters"]["prefetches"] == 1
    wait_for(lambda: r.rt(P.Stats(r.req())).stats["counters"]["reads"] == 4, what="prefetch read")
    again = r.rt(P.Demand(r.req(), h.model_id, 1, [3], 2))  # prefetched: granted at once
    assert [x.expert for x in again.refs] == [3]
    unpin_refs(h, a.refs + again.refs)
    st = r.rt(P.Stats(r.req())).stats
    assert st["sessions"][0]["pins"] == 0 and st["counters"]["reads"] == 4
    bye = r.rt(P.Bye(r.req()))
    assert isinstance(bye, P.Ok)
    r2 = Raw(daemon.socket)
    st = r2.rt(P.Stats(r2.req())).stats
    assert st["sessions"] == [] and st["arena"]["slots"]["ready_pinned"] == 0
    # a live session is told when the daemon stops
    r2.hello(model)
    daemon.stop()
    assert isinstance(r2.recv(), P.Shutdown)
    r.close()
    r2.close()


def test_client_bytes_equal(daemon, model):
    from infer.runtime.client import IodClient

    m = Manifest.load(model)
    with IodClient(model, iod=str(daemon.socket)) as c:
        assert c.daemon_pid == daemon.pid
        c.prefetch(2, range(8))
        for layout in m.layers:
            got = c.read(layout.layer, range(layout.num_experts))
            for e, data in got.items():
                assert data == record_bytes(model, layout, e)
        again = c.read(1, range(16))  # all in the arena now: no message at all
        assert c.counters["arena_hits"] >= 16 and len(again) == 16
        st = c.stats()
        assert st["sessions"][0]["pins"] == 0
        assert st["counters"]["reads"] == 48


# ---- lock, restart, modes, stop ---------------------------------------------------

def _run_cli(*args, env=None):
    import subprocess
    import sys
    import time

    e = dict(os.environ)
    e.update(env or {})
    t = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "iod.cli", *args], capture_output=True, text=True,
                       env=e, timeout=60)
    return p, time.monotonic() - t


def test_second_daemon_refused_naming_pid(daemon):
    p, took = _run_cli("start", "--socket", str(daemon.socket))
    assert p.returncode != 0 and str(daemon.pid) in p.stderr, p.stderr
    p, took_fg = _run_cli("start", "--foreground", "--socket", str(daemon.socket))
    assert p.returncode != 0 and str(daemon.pid) in p.stderr, p.stderr
    print(f"refusal took {took:.2f} s detached, {took_fg:.2f} s foreground")
    st = Raw(daemon.socket).rt(P.Stats(1)).stats
    assert st["pid"] == daemon.pid  # the first daemon still owns its socket


def test_restart_after_sigkill_leaves_nothing_stale(model):
    d = LiveDaemon(args=["--arena", "16M"])
    r = Raw(d.socket)
    r.hello(model)
    old_shm = d.shm_name()
    d.kill()
    assert (d.folder / "iod.sock").exists() and shm_entries(d.pid)  # what a crash leaves
    d2 = LiveDaemon(folder=d.folder, args=["--arena", "16M"])
    try:
        assert not shm_entries(d.pid), f"{old_shm} not swept"
        r2 = Raw(d2.socket)
        assert isinstance(r2.hello(model), P.HelloOk)
        assert r2.rt(P.Stats(r2.req())).stats["pid"] == d2.pid
    finally:
        assert d2.stop() == 0
    assert not shm_entries(d2.pid)
    assert sorted(p.name for p in d.folder.iterdir()) == ["iod.log"]
    shutil.rmtree(d.folder)


def test_cli_start_status_stop(model, tmp_path):
    import json

    from shared.fixtures import short_dir

    folder = short_dir()
    sock = folder / "iod.sock"
    p, _ = _run_cli("start", "--socket", str(sock), "--arena", "16M")
    assert p.returncode == 0, p.stderr
    pid = int((folder / "iod.lock").read_text())
    p, _ = _run_cli("status", "--json", "--socket", str(sock))
    st = json.loads(p.stdout)
    assert st["pid"] == pid and {"sessions", "models", "arena", "counters", "latency_us"} <= set(st)
    p, _ = _run_cli("status", "--socket", str(sock))
    assert p.returncode == 0 and "demands" in p.stdout
    p, _ = _run_cli("stop", "--socket", str(sock))
    assert p.returncode == 0, p.stderr
    assert not shm_entries(pid)
    assert sorted(x.name for x in folder.iterdir()) == ["iod.log"]
    p, _ = _run_cli("status", "--socket", str(sock))
    assert p.returncode != 0 and "not running" in p.stderr
    shutil.rmtree(folder)


def test_stop_after_sigkill_removes_what_the_daemon_left(model):
    """`iod stop` with no daemon running, after a SIGKILL: exit 1, and the
    dead daemon's arena, socket and records are gone (not left for the next
    start to sweep)."""
    import signal

    from shared.fixtures import short_dir

    folder = short_dir()
    sock = folder / "iod.sock"
    p, _ = _run_cli("start", "--socket", str(sock), "--arena", "16M")
    assert p.returncode == 0, p.stderr
    pid = int((folder / "iod.lock").read_text())
    assert shm_entries(pid)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not os.path.exists(f"/proc/{pid}") or
             open(f"/proc/{pid}/stat").read().split()[2] == "Z", what="the daemon dead")
    p, _ = _run_cli("stop", "--socket", str(sock))
    assert p.returncode == 1
    assert p.stderr.splitlines()[0] == "iod is not running"
    assert "removed what a killed daemon left" in p.stderr
    assert not shm_entries(pid)
    assert sorted(x.name for x in folder.iterdir()) == ["iod.log"]
    shutil.rmtree(folder)


def test_modes(daemon, model):
    import stat

    Raw(daemon.socket).hello(model)
    mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)  # noqa: E731
    assert mode(daemon.folder) == 0o700
    assert mode(daemon.socket) == 0o600
    assert mode(daemon.folder / "iod.lock") == 0o600
    assert mode("/dev/shm" + daemon.shm_name()) == 0o600


def test_default_run_dir_is_created_0700(model, monkeypatch):
    import stat

    from shared import paths
    from shared.fixtures import short_dir

    base = short_dir()
    monkeypatch.setenv("IOD_RUN_DIR", str(base / "run"))
    p, _ = _run_cli("start", "--arena", "16M")
    assert p.returncode == 0, p.stderr
    try:
        assert stat.S_IMODE(os.stat(paths.run_dir()).st_mode) == 0o700
        assert paths.socket_path().exists()
    finally:
        assert _run_cli("stop")[0].returncode == 0
        shutil.rmtree(base)


# ---- sharing, coalescing, leases ---------------------------------------------------

CLIENT_SCRIPT = """
import sys
from infer.runtime.client import IodClient
from shared.blob import Manifest
from shared.fixtures import record_bytes
model, sock = sys.argv[1], sys.argv[2]
m = Manifest.load(model)
with IodClient(model, iod=sock) as c:
    for l in m.layers:
        c.prefetch(l.layer, range(0, l.num_experts, 2))
        got = c.read(l.layer, range(l.num_experts))
        bad = [e for e, v in got.items() if v != record_bytes(model, l, e)]
        assert not bad and len(got) == l.num_experts, (l.layer, bad)
print("ok")
"""


def test_concurrent_client_processes_get_file_bytes(daemon, model):
    import subprocess
    import sys

    procs = [subprocess.Popen([sys.executable, "-c", CLIENT_SCRIPT, str(model), str(daemon.socket)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=os.getcwd())
             for _ in range(4)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0 and out.strip() == "ok", err
    st = Raw(daemon.socket).rt(P.Stats(1)).stats
    assert st["sessions"] == [] and st["arena"]["slots"]["ready_pinned"] == 0
    # every record read at most once: 32 MiB holds the whole fake model
    assert st["counters"]["reads"] == 48


def test_coalescing_one_read_for_two_sessions(model):
    d = LiveDaemon(args=["--arena", "16M", "--workers", "1", "--read-rate", "2"])
    try:
        a, b = Raw(d.socket), Raw(d.socket)
        ha, hb = a.hello(model), b.hello(model)
        a.send(P.Demand(7, ha.model_id, 2, [9], 1))  # ~150 ms at 2 MB/s
        b.send(P.Demand(8, hb.model_id, 2, [9], 1))
        ra, rb = a.until(7), b.until(8)
        assert ra.refs == rb.refs  # the same slot and generation
        c = a.rt(P.Stats(a.req())).stats["counters"]
        assert c["reads"] == 1 and c["coalesced"] == 1
    finally:
        d.stop()


def test_killed_client_releases_pins_others_unaffected(daemon, model):
    import subprocess
    import sys

    code = ("import sys; from infer.runtime.client import IodClient\n"
            f"c = IodClient({str(model)!r}, iod={str(daemon.socket)!r})\n"
            "c.fetch_into(0, range(8), lambda b: (print('held', flush=True), sys.stdin.read()))\n"
            "sys.stdin.read()\n")
    other = Raw(daemon.socket)
    h = other.hello(model)
    other.rt(P.Demand(other.req(), h.model_id, 0, [0, 1], 1))
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    stats = lambda: other.rt(P.Stats(other.req())).stats  # noqa: E731
    assert len(stats()["sessions"]) == 2
    p.kill()
    p.wait()
    wait_for(lambda: len(stats()["sessions"]) == 1, what="dead session dropped")
    st = stats()
    # the killed session's pins (8 records, pinned while it copied) went with it
    assert st["sessions"][0]["pins"] == 2 and st["arena"]["slots"]["ready_pinned"] == 2
    a = other.rt(P.Demand(other.req(), h.model_id, 1, [3], 2))
    assert isinstance(a, P.DemandOk)


def test_stop_lets_reads_in_flight_finish(model):
    d = LiveDaemon(args=["--arena", "16M", "--workers", "1", "--read-rate", "0.25"])
    try:
        r = Raw(d.socket)
        h = r.hello(model)
        r.send(P.Demand(5, h.model_id, 2, [3], 1))  # ~1.2 s at 0.25 MB/s
        probe = Raw(d.socket)
        wait_for(lambda: probe.rt(P.Stats(probe.req())).stats["inflight_reads"] == 1,
                 what="read started")
        probe.close()
        d.proc.terminate()
        first, second = r.recv(), r.recv()
        assert isinstance(first, P.DemandOk) and first.req_id == 5
        assert isinstance(second, P.Shutdown)
        assert d.proc.wait(10) == 0
        assert not shm_entries(d.pid) and not d.socket.exists()
    finally:
        d.stop()


def test_parse_size():
    import argparse

    from iod.argtypes import size as parse_size

    assert parse_size("2G") == 2 << 30 and parse_size("512M") == 512 << 20
    assert parse_size("64k") == 64 << 10 and parse_size("1048576") == 1 << 20
    assert parse_size("1.5GiB") == 3 << 29
    for bad in ("0", "-1M", "lots", "2.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_size(bad)


def test_a_read_stuck_in_flight_does_not_hold_a_stopping_daemon(model):
    """A private daemon whose session is gone stops even while a read hangs
    (here a throttle of 1 KB/s): it waits STOP_READS_S, then exits clean."""
    import time

    from iod.shell import STOP_READS_S

    d = LiveDaemon(args=["--arena", "16M", "--workers", "1", "--read-rate", "0.001"])
    try:
        r = Raw(d.socket)
        h = r.hello(model)
        r.send(P.Demand(r.req(), h.model_id, 2, [0], 1))  # a 300 KB record: minutes
        wait_for(lambda: r.rt(P.Stats(r.req())).stats["inflight_reads"] == 1, what="a read")
        shm = d.shm_name()
        t = time.monotonic()
        d._close_pipe()  # the parent is gone
        assert d.proc.wait(STOP_READS_S + 20) == 0
        assert time.monotonic() - t >= STOP_READS_S - 1
        assert "stopping anyway" in d.logtext()
        assert not shm_entries(d.pid) and not (d.folder / "iod.sock").exists()
        assert not os.path.exists("/dev/shm" + shm)
        r.close()
    finally:
        if d.proc.poll() is None:
            d.kill()
        shutil.rmtree(d.folder, ignore_errors=True)
