"""Pins have a deadline (docs/reliability.md, 8.11), with real processes: a
session that pinned the whole arena while it was alone and was then stopped
(SIGSTOP, as Ctrl-Z does) loses its pins once it has said nothing for
--pin-timeout while another waits for a slot; the other goes on; the stopped
one, continued, gets PINS_EXPIRED and uses none of what it copied (a streaming
session reconnects and fetches again by itself).

Figures are printed as one JSON line (run with -s to see them)."""

import json
import mmap
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

import native
from infer.runtime.client import IodClient, PinsExpired
from shared import protocol as P
from shared import slots as S
from shared.blob import Manifest, read_record
from shared.fixtures import PY, LiveDaemon, daemon_stats as stats, wait_for
from tests.test_limits import infer_run, shared_budget
from tests.test_run import mlx_greedy_ids
from tests.test_trust import emit

E = P.ErrorCode
ROOT = Path(__file__).resolve().parent.parent
PIN_TIMEOUT = 2.0

# The stopped session: alone on the daemon it demands layer 0 (32 records)
# and, while copying those, layer 1 (its share has 31 left): 63 of the 63
# slots pinned. Then it stops itself mid-copy; continued, it copies and
# returns, and says what the client raised and whether the bytes it copied
# were still the records; then it says HELLO again (reconnect) and reads.
HOG = r"""
import json, os, signal, sys
from infer.runtime.client import IodClient, IodError
from shared.blob import Manifest, read_record
prep, sock = sys.argv[1], sys.argv[2]
c = IodClient(prep, iod=sock)
m = Manifest.load(prep)
copied = {}

def inner(batch):
    print("HOLDING", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
    for i, e in enumerate(batch.experts):
        copied[e] = bytes(batch.record(i))

out = {"error": None}
try:
    c.fetch_into(0, list(range(32)), lambda batch: c.fetch_into(1, list(range(32)), inner))
except IodError as e:
    out.update(error=type(e).__name__, code=int(e.code), message=str(e))
out["copied"] = len(copied)
out["stale"] = sum(data != read_record(prep, m.layer(1), e) for e, data in copied.items())
c.reconnect()
out["reread_ok"] = c.read(1, list(range(32))) == {e: read_record(prep, m.layer(1), e)
                                                  for e in range(32)}
out["sessions"] = [[s["pid"] == os.getpid(), s["expired"]] for s in c.stats()["sessions"]]
c.close()
print(json.dumps(out), flush=True)
"""


