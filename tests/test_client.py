"""IodClient: auto-spawned private daemons, dead-daemon detection, the API."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from infer.client import DaemonDead, IodClient, IodError
from shared.blob import Manifest
from tests.iod_fixtures import LiveDaemon, record_bytes, shm_entries, short_dir, wait_for


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
    views = c.fetch(1, [2, 7])
    assert bytes(views[7]) == record_bytes(model, m.layer(1), 7)
    del views
    c.close()
    assert pid not in _children()
    assert not shm_entries(pid)
    assert list(run_dir.iterdir()) == []  # the private run dir is gone too


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
        from infer.client import IodClient
        c = IodClient({str(model)!r}, arena="16M")
        c.fetch(0, [1])
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
    c.fetch(0, [0])
    old = c.daemon_pid
    os.kill(old, signal.SIGKILL)
    with pytest.raises(DaemonDead):
        c.fetch(0, [1])
    with pytest.raises(DaemonDead):
        c.prefetch(0, [2])
    c.reconnect()
    assert c.daemon_pid != old
    m = Manifest.load(model)
    assert bytes(c.fetch(0, [1])[1]) == record_bytes(model, m.layer(0), 1)
    c.close()
    assert not shm_entries(old)  # swept? the private dir of the old one is gone


@pytest.fixture
def daemon():
    d = LiveDaemon(args=["--arena", "16M", "--workers", "2"])
    yield d
    d.stop()


def test_prefetch_then_fetch_uses_ready_and_profiles(model, daemon):
    m = Manifest.load(model)
    with IodClient(model, iod=str(daemon.socket), profile=True) as c:
        c.prefetch(1, [1, 2, 3])
        c.prefetch(1, [1, 2, 3])  # already requested: nothing sent
        assert c.counters["prefetch_requests"] == 1
        wait_for(lambda: (c.poll(), c.ready(1) == [1, 2, 3])[1], what="readies")
        views = c.fetch(1, [1, 2, 3, 4])
        assert c.counters["ready_used"] == 3 and c.counters["acquired"] == 1
        assert c.counters["demand_requests"] == 1
        assert all(bytes(views[e]) == record_bytes(model, m.layer(1), e) for e in views)
        assert {h["kind"] for h in c.hop_log} == {"prefetch", "acquire"}
        for h in c.hop_log:
            assert h["client_send"] <= h["received"] <= h["sent"] <= h["client_recv"]
        del views
        c.release(1, [1, 2, 3, 4])
        c.prefetch(2, [0, 1])
        wait_for(lambda: (c.poll(), c.ready(2) == [0, 1])[1], what="readies")
        c.cancel(2)  # unused prefetched pins go too
        assert c.pinned == 0
        wait_for(lambda: c.stats()["sessions"][0]["pins"] == 0, what="pins released")


def test_slow_daemon_is_not_declared_dead(model):
    d = LiveDaemon(args=["--arena", "16M", "--workers", "1", "--read-rate", "0.5"])
    try:
        with IodClient(model, iod=str(d.socket), timeout=0.2) as c:
            views = c.fetch(2, [0, 1])  # ~1.2 s of reading at 0.5 MB/s
            assert len(views) == 2
            del views
    finally:
        d.stop()


def test_model_with_larger_stride_is_refused(model, tmp_path):
    from tests.iod_fixtures import make_prep

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
    from tests.iod_fixtures import Raw

    d = LiveDaemon(args=["--arena", "16M", "--workers", "1", "--read-rate", "1",
                         "--max-queued", "4"])
    try:
        r = Raw(d.socket)
        h = r.hello(model)
        err = r.rt(P.Acquire(r.req(), h.model_id, 0, list(range(6)), True))
        assert err.code == P.ErrorCode.QUEUE_FULL
        assert r.rt(P.Prefetch(r.req(), h.model_id, 0, list(range(6)))).count == 4
    finally:
        d.stop()


def test_fetch_sheds_unused_prefetch_pins_when_full(model):
    from shared import slots as S

    d = LiveDaemon(args=["--arena", str(S.arena_bytes(303104, 4))])  # 4 slots
    try:
        with IodClient(model, iod=str(d.socket)) as c:
            c.prefetch(0, [0, 1, 2])
            wait_for(lambda: (c.poll(), c.ready(0) == [0, 1, 2])[1], what="readies")
            views = c.fetch(1, [0, 1])  # 3 + 2 > 4 pins: the unused prefetches go
            assert len(views) == 2 and c.counters["shed"] == 3
    finally:
        d.stop()
