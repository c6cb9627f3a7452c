"""IodClient: auto-spawned private daemons, dead-daemon detection, the API."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from infer.runtime.client import DaemonDead, IodClient, IodError
from shared.blob import Manifest
from shared.fixtures import LiveDaemon, record_bytes, shm_entries, short_dir, wait_for


@pytest.fixture
def run_dir(monkeypatch):
    import shutil

    d = short_dir()
    monkeypatch.setenv("IOD_RUN_DIR", str(d))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _children():
    out = subprocess.run(["pgrep", "-P", str(os.getpid())], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


def test_auto_spawns_and_stops_private_daemon(model, run_dir):
    before = _children()
    c = IodClient(model, arena="16M")
    pid = c.daemon_pid
    assert pid in _children() - before
    assert shm_entries(pid)
    m = Manifest.load(model)
    got = c.read(1, [2, 7])
    assert got[7] == record_bytes(model, m.layer(1), 7)
    c.close()
    assert pid not in _children()
    assert not shm_entries(pid)
    assert list(run_dir.iterdir()) == []  # the private run dir is gone too


@pytest.mark.parametrize("when", ["starting", "ready"])
def test_interrupted_while_the_private_daemon_starts_leaves_nothing(model, run_dir, monkeypatch, when):
    """Ctrl-C or SIGTERM while the private daemon started (before its READY
    line, or just after) once left its run dir, and the daemon until the
    process exited."""
    import shared.launch as launch

    real = launch._read_line

    def interrupted(fd, timeout):
        if when == "ready":
            assert real(fd, timeout).startswith("READY")
        raise KeyboardInterrupt

    monkeypatch.setattr(launch, "_read_line", interrupted)
    before, shm_before = _children(), set(shm_entries())
    with pytest.raises(KeyboardInterrupt):
        IodClient(model, arena="16M")
    assert _children() - before == set()
    assert set(shm_entries()) == shm_before
    assert list(run_dir.iterdir()) == []


def test_auto_uses_shared_daemon(model, run_dir):
    d = LiveDaemon(folder=run_dir, args=["--arena", "16M"])
    try:
        with IodClient(model) as c:
            assert c.daemon_pid == d.pid
            assert c.stats()["sessions"][0]["pid"] == os.getpid()
    finally:
        d.stop()


def test_private_daemon_dies_with_sigkilled_parent(model, run_dir):
    code = textwrap.dedent(f"""
        import sys
        from infer.runtime.client import IodClient
        c = IodClient({str(model)!r}, arena="16M")
        c.read(0, [1])
        print(c.daemon_pid, flush=True)
        sys.stdin.read()
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, env=dict(os.environ))
    pid = int(p.stdout.readline())
    p.kill()
    p.wait()
    wait_for(lambda: not _alive(pid), what="private daemon exit")
    wait_for(lambda: not shm_entries(pid), what="shm unlinked")


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def test_explicit_socket_without_daemon(model, run_dir):
    with pytest.raises(DaemonDead) as e:
        IodClient(model, iod=str(run_dir / "nothing.sock"))
    assert "\n" not in str(e.value) and "nothing.sock" in str(e.value)


def test_daemon_death_is_sticky_and_reconnect_recovers(model, run_dir):
    c = IodClient(model, arena="16M")
    c.read(0, [0])
    old = c.daemon_pid
    os.kill(old, signal.SIGKILL)
    with pytest.raises(DaemonDead):
        c.read(0, [1])
    with pytest.raises(DaemonDead):
        c.prefetch(0, [2])
    c.reconnect()
    assert c.daemon_pid != old
    m = Manifest.load(model)
    assert c.read(0, [1])[1] == record_bytes(model, m.layer(0), 1)
    c.close()
    assert not shm_entries(old)  # swept? the private dir of the old one is gone


@pytest.fixture
def daemon():
    d = LiveDaemon(args=["--arena", "16M", "--workers", "2"])
    yield d
    d.stop()


