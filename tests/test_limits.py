"""Limits and lifetimes (docs/reliability.md, section 8.6-8.9): each test
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
import sys
import time
from pathlib import Path

from shared import protocol as P
from tests.iod_fixtures import PY, Raw, short_dir, wait_for
from tests.test_run import PROMPT, mlx_greedy_ids, tiny_budget

E = P.ErrorCode


def cli(*args, timeout=60):
    t = time.monotonic()
    p = subprocess.run([PY, "-m", "iod.cli", *map(str, args)], capture_output=True, text=True,
                       timeout=timeout)
    return p, time.monotonic() - t


def emit(check, figures):
    print(json.dumps({"check": check, **figures}))


def one_line(text) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def gone(pid) -> bool:
    """Exited (a zombie nobody reaped counts: it holds nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def stats(sock) -> dict:
    r = Raw(sock)
    try:
        return r.rt(P.Stats(r.req())).stats
    finally:
        r.close()


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
        gen = infer_run(d.socket, prep, "-m", n, "--json", "--mem-budget", tiny_budget(prep))
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
                    timeout, "--mem-budget", tiny_budget(prep))
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
                            "--mem-budget", tiny_budget(prep)],
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
    gen = infer_run(d.socket, prep, "-m", n, "--json", "--mem-budget", tiny_budget(prep))
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
            r = infer_run(d.socket, prep, "-m", n, "--json", "--mem-budget", tiny_budget(prep))
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
