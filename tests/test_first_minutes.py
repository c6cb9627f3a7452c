"""What a new user, or one coming from mlx-lm, meets first: the quickstart's
hand-over, the dtype and memory defaults, mlx_lm.generate's flags, signals
at any moment, and run figures that say what they count."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from shared.fixtures import shm_entries, short_dir, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "Write a list of colors: red, green, blue"


@pytest.fixture
def run_dir(monkeypatch):
    folder = short_dir("iodf-")
    monkeypatch.setenv("IOD_RUN_DIR", str(folder))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _daemons_under(folder):
    """Pids of the iod daemons whose command line names ``folder``."""
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                cmd = open(f"/proc/{p}/cmdline", "rb").read().decode(errors="replace")
            except OSError:
                continue
            if str(folder) in cmd and "iod.cli" in cmd:
                out.append(int(p))
    return out


def _left_behind(run_dir, daemons):
    """What a run left in its run dir, and the shared memory of its daemons
    (other tests' daemons have theirs)."""
    wait_for(lambda: not _daemons_under(run_dir), what="the private daemon gone")
    return sorted(p.name for p in run_dir.iterdir()), [n for d in daemons for n in shm_entries(d)]


# --- signals at any moment ------------------------------------------------------------------

EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}
LINE = {signal.SIGINT: "infer run: interrupted", signal.SIGTERM: "infer run: terminated",
        signal.SIGHUP: "infer run: hung up"}