def test_prefetched_records_are_arena_hits_with_no_message(model, daemon):
    m = Manifest.load(model)
    with IodClient(model, iod=str(daemon.socket), profile=True) as c:
        c.prefetch(1, [1, 2, 3])
        wait_for(lambda: c.ready(1) == [1, 2, 3], what="prefetched records ready")
        c.prefetch(1, [1, 2, 3])  # ready already: nothing sent
        assert c.counters["prefetch_hints"] == 1
        before = c.stats()["sessions"][0]["requests"]
        got = c.read(1, [1, 2, 3, 4])
        assert c.counters["arena_hits"] == 3 and c.counters["demanded"] == 1
        assert all(got[e] == record_bytes(model, m.layer(1), e) for e in got)
        st = c.stats()
        assert st["sessions"][0]["requests"] == before + 2  # the demand for 4, and STATS
        assert st["sessions"][0]["pins"] == 0  # all unpinned after the copy, no message
        kinds = [h["kind"] for h in c.hop_log]
        assert sorted(kinds) == ["demand", "hit", "hit", "hit"]
        for h in c.hop_log:
            if h["kind"] == "demand":
                assert h["client_send"] <= h["received"] <= h["sent"] <= h["client_recv"]
                assert h["read_start"] and h["queued"] <= h["read_start"] <= h["read_end"]
            else:
                assert h["client_send"] <= h["client_recv"]


def test_slow_daemon_is_not_declared_dead(model):
    d = LiveDaemon(args=["--arena", "16M", "--workers", "1", "--read-rate", "0.5"])
    try:
        with IodClient(model, iod=str(d.socket), timeout=0.3) as c:
            got = c.read(2, [0, 1])  # ~1.2 s of reading at 0.5 MB/s: the loop keeps turning
            assert len(got) == 2
    finally:
        d.stop()


def test_stopped_daemon_is_declared_dead_within_the_timeout(model):
    import time

    d = LiveDaemon(args=["--arena", "16M"])
    try:
        with IodClient(model, iod=str(d.socket), timeout=1.0) as c:
            c.read(0, [0])
            os.kill(d.pid, signal.SIGSTOP)
            t = time.monotonic()
            with pytest.raises(DaemonDead) as e:
                c.read(0, [1])
            took = time.monotonic() - t
            assert "stood still" in str(e.value) and "\n" not in str(e.value)
            assert took < 1.0 + 5.0  # the documented bound plus scheduling slack
            os.kill(d.pid, signal.SIGCONT)
    finally:
        os.kill(d.pid, signal.SIGCONT)
        d.stop()


def test_a_daemon_that_turns_but_reads_nothing_is_declared_stuck(model):
    # the reader is throttled to a crawl: the loop turns, no read completes
    d = LiveDaemon(args=["--arena", "16M", "--workers", "1", "--read-rate", "0.001"])
    try:
        with IodClient(model, iod=str(d.socket), timeout=5.0, progress_timeout=1.5) as c:
            with pytest.raises(DaemonDead) as e:
                c.read(2, [0])
            assert "completed no read" in str(e.value)
    finally:
        d.kill()


def test_model_with_larger_stride_is_refused(model, tmp_path):
    from shared.fixtures import make_prep

    d = LiveDaemon(args=["--arena", "16M"])
    big = tmp_path / "big"
    make_prep(big, records=(500_000,), num_experts=2)
    try:
        with IodClient(model, iod=str(d.socket)):
            with pytest.raises(IodError) as e:
                IodClient(big, iod=str(d.socket))
            assert e.value.code.name == "BAD_MODEL" and "slot size" in str(e.value)
    finally:
        d.stop()


def test_queue_limit_is_typed(model):
    from shared import protocol as P
    from shared.fixtures import Raw

    d = LiveDaemon(args=["--arena", "16M", "--workers", "1", "--read-rate", "1",
                         "--max-queued", "4"])
    try:
        r = Raw(d.socket)
        h = r.hello(model)
        r.send(P.Demand(1, h.model_id, 0, list(range(6)), 1))  # 4 awaited: the limit
        err = r.rt(P.Demand(2, h.model_id, 1, [0], 2))
        assert err.code == P.ErrorCode.QUEUE_FULL
        first = r.until(1, timeout=30)
        assert len(first.refs) == 4  # the rest in a later wave
    finally:
        d.stop()


def test_unused_prefetches_hold_no_pins_and_are_counted_when_evicted(model):
    from shared import slots as S

    d = LiveDaemon(args=["--arena", str(S.Layout(303104, 4).nbytes)])  # 4 slots
    try:
        with IodClient(model, iod=str(d.socket)) as c:
            c.prefetch(0, [0, 1, 2])
            wait_for(lambda: c.ready(0) == [0, 1, 2], what="prefetched records ready")
            assert c.stats()["sessions"][0]["pins"] == 0
            got = c.read(1, [0, 1, 2, 3])  # needs every slot: the unused prefetches go
            assert len(got) == 4
            st = c.stats()["counters"]
            assert st["prefetched_unused"] == 3 and st["evictions"] == 3
    finally:
        d.stop()
