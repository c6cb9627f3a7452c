"""What one request or one process limit may cost the shared daemon
(docs/reliability.md, 8.12 and 8.13), performed for real:

- a HELLO naming a huge manifest (a 160,000-entry shape stalled the daemon
  26 s) is refused with BAD_MODEL while another session is answered;
- under a hard descriptor limit of 1024, `infer run` (and the private daemon
  it starts) works; below what the daemon needs, one line and exit 2.

Figures are printed as one JSON line per check (run with -s to see them)."""

import json
import os
import resource
import shutil
import subprocess
import time

import pytest

from infer.runtime.client import IodClient
from shared import blob
from shared import protocol as P
from shared.fixtures import PY, LiveDaemon, Raw, record_bytes, short_dir
from tests.test_run import PROMPT, mlx_greedy_ids
from tests.test_trust import emit, one_line

E = P.ErrorCode
STATS_BOUND_S = 5.0  # what another session's STATS may wait while a HELLO is handled


def _hostile(model, tmp_path, name, edit):
    """A copy of the fake prep folder whose manifest ``edit`` changed."""
    folder = tmp_path / name
    shutil.copytree(model, folder)
    d = json.loads((folder / blob.MANIFEST_NAME).read_text())
    edit(d)
    (folder / blob.MANIFEST_NAME).write_text(json.dumps(d, separators=(",", ":")))
    return folder


def _more_layers(d):
    d["layers"] = [dict(d["layers"][0], layer=i) for i in range(blob.MANIFEST_MAX_LAYERS + 1)]


CASES = {
    # a 2.2 MB manifest: old code multiplied 160,000 40-bit numbers (26 s here)
    "shape": (lambda d: d["layers"][0]["segments"][0].update(shape=[(1 << 40) - 1] * 160_000),
              "shape of 160000 dimensions, more than 8"),
    "values": (lambda d: d["layers"][0].update(num_experts=1 << 30,
                                                 checksums=["0"] * blob.MANIFEST_MAX_VALUES),
               f"more than {blob.MANIFEST_MAX_VALUES} values, the most a manifest may have"),
    "layers": (_more_layers, f"{blob.MANIFEST_MAX_LAYERS + 1} layers, more than "
                             f"{blob.MANIFEST_MAX_LAYERS}"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_hello_naming_a_huge_manifest_is_refused_and_stalls_nobody(model, tmp_path, case):
    """A session is live on the good model; a hostile peer says HELLO naming
    a folder whose manifest is huge; while the daemon handles it, the live
    session asks STATS: answered within STATS_BOUND_S, the HELLO refused with
    BAD_MODEL naming the bound, and the live session still reads the file's
    bytes."""
    edit, why = CASES[case]
    folder = _hostile(model, tmp_path, case, edit)
    d = LiveDaemon(args=["--arena", "16M"])
    hostile = Raw(d.socket)
    try:
        with IodClient(model, iod=str(d.socket)) as live:
            hello = P.Hello(hostile.req(), P.PROTOCOL_VERSION, os.getpid(), str(folder), "0" * 16,
                            1, False)
            t0 = time.monotonic()
            hostile.send(hello)
            time.sleep(0.2)  # the daemon is at it
            t = time.monotonic()
            st = live.stats()
            stats_s = time.monotonic() - t
            reply = hostile.until(hello.req_id, timeout=120)
            hello_s = time.monotonic() - t0
            assert stats_s < STATS_BOUND_S, f"STATS waited {stats_s:.1f} s behind the HELLO"
            assert isinstance(reply, P.Error) and reply.code == E.BAD_MODEL, reply
            assert why in reply.message and "\n" not in reply.message
            assert st["pid"] == d.proc.pid
            layout = live.manifest.layer(0)
            assert live.read(0, [5]) == {5: record_bytes(model, layout, 5)}
            assert live.stats()["counters"]["internal_errors"] == 0
        size = (folder / blob.MANIFEST_NAME).stat().st_size
        emit("huge_manifest", {"case": case, "manifest_bytes": size,
                               "stats_answered_s": round(stats_s, 3),
                               "hello_refused_s": round(hello_s, 3)})
    finally:
        hostile.close()
        d.stop()


def _nofile(limit):
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))


def test_infer_run_under_a_hard_descriptor_limit_of_1024(synth_model, prep_model):
    """mlx-lm's import asks for a hard limit of 4096; under 1024 that was a
    ValueError traceback before anything ran. Now the run and its private
    daemon work within the limit and give mlx-lm's tokens."""
    src, prep = synth_model("qwen3_moe"), prep_model("qwen3_moe")
    n = 16
    want = mlx_greedy_ids(src, n)
    p = subprocess.run([PY, "-m", "infer.cli", "run", "--model", str(prep), "--prompt", PROMPT,
                        "-m", str(n), "--json"], capture_output=True, text=True, timeout=300,
                       preexec_fn=_nofile(1024))
    assert "Traceback" not in p.stderr, p.stderr
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["tokens"] == want
    emit("nofile_1024", {"tokens": n, "rc": p.returncode})


def test_a_descriptor_limit_too_low_for_the_daemon_is_one_line_exit_2(prep_model):
    """Below what the daemon needs (FD_MIN), `iod start` and the private
    daemon of `infer run` refuse with one line naming the limit."""
    from iod.cli import FD_MIN

    low = FD_MIN - 16
    folder = short_dir("iodb-")
    try:
        p = subprocess.run([PY, "-m", "iod.cli", "start", "--socket", str(folder / "iod.sock"),
                            "--arena", "8M"], capture_output=True, text=True, timeout=60,
                           preexec_fn=_nofile(low))
        line = (f"the descriptor limit is {low} (ulimit -Hn): iod needs at least {FD_MIN} (its "
                f"own files, a blob file per MoE layer, two per session); raise it")
        assert p.returncode == 2 and one_line(p.stderr) == f"iod: {line}", p.stderr
        assert list(folder.iterdir()) == []  # nothing made
        p = subprocess.run([PY, "-m", "infer.cli", "run", "--model", str(prep_model("qwen3_moe")),
                            "--prompt", PROMPT, "-m", "4"], capture_output=True, text=True,
                           timeout=300, preexec_fn=_nofile(low))
        assert p.returncode == 2
        assert one_line(p.stderr) == f"infer run: cannot start a private iod: iod: {line}"
    finally:
        if (folder / "iod.lock").exists():  # started after all: stop it
            subprocess.run([PY, "-m", "iod.cli", "stop", "--socket", str(folder / "iod.sock")],
                           capture_output=True, timeout=60)
        shutil.rmtree(folder, ignore_errors=True)
