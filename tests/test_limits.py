"""Limits and lifetimes (docs/reliability.md, sections 8.6-8.10): each test
performs the fault for real, with real processes and sockets.

- `iod stop --drain` and `iod restart` (issue 16, item 8);
- every wait of a session has a bound; a session pinning its whole share
  blocks nobody (issue 12, deliver 4);
- a prefill larger than a session's share is served in waves (deliver 5);
- connections are capped, unread replies bounded (deliver 6);
- a session never computes with a prep folder re-prepped under it (deliver 7).

Figures are printed as one JSON line per check (run with -s to see them).
"""

import json
import os
import signal
import stat
import subprocess
import time
import pytest

from shared import protocol as P
from shared.blob import Manifest
from shared.fixtures import PY, Raw, daemon_stats as stats, short_dir, wait_for
from tests.test_run import PROMPT, mlx_greedy_ids, tiny_budget
from tests.test_trust import cli, emit, gone, one_line

E = P.ErrorCode


def shared_budget(prep, max_tokens):
    """A budget just above the minimum for a session on a shared daemon (no
    daemon of its own to hold): its expert cache holds almost nothing, so it
    keeps asking the daemon to the end. (Planned as if it started a private
    daemon, the tiny model's cache would hold every expert: preloaded, the
    session would never ask again.)"""
    return tiny_budget(prep, PROMPT, max_tokens, private_daemon=False)