def state(pid) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_stopped_session_holding_the_arena_loses_its_pins_and_never_reads_reused_slots(
        synth_model, prep_model):
    src, prep = synth_model("qwen3_moe"), prep_model("qwen3_moe")
    n = 24
    want = mlx_greedy_ids(src, n)
    d = LiveDaemon(args=["--arena", "2M", "--pin-timeout", str(PIN_TIMEOUT)])
    hog = subprocess.Popen([PY, "-c", HOG, str(prep), str(d.socket)], cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    gen = None
    try:
        assert hog.stdout.readline().strip() == "HOLDING", hog.stderr.read()
        wait_for(lambda: state(hog.pid) == "T", 10, "the session to stop")
        st = stats(d.socket)
        slots = st["arena"]["slot_count"]
        assert [s["pins"] for s in st["sessions"]] == [slots] == [63]

        # another session: its reads wait for a slot until the stopped one
        # has said nothing for PIN_TIMEOUT, then go on
        m = Manifest.load(prep)
        with IodClient(prep, iod=str(d.socket), progress_timeout=60) as other:
            t = time.monotonic()
            got = other.read(2, list(range(8)))
            waited = time.monotonic() - t
            assert got == {e: read_record(prep, m.layer(2), e) for e in range(8)}
        assert waited < PIN_TIMEOUT + 5  # the deadline, plus a loaded machine's slack
        st = stats(d.socket)
        hog_row = [s for s in st["sessions"] if s["pid"] == hog.pid]
        assert hog_row and hog_row[0]["expired"] and hog_row[0]["pins"] == 0
        assert st["counters"]["pins_expired"] == 1
        assert (f"held 63 slots, more than its share of 31, and said nothing for "
                f"{PIN_TIMEOUT:g} s while a read waited for a slot: its pins are taken back"
                in d.logtext())

        # a real session generates next to it, in the whole arena
        gen = infer_run(d.socket, prep, "-m", n, "--json", "--mem-budget", shared_budget(prep, n))
        out, err = gen.communicate(timeout=300)
        assert gen.returncode == 0, err
        assert json.loads(out)["tokens"] == want and err == ""
        reads = stats(d.socket)["counters"]["reads"]

        # continued, the stopped session copies its records (slots since
        # filled with others) and gets the typed error instead of them
        os.kill(hog.pid, signal.SIGCONT)
        out, err = hog.communicate(timeout=60)
        assert hog.returncode == 0, err
        res = json.loads(out.splitlines()[-1])
        assert res["error"] == "PinsExpired" and res["code"] == E.PINS_EXPIRED, res
        assert res["message"].startswith("iod PINS_EXPIRED: ")
        assert res["copied"] == 31
        # reconnect(): BYE (its row goes), HELLO again, the right bytes
        assert res["reread_ok"] and res["sessions"] == [[True, False]]
        st = stats(d.socket)
        assert st["sessions"] == []
        assert st["counters"]["internal_errors"] == 0
        emit("pin_deadline", {"slots": slots, "pin_timeout_s": PIN_TIMEOUT,
                              "other_waited_s": round(waited, 2), "tokens": n, "reads": reads,
                              "stale_records_copied": res["stale"],
                              "stopped_session_error": res["message"]})
    finally:
        if hog.poll() is None:
            os.kill(hog.pid, signal.SIGCONT)
            hog.kill()
        if gen is not None and gen.poll() is None:
            gen.kill()
        d.stop()



def test_a_slot_filled_again_under_a_copy_is_never_used(model):
    """Should a slot change under a session's copy while its row still says
    the pins are its own (a daemon that broke the rule), the generation check
    around the copy catches it: PinsExpired naming the record, never the
    bytes. The test plays that daemon: mid-copy it writes other bytes into
    the slot and publishes a new generation. (A generation that reads 0 for
    a moment, an eviction that lost to the pin, is no error.)"""
    d = LiveDaemon(args=["--arena", "16M"])
    try:
        with IodClient(model, iod=str(d.socket)) as c:
            fd = native.shm_open_rw(c.shm_name)
            try:
                mm = mmap.mmap(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)
            lay = S.Layout(c.slot_size, c.slot_count)

            def lost_eviction(batch):  # the check after the copy lands in its window
                at = lay.generation((int(batch.offsets[0]) - lay.data(0)) // lay.slot_size)
                held.append((at, native.load_u64(mm, at)))
                native.store_u64(mm, at, 0)

            held = []
            c.fetch_into(1, [3], lost_eviction)
            native.store_u64(mm, *held[0])  # and it gives the generation back
            copied = []

            def refill(batch):
                at = int(batch.offsets[0])
                gen = lay.generation((at - lay.data(0)) // lay.slot_size)
                mm[at: at + 16] = b"\xee" * 16
                native.store_u64(mm, gen, native.load_u64(mm, gen) + 1000)
                copied.append(bytes(batch.record(0)[:16]))

            with pytest.raises(PinsExpired) as e:
                c.fetch_into(1, [3], refill)
            assert copied == [b"\xee" * 16]  # the sink saw other bytes; the call refused them
            assert e.value.code == E.PINS_EXPIRED
            assert "layer 1 expert 3: slot " in str(e.value) and "was filled again" in str(e.value)
            mm.close()
    finally:
        d.stop()


def test_a_streaming_session_whose_pins_were_taken_back_carries_on(prep_model, synth_model):
    """A generating session whose pins the daemon takes back (it zeroes the
    session's owner word first, as for a stopped session) finds out at its
    next fetch, says BYE and HELLO again, fetches once more, and decodes
    mlx-lm's greedy ids to the end."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from infer.runtime.loader import load_streaming
    from tests.test_streaming import mlx_reference

    prep = prep_model("qwen3_moe")
    ids, want = mlx_reference(synth_model("qwen3_moe"))
    prompt = mx.array(ids)
    d = LiveDaemon(args=["--arena", "64M"])
    try:
        source = IodClient(prep, iod=str(d.socket))
        model, _, store = load_streaming(prep, source, int(source.manifest.expert_bytes * 0.15))
        got, first = [], source.session_id
        for i, (t, _) in enumerate(generate_step(prompt, model, max_tokens=len(want))):
            got.append(int(t))
            if i == 8:  # what the daemon does before it takes a session's pins back
                native.store_u64(source._pins_view, source._owner_off, 0)
        assert got == want
        assert store.stats["reconnects"] == 1 and source.session_id != first
        sessions = stats(d.socket)["sessions"]
        assert [s["pid"] for s in sessions] == [os.getpid()]
        source.close()
    finally:
        d.stop()