@pytest.mark.parametrize("where", ["close", "stop"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signal_during_the_cleanup_waits_for_it(prep_model, run_dir, sig, where):
    """A signal that arrived while the session closed (as the run reached its
    last token) was raised in the middle of the close: the private daemon's
    run dir stayed. Sent here at the close's start and just before the run
    dir goes, twice: the run ends as that signal says, with nothing left."""
    code = textwrap.dedent(f"""
        import os, sys
        from infer.runtime import client
        from infer import run
        cls = client.IodClient
        name = {'close' if where == 'close' else '_stop_private'!r}
        real = getattr(cls, name)
        def signalled(self, *a):
            if self._private is not None or name == "close":
                print(self.daemon_pid, flush=True)
                os.kill(os.getpid(), {int(sig)})
                os.kill(os.getpid(), {int(sig)})
            return real(self, *a)
        setattr(cls, name, signalled)
        sys.exit(run.main(sys.argv[1:]))
    """)
    r = subprocess.run([sys.executable, "-c", code, "--model", str(prep_model("qwen3_moe")),
                        "-p", "hi", "-m", "4", "--json"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == EXIT[sig], r.stderr
    assert r.stderr.strip().splitlines() == [LINE[sig]], r.stderr
    daemon = int(r.stdout.split()[0])
    assert daemon > 0 and _left_behind(run_dir, [daemon]) == ([], [])


def test_repeated_signals_at_varied_moments_leave_nothing(prep_model, run_dir):
    """Ctrl-C, SIGTERM or SIGHUP, twice in a row, from the first token to
    past the end of the run: whatever the moment, no run dir, daemon or
    shared memory is left, and the exit says what happened."""
    prep = str(prep_model("qwen3_moe"))
    sigs = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]
    ends = set()
    for i in range(9):
        sig = sigs[i % 3]
        proc = subprocess.Popen([sys.executable, "-m", "infer.cli", "run", "--model", prep, "-p", "hi",
                                 "-m", "40", "--ignore-chat-template"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True, cwd=ROOT)
        try:
            assert proc.stdout.readline() == "==========\n", proc.stderr.read()
            daemons = _daemons_under(run_dir)
            time.sleep(0.06 * i)  # the moments spread over the generation and its end
            for _ in range(2):
                try:  # SIGTERM to the process alone, as `timeout` sends it; the others to the group
                    os.kill(proc.pid, sig) if sig == signal.SIGTERM else os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                time.sleep(0.02)
            rc = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        err = proc.stderr.read()
        # finished before the signal (0), stopped by it (one line), or hit
        # as the interpreter exited (the signal's default action)
        assert rc in (0, EXIT[sig], -sig), (i, rc, err)
        if rc == EXIT[sig]:
            assert err.strip().splitlines() == [LINE[sig]], err
        ends.add(rc)
        assert len(daemons) == 1 and _left_behind(run_dir, daemons) == ([], []), (i, sig, rc, err)
    assert ends & set(EXIT.values())  # some signals did stop a generation


# --- iod doctor under a run dir ---------------------------------------------------------------

def test_doctor_under_a_run_dir_sets_that_run_dirs_daemon_only(tmp_path):
    """With IOD_RUN_DIR set, the measurement is stored in that run dir and
    read by its daemon alone: before, it went to ~/.cache/iod/disk.json and
    set every later daemon's reader threads, whatever disk they read."""
    from shared import protocol as P
    from shared.fixtures import LiveDaemon, Raw

    mine, other = short_dir("iodd-"), short_dir("iodd-")
    env = {k: v for k, v in os.environ.items() if k != "IOD_DISK_PROFILE"}
    env.update(IOD_RUN_DIR=str(mine), XDG_CACHE_HOME=str(tmp_path / "cache"), HOME=str(tmp_path))
    try:
        r = subprocess.run([sys.executable, "-m", "iod.cli", "doctor", "--dir", str(tmp_path),
                            "--scratch", str(8 << 20), "--record-size", "65536", "--seconds", "0.05",
                            "--rounds", "1", "--depths", "1,2,3", "--json"],
                           capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 0, r.stderr
        knee = json.loads(r.stdout)["knee_depth"]
        assert (mine / "disk.json").is_file() and not (tmp_path / "cache").exists()
        assert f"stored in {mine / 'disk.json'}: iod under this IOD_RUN_DIR reads with {knee} threads" \
            in r.stderr, r.stderr
        for folder, workers in ((mine, knee), (other, 4)):  # 4: the default, no profile
            d = LiveDaemon(folder=folder, args=["--arena", "16M"],
                           env={**env, "IOD_RUN_DIR": str(folder)})
            try:
                assert Raw(d.socket).rt(P.Stats(1)).stats["workers"] == workers, folder
            finally:
                d.stop()
    finally:
        shutil.rmtree(mine, ignore_errors=True)
        shutil.rmtree(other, ignore_errors=True)


# --- the quickstart's hand-over ---------------------------------------------------------------

def test_the_commands_the_quickstart_and_readme_give_work_as_pasted(tmp_path):
    """After scripts/quickstart.sh, `infer ...` answered "command not found":
    the commands live in .venv, and nothing said to activate it. The
    quickstart's last lines, pasted into a fresh shell started elsewhere
    (no .venv on PATH), generate; the README says the same before its first
    `infer` command."""
    import re

    env = dict(os.environ, WORK=str(tmp_path / "work"), MAX_TOKENS="4")
    r = subprocess.run([os.path.join(ROOT, "scripts", "quickstart.sh")], capture_output=True, text=True,
                       timeout=600, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    pasted = [l.strip() for l in r.stdout.splitlines() if l.startswith("    ")]
    assert pasted[0].startswith("source ") and pasted[1].startswith("infer run "), r.stdout
    shell = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    shell["PATH"] = os.pathsep.join(p for p in shell["PATH"].split(os.pathsep) if ".venv" not in p)
    assert subprocess.run(["bash", "-c", "command -v infer"], env=shell, capture_output=True).returncode != 0
    out = subprocess.run(["bash", "-c", "\n".join(pasted[:1] + [pasted[1] + " -m 4"])], env=shell,
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.startswith("==========\n"), out.stderr

    readme = open(os.path.join(ROOT, "README.md")).read()
    blocks = re.findall(r"^```\n(.*?)^```", readme, re.S | re.M)
    lines = [l for b in blocks for l in b.splitlines()]
    first = next(i for i, l in enumerate(lines) if re.match(r"(infer|iod) ", l))
    assert "source .venv/bin/activate" in lines[:first], lines[:first]