def infer_run(sock, prep, *args, **kw):
    """`infer run --iod SOCKET` as a child; stdout and stderr piped."""
    cmd = [PY, "-m", "infer.cli", "run", "--model", str(prep), "--iod", str(sock),
           "--prompt", PROMPT, *map(str, args)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


class Detached:
    """A daemon started with `iod start` in a fresh short folder."""

    def __init__(self, *args):
        self.folder = short_dir("iodl-")
        self.socket = self.folder / "iod.sock"
        p, _ = cli("start", "--socket", self.socket, *args)
        assert p.returncode == 0, p.stderr
        self.pid = self.lock_pid()

    def lock_pid(self) -> int:
        return int((self.folder / "iod.lock").read_text())

    def close(self):
        if (self.folder / "iod.lock").exists():
            cli("stop", "--socket", self.socket, "--grace", "5")
        for f in self.folder.iterdir():
            f.unlink()
        self.folder.rmdir()


# ---- 8.6 `iod stop --drain`, `iod restart` -----------------------------------------------


def test_stop_drain_finishes_the_live_session_and_refuses_new_ones(synth_model, prep_model):
    """A session generating when the drain starts finishes its generation
    token for token; a session that comes during the drain is refused with
    one line; the daemon exits when the last session ends."""
    src, prep = synth_model("qwen3_moe"), prep_model("qwen3_moe")
    n = 48
    want = mlx_greedy_ids(src, n)
    # an arena smaller than the model (62 slots, 128 records) and an expert
    # cache of almost nothing: the session keeps asking the daemon to the end
    d = Detached("--arena", "2M", "--workers", "2")
    gen = None
    try:
        gen = infer_run(d.socket, prep, "-m", n, "--json", "--mem-budget", shared_budget(prep, n))
        wait_for(lambda: any(s["pid"] == gen.pid and s["demands"] > 0
                             for s in stats(d.socket)["sessions"]), 60, "the session generating")
        os.kill(gen.pid, signal.SIGSTOP)  # held mid-generation while the drain starts
        drain = subprocess.Popen([PY, "-m", "iod.cli", "stop", "--drain", "--socket", d.socket],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: stats(d.socket)["draining"], 30, "the daemon draining")
        late = subprocess.run([PY, "-m", "infer.cli", "run", "--model", str(prep), "--iod",
                               str(d.socket), "-m", "4"], capture_output=True, text=True,
                              timeout=120)
        assert late.returncode == 2, late.stderr
        assert one_line(late.stderr) == ("infer run: iod SHUTTING_DOWN: iod is draining: it "
                                         "finishes its sessions and takes no new ones")
        assert drain.poll() is None and not gone(d.pid)  # still waiting for the session
        os.kill(gen.pid, signal.SIGCONT)
        out, err = gen.communicate(timeout=180)
        assert gen.returncode == 0, err
        assert json.loads(out)["tokens"] == want
        t = time.monotonic()
        drain_out, drain_err = drain.communicate(timeout=60)
        after = time.monotonic() - t
        assert drain.returncode == 0, drain_err
        assert drain_out.strip() == f"iod drained and stopped (pid {d.pid})"
        # it said which session it waited for
        assert drain_err.splitlines()[0] == (f"iod: draining pid {d.pid}: waiting for 1 session "
                                             f"(pid {gen.pid}: {prep})"), drain_err
        wait_for(lambda: gone(d.pid), 10, "the daemon's exit")  # it exits just after its lock
        assert sorted(x.name for x in d.folder.iterdir()) == ["iod.log"]
        emit("stop_drain", {"tokens": n, "late_session": "SHUTTING_DOWN",
                            "drain_exit_after_session_s": round(after, 2)})
    finally:
        if gen is not None and gen.poll() is None:
            os.kill(gen.pid, signal.SIGCONT)
            gen.kill()
        d.close()


def test_stop_drain_bounded_then_stops_and_ctrl_c_abandons_the_wait(model):
    """`--drain S` waits at most S seconds, then stops as `iod stop` does;
    Ctrl-C ends the wait and leaves the daemon draining."""
    d = Detached("--arena", "16M")
    r = Raw(d.socket)
    try:
        assert isinstance(r.hello(model), P.HelloOk)  # a session that never ends
        w = subprocess.Popen([PY, "-m", "iod.cli", "stop", "--drain", "--socket", d.socket],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: stats(d.socket)["draining"], 30, "the daemon draining")
        time.sleep(0.5)
        w.send_signal(signal.SIGINT)
        _, err = w.communicate(timeout=30)
        assert w.returncode == 130, err
        assert err.strip().splitlines()[-1] == (f"iod: stopped waiting; pid {d.pid} keeps "
                                                f"draining and exits after its last session")
        assert not gone(d.pid) and stats(d.socket)["draining"]
        refused = Raw(d.socket)
        reply = refused.hello(model)
        refused.close()
        assert isinstance(reply, P.Error) and reply.code == E.SHUTTING_DOWN

        p, took = cli("stop", "--drain", "1", "--grace", "5", "--socket", d.socket)
        assert p.returncode == 0, p.stderr
        assert (f"iod: pid {d.pid} still has 1 session after 1 s of draining; stopping it"
                in p.stderr.splitlines())
        assert p.stdout.strip() == f"iod stopped (pid {d.pid})"
        assert isinstance(r.recv(10), P.Shutdown)  # the session was told
        wait_for(lambda: gone(d.pid), 10, "the daemon's exit")
        assert took < 1 + 5 + 10  # drain bound, grace, and slack for the loaded machine
        emit("stop_drain_bounded", {"drain_s": 1, "stop_s": round(took, 2)})
    finally:
        r.close()
        d.close()


def test_restart_brings_the_daemon_back_with_its_options(model):
    """`iod restart` (and `--drain`) start the next daemon with the options
    the last one recorded at its start (iod.args, 0600, never followed
    through a symlink)."""
    opts = ("--arena", "24M", "--workers", "3", "--max-connections", "77", "--max-sessions", "9")
    d = Detached(*opts)
    try:
        def settings(st):
            return (st["arena"]["bytes"], st["workers"], st["max_connections"])

        first = settings(stats(d.socket))
        assert first == (24 << 20, 3, 77)
        rec = d.folder / "iod.args"
        assert stat.S_IMODE(rec.lstat().st_mode) == 0o600 and stat.S_ISREG(rec.lstat().st_mode)

        p, _ = cli("restart", "--socket", d.socket)
        assert p.returncode == 0, p.stderr
        second = d.lock_pid()
        assert second != d.pid
        wait_for(lambda: gone(d.pid), 10, "the first daemon's exit")
        assert p.stdout.splitlines() == [f"iod stopped (pid {d.pid})",
                                         f"iod started (pid {second}, socket {d.socket})"]
        assert settings(stats(d.socket)) == first

        # --drain: the restart waits for the live session, then starts the next daemon
        r = Raw(d.socket)
        assert isinstance(r.hello(model, working_set=1), P.HelloOk)
        w = subprocess.Popen([PY, "-m", "iod.cli", "restart", "--drain", "--socket", d.socket],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: stats(d.socket)["draining"], 30, "the daemon draining")
        assert w.poll() is None and d.lock_pid() == second
        assert isinstance(r.rt(P.Bye(r.req())), P.Ok)
        r.close()
        out, err = w.communicate(timeout=60)
        assert w.returncode == 0, err
        third = d.lock_pid()
        assert third not in (second, d.pid)
        wait_for(lambda: gone(second), 10, "the second daemon's exit")
        assert out.splitlines() == [f"iod drained and stopped (pid {second})",
                                    f"iod started (pid {third}, socket {d.socket})"]
        assert settings(stats(d.socket)) == first

        # a planted record is refused before anything is stopped
        target = d.folder / "elsewhere"
        target.write_text(json.dumps({"start": ["--arena", "1G"]}))
        rec.unlink()
        rec.symlink_to(target)
        p, _ = cli("restart", "--socket", d.socket)
        assert p.returncode == 1
        assert one_line(p.stderr) == f"iod: {rec} is a symlink; iod follows none"
        assert d.lock_pid() == third and not gone(third)
        rec.unlink()
        target.unlink()
        p, _ = cli("restart", "--socket", d.socket)
        assert p.returncode == 1
        assert one_line(p.stderr) == (f"iod: pid {third} recorded no start options ({rec}); "
                                      f"stop it and start it with `iod start`")
        emit("restart", {"arena_bytes": first[0], "workers": first[1],
                         "pids": [d.pid, second, third]})
        d.pid = third
    finally:
        d.close()


@pytest.mark.parametrize("iod", ["socket", "auto"])
def test_a_live_session_goes_on_with_the_daemon_iod_restart_starts(synth_model, prep_model, iod):
    """`iod restart` while a session generates: the session waits (at most
    client.RESTART_WAIT_S) for the next daemon at the socket and goes on
    there, token for token. Before, `--iod SOCKET` exited 1 ("the iod
    daemon went away": nothing answered yet) and `--iod auto` went on with
    a private daemon of its own."""
    src, prep = synth_model("qwen3_moe"), prep_model("qwen3_moe")
    n = 120
    want = mlx_greedy_ids(src, n)
    d = Detached("--arena", "2M", "--workers", "2")  # smaller than the model: the session keeps asking
    gen = None
    try:
        gen = infer_run(d.socket if iod == "socket" else "auto", prep, "-m", n, "--json",
                        "--mem-budget", shared_budget(prep, n), env=dict(os.environ, IOD_RUN_DIR=str(d.folder)))
        wait_for(lambda: any(s["pid"] == gen.pid and s["demands"] > 0
                             for s in stats(d.socket)["sessions"]), 60, "the session generating")
        p, _ = cli("restart", "--socket", d.socket)
        assert p.returncode == 0, p.stderr
        second = d.lock_pid()
        out, err = gen.communicate(timeout=180)
        assert gen.returncode == 0, err
        run = json.loads(out)
        assert run["tokens"] == want
        assert (run["stats"]["daemon_pid"], run["stats"]["daemon_private"]) == (second, False)
        assert not any(s["pid"] == gen.pid for s in stats(d.socket)["sessions"])  # it said BYE
        d.pid = second
    finally:
        if gen is not None and gen.poll() is None:
            gen.kill()
        d.close()


def test_restart_and_drain_usage():
    folder = short_dir("iodl-")
    try:
        p, _ = cli("restart", "--socket", folder / "iod.sock")
        assert p.returncode == 1 and one_line(p.stderr) == "iod is not running"
        for bad in (["stop", "--drain", "-1"], ["restart", "--grace", "soon"]):
            p, _ = cli(*bad)
            assert p.returncode == 2 and one_line(p.stderr).startswith(f"iod {bad[0]}: argument")
        p, _ = cli("stop", "--help")
        assert "--drain [S]" in p.stdout and "(default: 10.0)" in p.stdout
    finally:
        folder.rmdir()


# ---- 8.7 every wait of a session has a bound; a full share blocks nobody ---------------------


def test_infer_run_against_a_stopped_daemon_exits_with_one_line_within_the_timeout(prep_model):
    """The daemon is SIGSTOPped while `infer run --iod SOCKET` generates:
    the run ends with exit 1 and one line once the daemon's loop has stood
    still for --iod-timeout seconds (a slow disk would keep it turning)."""
    prep = prep_model("qwen3_moe")
    timeout = 2.0
    d = Detached("--arena", "2M")  # smaller than the model: the session keeps asking
    gen = infer_run(d.socket, prep, "-m", 100000, "--ignore-chat-template", "--iod-timeout",
                    timeout, "--mem-budget", shared_budget(prep, 100000))
    try:
        assert gen.stdout.read(16), gen.stderr.read()  # generating
        os.kill(d.pid, signal.SIGSTOP)
        t = time.monotonic()
        rc = gen.wait(timeout=120)
        took = time.monotonic() - t
        err = gen.stderr.read()
        assert rc == 1, err
        assert one_line(err) == (f"infer run: the iod daemon went away: iod daemon (pid {d.pid}) "
                                 f"is gone: its loop stood still for {timeout:g} s (stopped or "
                                 f"wedged)")
        # the bound, plus slack for the next miss to come and the process to exit
        assert took < timeout + 10
        emit("stopped_daemon", {"iod_timeout_s": timeout, "detected_and_exited_s": round(took, 2)})
    finally:
        if gen.poll() is None:
            gen.kill()
        os.kill(d.pid, signal.SIGCONT)
        d.close()
    p = subprocess.run([PY, "-m", "infer.cli", "run", "--help"], capture_output=True, text=True)
    assert "--iod-timeout S" in p.stdout and "(default: 10.0)" in " ".join(p.stdout.split())


def test_auto_session_leaves_a_stopped_shared_daemon_for_a_private_one(synth_model, prep_model):
    """With --iod auto the same fault is survived: the stopped shared daemon
    is declared dead after --iod-timeout, its HELLO goes unanswered for at
    most 6 x --iod-timeout, then a private daemon serves the rest; the
    tokens are the uninterrupted run's."""
    src, prep = synth_model("qwen3_moe"), prep_model("qwen3_moe")
    n, timeout = 96, 2.0
    want = mlx_greedy_ids(src, n)
    d = Detached("--arena", "2M")
    env = dict(os.environ, IOD_RUN_DIR=str(d.folder))
    gen = subprocess.Popen([PY, "-m", "infer.cli", "run", "--model", str(prep), "--prompt", PROMPT,
                            "-m", str(n), "--json", "--iod-timeout", str(timeout),
                            "--mem-budget", shared_budget(prep, n)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        wait_for(lambda: any(s["pid"] == gen.pid and s["demands"] > 0
                             for s in stats(d.socket)["sessions"]), 60, "the session generating")
        os.kill(d.pid, signal.SIGSTOP)
        t = time.monotonic()
        out, err = gen.communicate(timeout=180)
        took = time.monotonic() - t
        assert gen.returncode == 0, err
        res = json.loads(out)
        assert res["tokens"] == want
        assert res["stats"]["daemon_pid"] not in (0, d.pid)  # a private daemon finished it
        assert one_line(err) == (
            f"iod: the shared daemon at {d.socket} is not usable (iod daemon (pid {d.pid}) is "
            f"gone: no reply to HELLO within {6 * timeout:g} s); starting a private one")
        emit("stopped_shared_daemon_auto", {"iod_timeout_s": timeout, "tokens": n,
                                            "sigstop_to_end_s": round(took, 2)})
    finally:
        if gen.poll() is None:
            gen.kill()
        os.kill(d.pid, signal.SIGCONT)
        d.close()


def test_a_session_holding_its_whole_share_blocks_no_other(synth_model, prep_model):
    """One session pins its whole share of the arena and never unpins;
    another generates to the end, token for token, in the other share
    (the arena holds about half the model: it evicts and reads throughout)."""
    src, prep = synth_model("qwen3_moe"), prep_model("qwen3_moe")
    n = 48
    want = mlx_greedy_ids(src, n)
    d = Detached("--arena", "2M")
    gen = infer_run(d.socket, prep, "-m", n, "--json", "--mem-budget", shared_budget(prep, n))
    hog = Raw(d.socket)
    try:
        wait_for(lambda: any(s["pid"] == gen.pid for s in stats(d.socket)["sessions"]), 60,
                 "the generating session's HELLO")
        h = hog.hello(prep, working_set=2)
        assert isinstance(h, P.HelloOk), h
        share = h.slot_count // 2
        held = layer = 0
        while held < share:  # ask for whole layers until the daemon grants no more
            ok = hog.rt(P.Demand(hog.req(), h.model_id, layer % 4, list(range(32)), layer + 1),
                        timeout=60)
            assert isinstance(ok, P.DemandOk), ok
            held += len(ok.refs)
            layer += 1
        more = hog.rt(P.Demand(hog.req(), h.model_id, 3, list(range(32)), layer + 1))
        assert isinstance(more, P.DemandOk) and more.refs == []  # its share is used up: a wave of 0
        mine = [s for s in stats(d.socket)["sessions"] if s["pid"] == os.getpid()]
        assert mine[0]["pins"] == held == share
        out, err = gen.communicate(timeout=300)
        assert gen.returncode == 0, err
        assert json.loads(out)["tokens"] == want
        st = stats(d.socket)
        assert [s["pins"] for s in st["sessions"]] == [share]  # held to the end
        emit("share_hog", {"slots": h.slot_count, "hog_pins": held, "tokens": n,
                           "reads": st["counters"]["reads"], "evictions": st["counters"]["evictions"]})
    finally:
        hog.close()
        if gen.poll() is None:
            gen.kill()
        d.close()


# ---- 8.8 a layer call larger than the session's share is served in waves -------------------


def test_concurrent_prefills_larger_than_their_shares_come_in_waves(synth_model, prep_model):
    """Three `infer run` sessions at once on one daemon whose arena has 31
    slots: each share is 10 records, a prefill layer call needs about 27
    (30 prompt tokens x top-2 of 32 experts). Each is served in waves
    within its share, never refused, and generates the single-session ids."""
    src, prep = synth_model("qwen3_moe"), prep_model("qwen3_moe")
    n = 24
    want = mlx_greedy_ids(src, n)
    d = Detached("--arena", "1536K")
    runs = []
    try:
        for _ in range(3):  # each held after its HELLO, so that all three prefill together
            # the default cache (a quarter of the experts, no whole layer): the
            # prompt's layer calls, in one prefill step, miss more than a share
            r = infer_run(d.socket, prep, "-m", n, "--json")
            runs.append(r)
            wait_for(lambda: any(s["pid"] == r.pid for s in stats(d.socket)["sessions"]), 60,
                     "the session's HELLO")
            os.kill(r.pid, signal.SIGSTOP)
        assert stats(d.socket)["share"] == stats(d.socket)["arena"]["slot_count"] // 3
        for r in runs:
            os.kill(r.pid, signal.SIGCONT)
        seen = set()
        while any(r.poll() is None for r in runs):
            try:  # how many sessions shared the arena at once
                seen.add(len(stats(d.socket)["sessions"]))
            except TimeoutError:
                pass
            time.sleep(0.2)
        for r in runs:
            out, err = r.communicate()
            assert r.returncode == 0, err
            assert json.loads(out)["tokens"] == want
            assert "TOO_MANY" not in err and "iod" not in err, err
        st = stats(d.socket)
        slots = st["arena"]["slot_count"]
        assert st["counters"]["short_grants"] > 0  # waves were needed, and served
        assert st["counters"]["internal_errors"] == 0 and max(seen) == 3
        emit("waves", {"sessions": 3, "slots": slots, "share_of_3": slots // 3,
                       "sessions_at_once_max": max(seen), "tokens": n,
                       "short_grants": st["counters"]["short_grants"],
                       "demands": st["counters"]["demands"], "reads": st["counters"]["reads"]})
    finally:
        for r in runs:
            if r.poll() is None:
                os.kill(r.pid, signal.SIGCONT)
                r.kill()
        d.close()


# ---- 8.9 connections are capped; unread replies are bounded ----------------------------------


def _rss_mib(pid) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _fds(pid) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class Peers:
    """Many DEALER connections from this process, none of which reads."""

    def __init__(self):
        import resource

        import zmq

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # two descriptors a socket
        self.zmq = zmq
        self.ctx = zmq.Context()
        self.ctx.MAX_SOCKETS = 16384
        self.socks = []

    def connect(self, sock, n, rcvhwm=1000):
        out = []
        for _ in range(n):
            s = self.ctx.socket(self.zmq.DEALER)
            s.setsockopt(self.zmq.LINGER, 0)
            s.setsockopt(self.zmq.RCVHWM, rcvhwm)
            s.setsockopt(self.zmq.RCVBUF, 4096)
            s.connect(f"ipc://{sock}")
            out.append(s)
        self.socks += out
        return out

    def close(self):
        for s in self.socks:
            s.close()
        self.ctx.term()


def _raw_connect(path, wait_s=30):
    """A plain AF_UNIX connection; EAGAIN (the listen backlog is full) is retried."""
    import socket

    s = socket.socket(socket.AF_UNIX)
    s.setblocking(False)
    end = time.monotonic() + wait_s
    while True:
        try:
            s.connect(str(path))
            return s
        except BlockingIOError:
            if time.monotonic() > end:
                s.close()
                raise
            time.sleep(0.01)


def _ask_stats(socks):
    """A STATS on each; a client already refused has no peer to send to (a
    blocking send would wait for one forever): its request is dropped."""
    import zmq

    from shared import codec

    for s in socks:
        try:
            s.send_multipart(codec.encode(P.Stats(1)), zmq.NOBLOCK)
        except zmq.Again:
            pass


def _answered(socks, wait_s, quiet_s=5.0):
    """How many of ``socks`` got a reply: polled until all did, ``wait_s``
    passed, or (after a first one) none came for ``quiet_s`` seconds."""
    end = time.monotonic() + wait_s
    got = set()
    last = None
    while time.monotonic() < end and len(got) < len(socks):
        for i, s in enumerate(socks):
            if i not in got and s.poll(0):
                s.recv_multipart()
                got.add(i)
                last = time.monotonic()
        if last is not None and time.monotonic() - last > quiet_s:
            break
        time.sleep(0.05)
    return len(got)


def test_two_thousand_connections_are_capped_and_refused_cleanly(model):
    """1000 clients that complete the handshake, 1000 raw connections that
    never say a word, then 100 more clients: the daemon lives, refuses the
    100 at the handshake (none keeps retrying), keeps serving the session
    it had, and admits again once connections close."""
    from infer.runtime.client import IodClient
    from shared.fixtures import record_bytes

    d = Detached("--arena", "16M")  # --max-connections 1024 (the default)
    peers = Peers()
    raw = []
    c = IodClient(model, iod=str(d.socket))
    m = Manifest.load(model)
    try:
        assert c.read(1, [3])[3] == record_bytes(model, m.layer(1), 3)
        base_rss, base_fds = _rss_mib(d.pid), _fds(d.pid)
        first = peers.connect(d.socket, 1000)
        _ask_stats(first)
        assert _answered(first, 120, quiet_s=30) == 1000  # with the session: 1001 <= 1024
        for _ in range(1000):  # accepted by libzmq; no handshake ever
            raw.append(_raw_connect(d.socket))
        late = peers.connect(d.socket, 100)
        _ask_stats(late)
        wait_for(lambda: c.stats()["counters"]["refused_peers"] >= 100, 60, "100 refusals")
        # a few refused clients see the connection drop before the refusal
        # and retry once; none keeps retrying
        time.sleep(3)
        refused = c.stats()["counters"]["refused_peers"]
        time.sleep(3)
        st = c.stats()
        assert st["counters"]["refused_peers"] == refused
        assert _answered(late, 1) == 0  # refused at the handshake: no message passed
        peak_rss, peak_fds = _rss_mib(d.pid), _fds(d.pid)
        assert c.read(2, [5])[5] == record_bytes(model, m.layer(2), 5)  # still served
        for r in raw:
            r.close()
        raw = []
        for s in first:
            s.close()
        peers.socks = late
        wait_for(lambda: _fds(d.pid) < base_fds + 150, 60, "the connections closed")
        again = peers.connect(d.socket, 1)
        _ask_stats(again)
        assert _answered(again, 30) == 1  # admitted again
        assert st["counters"]["internal_errors"] == 0 and not gone(d.pid)
        emit("connections", {"connections": 2101, "cap": st["max_connections"],
                             "refused": st["counters"]["refused_peers"],
                             "daemon_fds": [base_fds, peak_fds],
                             "daemon_rss_mib": [round(base_rss, 1), round(peak_rss, 1)]})
    finally:
        for r in raw:
            r.close()
        c.close()
        peers.close()
        d.close()


def test_a_low_descriptor_limit_lowers_the_connection_cap(model):
    """Under a descriptor limit of 1024 the cap (1024 asked) would let
    libzmq meet EMFILE first and abort; the daemon lowers it to 768 and
    refuses the rest of 2000 clients connecting 100 at a time."""
    folder = short_dir("iodl-")
    sock = folder / "iod.sock"
    p = subprocess.run(["prlimit", "--nofile=1024:1024", PY, "-m", "iod.cli", "start", "--socket",
                        str(sock), "--arena", "16M"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    pid = int((folder / "iod.lock").read_text())
    log = (folder / "iod.log").read_text()
    assert "iod: --max-connections 1024 lowered to 768: the descriptor limit is 1024" in log
    peers = Peers()
    try:
        assert stats(sock)["max_connections"] == 768
        socks = []
        for _ in range(20):
            batch = peers.connect(sock, 100)
            _ask_stats(batch)
            socks += batch
            time.sleep(0.2)
        answered = _answered(socks, 60)
        assert not gone(pid)
        assert answered <= 768 and _fds(pid) < 1024
        for s in socks:
            s.close()
        peers.socks = []
        wait_for(lambda: _fds(pid) < 100, 60, "the connections closed")
        st = stats(sock)
        assert st["counters"]["refused_peers"] >= 2000 - 768
        emit("connections_low_fd_limit", {"fd_limit": 1024, "cap": 768, "clients": 2000,
                                          "answered": answered,
                                          "refused": st["counters"]["refused_peers"]})
    finally:
        peers.close()
        if not gone(pid):
            cli("stop", "--socket", sock, "--grace", "5")
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()


def test_unread_replies_do_not_grow_the_daemon(model):
    """60 sessions each send 300 STATS and read none (~100 MB of replies,
    ~5.6 KB each with 61 sessions to list): the daemon's RSS stays within
    64 MiB of its baseline (REPLY_HWM replies per peer, then dropped), and
    the session it serves meanwhile gets its records."""
    from infer.runtime.client import IodClient
    from shared import codec
    from shared.fixtures import record_bytes

    n_peers, per_peer = 60, 300
    d = Detached("--arena", "32M")  # 105 slots: a share of 1 for each of 61 sessions
    peers = Peers()
    c = IodClient(model, iod=str(d.socket))
    m = Manifest.load(model)
    try:
        c.read(0, [0])
        base = _rss_mib(d.pid)
        flood = peers.connect(d.socket, n_peers, rcvhwm=1)  # one message at a time, then none
        mhash = Manifest.load_with_hash(model)[1]
        for s in flood:  # a session each, so that STATS lists them all
            s.send_multipart(codec.encode(P.Hello(1, P.PROTOCOL_VERSION, os.getpid(), str(model),
                                                  mhash, 1, False)))
            assert s.poll(30000)
            assert isinstance(codec.decode(s.recv_multipart()), P.HelloOk)
        connected = _rss_mib(d.pid)
        reply_bytes = sum(len(f) for f in codec.encode(P.StatsOk(1, c.stats())))
        before = c.stats()["counters"]["requests"]
        for _ in range(per_peer):
            _ask_stats(flood)
        total = n_peers * per_peer
        peak = connected
        t = time.monotonic()
        layer = 0
        while True:
            peak = max(peak, _rss_mib(d.pid))
            st = c.stats()
            if st["counters"]["requests"] - before >= total:
                break
            assert time.monotonic() - t < 300, "the daemon stopped answering the flood"
            layer = (layer + 1) % 3
            e = layer * 5 % 16
            assert c.read(layer, [e])[e] == record_bytes(model, m.layer(layer), e)
            time.sleep(0.1)
        took = time.monotonic() - t
        assert not gone(d.pid) and st["counters"]["internal_errors"] == 0
        assert peak - base < 64, (base, connected, peak)
        emit("reply_flood", {"peers": n_peers, "requests": total, "reply_bytes": reply_bytes,
                             "replies_mb": round(total * reply_bytes / 1e6),
                             "rss_mib": {"baseline": round(base, 1),
                                         "sessions_connected": round(connected, 1),
                                         "peak": round(peak, 1)},
                             "seconds": round(took, 1)})
    finally:
        c.close()
        peers.close()
        d.close()


# ---- 8.10 identity across reconnects: a re-prepped folder ends the session -------------------


def _mlx_greedy_text(src, max_tokens, enough_chars):
    """mlx-lm's greedy text on the model folder, as `infer run` prints it,
    up to ``enough_chars`` characters (or ``max_tokens`` tokens)."""
    from mlx_lm import load as mlx_load
    from mlx_lm import stream_generate

    from infer.run import encode_prompt

    model, tokenizer = mlx_load(str(src))
    text = ""
    for r in stream_generate(model, tokenizer, encode_prompt(tokenizer, PROMPT),
                             max_tokens=max_tokens):
        text += r.text
        if len(text) > enough_chars:
            break
    return text


def _prep(src, dst, *extra):
    p = subprocess.run([PY, "-m", "infer.cli", "prep", "--model", str(src), "--out", str(dst),
                        "--no-progress", *extra], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr


@pytest.mark.parametrize("how", ["private", "restarted"])
def test_a_folder_re_prepped_under_a_session_ends_it_with_one_line(synth_model, tmp_path, how):
    """`infer run --iod auto` generates from a shared daemon; the prep
    folder is re-prepped in place with other weights (`infer prep --force`
    of another seed); the daemon is SIGKILLed and the session reconnects to
    a private daemon (``private``) or to the shared one restarted while the
    session was held (``restarted``). Both read the new manifest: the
    session ends with exit 1 and one line naming the change, and every
    character it printed is the old weights' text (as mlx-lm gives it)."""
    old_src, new_src = synth_model("qwen3_moe"), synth_model("qwen3_moe", seed=1)
    prep = tmp_path / "prep"
    _prep(old_src, prep)
    old_hash = Manifest.load_with_hash(prep)[1]
    n = 2000
    assert mlx_greedy_ids(new_src, 16) != mlx_greedy_ids(old_src, 16)  # other weights, other words
    budget = shared_budget(prep, n)
    d = Detached("--arena", "2M")
    env = dict(os.environ, IOD_RUN_DIR=str(d.folder))
    gen = subprocess.Popen([PY, "-m", "infer.cli", "run", "--model", str(prep), "--prompt", PROMPT,
                            "-m", str(n), "--mem-budget", budget],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert gen.stdout.readline() == "==========\n", gen.stderr.read()
        head = gen.stdout.read(8)  # generating, from the shared daemon
        assert [s["pid"] for s in stats(d.socket)["sessions"]] == [gen.pid]
        _prep(new_src, prep, "--force")  # in place, while the session generates
        new_hash = Manifest.load_with_hash(prep)[1]
        assert new_hash != old_hash
        os.kill(gen.pid, signal.SIGSTOP)  # held, so the daemon's death finds it mid-generation
        os.kill(d.pid, signal.SIGKILL)
        wait_for(lambda: gone(d.pid), 10, "the daemon's death")
        if how == "restarted":
            p, _ = cli("start", "--socket", d.socket, "--arena", "2M")
            assert p.returncode == 0, p.stderr
            d.pid = d.lock_pid()
        os.kill(gen.pid, signal.SIGCONT)
        rest, err = gen.communicate(timeout=120)
        assert gen.returncode == 1, err
        assert one_line(err) == (f"infer run: iod MODEL_CHANGED: {prep} changed since the "
                                 f"session loaded it: manifest hash {old_hash}, now {new_hash}; "
                                 f"load it again")
        printed = head + rest
        want_text = _mlx_greedy_text(old_src, n, len(printed))
        assert want_text.startswith(printed), (printed, want_text)  # no token of the new weights
        assert len(printed) < len(want_text)  # it ended before its last token
        if how == "restarted":  # the restarted daemon refused it, and still serves
            st = stats(d.socket)
            assert st["sessions"] == [] and [m["hash"] for m in st["models"]] == [new_hash]
        assert not [x for x in d.folder.iterdir() if x.is_dir()]  # no private daemon left
        emit("model_changed", {"mode": how, "chars_printed": len(printed)})
    finally:
        if gen.poll() is None:
            os.kill(gen.pid, signal.SIGCONT)
            gen.kill()
        d.close()
