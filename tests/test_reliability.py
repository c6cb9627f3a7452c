"""Reliability and security (issue 8): each promise as a check that prints its
figures as one JSON line.

Every ``check_*`` function runs one promise at a given size and returns its
figures (a dict); it raises AssertionError when the promise is broken. The
``test_*`` functions run the fast CI sizes; ``scripts/soak.py`` runs the long
versions of the same functions. Figures: ``pytest -s tests/test_reliability.py``
(one ``{"check": ...}`` line per test) or ``python scripts/soak.py``.

No timing thresholds are asserted except the hard no-hang bound the promise
names (daemon crash: no call hangs more than 5 s); latency ratios are only
reported in CI (the machine is shared) and asserted by the soak.
"""

import json
import os
import random
import select
import shutil
import signal
import socket as pysocket
import stat
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest

from shared import protocol as P
from shared.blob import Manifest, manifest_hash
from shared.fixtures import (LiveDaemon, Raw, make_prep, record_bytes, shm_entries,
                                short_dir, slot_bytes, unpin_refs, wait_for)

E = P.ErrorCode
PY = sys.executable
ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Write a list of colors: red, green, blue"  # as tests/test_run.py


LAST = {}  # the latest figures of each check, also when it then fails
# scripts/soak.py runs these tests at full size: its sizes come as JSON here
SIZES = json.loads(os.environ.get("RELIABILITY_SIZES", "{}"))


def size(name, ci):
    return type(ci)(SIZES.get(name, ci))


def emit(check, figures):
    """Print one JSON line of figures and return them."""
    out = {"check": check, **figures}
    LAST[check] = out
    print(json.dumps(out, sort_keys=False), flush=True)
    return out


def _env(**kw):
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e.update({k: str(v) for k, v in kw.items()})
    return e


def stats(sock):
    r = Raw(sock)
    try:
        return r.rt(P.Stats(r.req()), timeout=30).stats
    finally:
        r.close()


def rss_kb(pid):
    """(RssAnon, RssShmem) of a process in KiB, from /proc."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("RssAnon", "RssShmem"):
                out[k] = int(v.split()[0])
    return out.get("RssAnon", 0), out.get("RssShmem", 0)


def pct(values, q):
    if not values:
        return 0.0
    v = sorted(values)
    return v[min(len(v) - 1, int(q / 100.0 * len(v)))]


def readline(proc, timeout):
    """One line of a child's stdout, or AssertionError after ``timeout`` s."""
    r, _, _ = select.select([proc.stdout], [], [], timeout)
    if not r:
        raise AssertionError(f"no output from pid {proc.pid} in {timeout} s")
    return proc.stdout.readline()


def kill(proc):
    if proc is not None and proc.poll() is None:
        proc.kill()
    if proc is not None:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            pass


# ---- the generating session -----------------------------------------------------

# A session that generates greedily through the Python API, one JSON line per
# token ({"tok": i}) and one per generation ({"gen": i, "tokens": [...], ...}).
# argv: prep iod max_tokens stop_file generations(-1: until stop_file) cache_bytes trace
GEN_SCRIPT = r"""
import json, os, sys, time
from mlx_lm import stream_generate
from infer.runtime.client import IodClient, IodError
from infer.runtime.loader import load_streaming
from infer.run import encode_prompt
prep, iod, n, stop, gens, cache, trace = sys.argv[1:8]
n, gens, cache = int(n), int(gens), int(cache)
PROMPT = "Write a list of colors: red, green, blue"
src = IodClient(prep, iod=iod)
model, tok, store = load_streaming(prep, src, cache or None)
if os.environ.get("GEN_DEPTH"):  # 0: no prediction, every read a demand
    store.prefetcher.depth = int(os.environ["GEN_DEPTH"])
calls = [0.0]
orig = store.call_source
def timed(*a, **k):
    t = time.monotonic()
    try:
        return orig(*a, **k)
    finally:
        calls[0] = max(calls[0], time.monotonic() - t)
store.call_source = timed
print(json.dumps({"ready": True, "daemon_pid": src.daemon_pid}), flush=True)
ids = encode_prompt(tok, PROMPT)
g = 0
while gens < 0 or g < gens:
    if gens < 0 and os.path.exists(stop):
        break
    out, r, err, gap, last = [], None, None, 0.0, time.monotonic()
    if trace == "1":
        store.trace = []
    calls[0] = 0.0
    try:
        for i, r in enumerate(stream_generate(model, tok, ids, max_tokens=n)):
            now = time.monotonic()
            gap, last = max(gap, now - last), now
            out.append(r.token)
            print(json.dumps({"tok": i}), flush=True)
        if r is not None and r.finish_reason == "stop":
            out.pop()
    except IodError as e:
        err = {"message": str(e), "code": int(e.code) if e.code is not None else None,
               "layer": e.layer, "expert": e.expert, "dead": type(e).__name__ == "DaemonDead"}
    used = {}
    for layer, experts in store.trace or []:
        used.setdefault(layer, set()).update(experts)
    print(json.dumps({"gen": g, "tokens": out, "error": err, "max_call_s": calls[0],
                      "max_gap_s": gap, "reconnects": store.stats.get("reconnects", 0),
                      "daemon_pid": src.daemon_pid,
                      "used": {str(l): sorted(int(x) for x in e) for l, e in used.items()}}),
          flush=True)
    g += 1
src.close()
"""


def generator(prep, iod, n, stop="-", gens=1, cache=1, trace=False, env=None):
    """Start a generating session; returns the Popen after its ready line."""
    p = subprocess.Popen([PY, "-c", GEN_SCRIPT, str(prep), str(iod), str(n), str(stop),
                          str(gens), str(cache), "1" if trace else "0"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env or _env(), cwd=ROOT)
    line = readline(p, 120)
    if not line:
        raise AssertionError(f"generator died: {p.stderr.read()}")
    p.ready = json.loads(line)
    return p


def gen_results(p, timeout=300):
    """The {"gen": ...} lines of a generator, after it exits."""
    out, _ = p.communicate(timeout=timeout)
    assert p.returncode == 0, (p.returncode, p.stderr.read() if p.stderr else "")
    return [json.loads(l) for l in out.splitlines() if l.startswith('{"gen"')]


_EXPECTED = {}


def expected_ids(src, n):
    """mlx-lm's greedy tokens with the whole model in memory (the uninterrupted run)."""
    key = (str(src), n)
    if key not in _EXPECTED:
        from tests.test_run import mlx_greedy_ids

        _EXPECTED[key] = mlx_greedy_ids(src, n)
    return _EXPECTED[key]


# ---- 1. session crash -----------------------------------------------------------

# A session that pins, prefetches and fetches random records until it is killed.
VICTIM_SCRIPT = r"""
import random, sys, time
from infer.runtime.client import IodClient
from shared.blob import Manifest
prep, sock, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
rnd = random.Random(seed)
m = Manifest.load(prep)
c = IodClient(prep, iod=sock)
print("ready", flush=True)
while True:
    l = rnd.choice(m.layers)
    ex = rnd.sample(range(l.num_experts), rnd.randint(1, min(8, l.num_experts)))
    op = rnd.random()
    if op < 0.3:
        c.prefetch(l.layer, ex)
        c.poll()
    else:  # pinned while the sink runs: a kill often lands then
        c.fetch_into(l.layer, ex, lambda batch: time.sleep(rnd.uniform(0, 0.01)))
"""


def arena_consistent(st, live_pids):
    """No session of a dead process; slot states add up; pinned slots are
    pinned by live sessions."""
    pids = {s["pid"] for s in st["sessions"]}
    assert pids <= set(live_pids), f"sessions of dead pids: {pids - set(live_pids)}"
    slots = st["arena"]["slots"]
    if slots:
        assert sum(slots.values()) == st["arena"]["slot_count"], slots
        assert slots["ready_pinned"] <= sum(s["pins"] for s in st["sessions"]), (slots, st["sessions"])


def check_session_crash(src, prep, rounds=20, seed=0, infer_every=10, n_tokens=24):
    rnd = random.Random(seed)
    folder = short_dir("iodrc-")
    d = LiveDaemon(folder, args=["--arena", "32M"])
    sock = d.socket
    env = _env(IOD_RUN_DIR=folder)
    expected = expected_ids(src, n_tokens)
    stop = folder / "stop"
    gen = victim = None
    reclaim_ms, kinds = [], {"client": 0, "infer": 0}
    try:
        gen = generator(prep, sock, n_tokens, stop, gens=-1, cache=1, env=env)
        for r in range(rounds):
            kind = "infer" if infer_every and r % infer_every == infer_every - 1 else "client"
            kinds[kind] += 1
            if kind == "infer":
                victim = subprocess.Popen(
                    [PY, "-m", "infer.cli", "run", "--model", str(prep), "--iod", str(sock),
                     "--prompt", PROMPT, "--max-tokens", "100000", "--ignore-chat-template"],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
                assert readline(victim, 120) is not None
                time.sleep(rnd.uniform(0, 1.0))
            else:
                victim = subprocess.Popen([PY, "-c", VICTIM_SCRIPT, str(prep), str(sock),
                                           str(seed * 1000 + r)], stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
                assert readline(victim, 120).strip() == "ready", victim.stderr.read()
                time.sleep(rnd.uniform(0, 0.3))
            assert victim.poll() is None, victim.stderr.read()
            assert gen.poll() is None, gen.stderr.read()
            assert victim.pid in {s["pid"] for s in stats(sock)["sessions"]}
            t0 = time.monotonic()
            victim.send_signal(signal.SIGKILL)
            poll = Raw(sock)  # STATS every ~2 ms until the session is gone
            try:
                while victim.pid in {s["pid"] for s in poll.rt(P.Stats(poll.req()), 30).stats["sessions"]}:
                    assert time.monotonic() - t0 < 30, "the killed session was never dropped"
                    time.sleep(0.002)
            finally:
                poll.close()
            reclaim_ms.append((time.monotonic() - t0) * 1e3)
            victim.wait()
            victim = None
            arena_consistent(stats(sock), {gen.pid})
        stop.touch()
        results = gen_results(gen)
        gen = None
        assert results, "the generating session produced nothing"
        wrong = [g["gen"] for g in results if g["tokens"] != expected or g["error"]]
        assert not wrong, f"generations {wrong} differ from the uninterrupted tokens"
        wait_for(lambda: not stats(sock)["sessions"], what="all sessions gone")
        st = stats(sock)
        arena_consistent(st, set())
        assert st["arena"]["slots"]["ready_pinned"] == 0 and st["arena"]["slots"]["filling"] == 0
        assert st["counters"]["internal_errors"] == 0
        assert d.proc.poll() is None
        return emit("session_crash", {
            "rounds": rounds, "victims": kinds, "generations": len(results),
            "tokens_equal": True, "pins_leaked": 0,
            "reclaim_ms": {"p50": round(pct(reclaim_ms, 50), 1),
                           "p99": round(pct(reclaim_ms, 99), 1),
                           "max": round(max(reclaim_ms), 1)},
        })
    finally:
        kill(victim)
        kill(gen)
        d.stop()
        shutil.rmtree(folder, ignore_errors=True)


# ---- 2. daemon crash ------------------------------------------------------------

def _stale(folder, pids):
    """What dead daemons left: their shm segments, private dirs, sockets."""
    left = [n for pid in pids for n in shm_entries(pid)]
    left += [str(p) for p in Path(folder).glob("p*")]
    return left


def check_daemon_crash(src, prep, n_tokens=96, kill_points=(8,),
                       modes=("private", "shared", "shared_restarted", "socket_restarted")):
    """SIGKILL the daemon of a generating session after token k (k in
    ``kill_points``; -1: as soon as the session is up), for each mode."""
    expected = expected_ids(src, n_tokens)
    figures = {}
    worst_call = worst_gap = 0.0
    runs = 0
    for mode, kill_after in [(m, k) for k in kill_points for m in modes]:
        folder = short_dir("iodrd-")
        env = _env(IOD_RUN_DIR=folder)
        d = d2 = gen = None
        try:
            if mode != "private":
                d = LiveDaemon(folder, args=["--arena", "64M"])
            iod = str(d.socket) if mode == "socket_restarted" else "auto"  # then no private daemon
            gen = generator(prep, iod, n_tokens, gens=1, cache=1, env=env)
            first = gen.ready["daemon_pid"]
            if mode == "private":
                assert d is None and first > 0
            else:
                assert first == d.pid, "the session did not use the shared daemon"
            while kill_after >= 0 and json.loads(readline(gen, 120)).get("tok", -1) < kill_after:
                pass
            if mode.endswith("_restarted"):
                # a supervisor restarts the daemon before the session's next
                # call (the session is held still meanwhile): it must attach there
                os.kill(gen.pid, signal.SIGSTOP)
            os.kill(first, signal.SIGKILL)
            if d is not None:
                d.proc.wait()
            if mode.endswith("_restarted"):
                try:
                    d2 = LiveDaemon(folder, args=["--arena", "64M"])
                finally:
                    os.kill(gen.pid, signal.SIGCONT)
            (res,) = gen_results(gen)
            gen = None
            assert res["error"] is None, res["error"]
            assert res["tokens"] == expected, "tokens differ from an uninterrupted run"
            assert res["reconnects"] >= 1 and res["daemon_pid"] != first
            assert res["max_call_s"] < 5.0, f"a call hung {res['max_call_s']:.2f} s"
            worst_call = max(worst_call, res["max_call_s"])
            if not mode.endswith("_restarted"):  # there the session was held still on purpose
                worst_gap = max(worst_gap, res["max_gap_s"])
            if mode.endswith("_restarted"):
                assert res["daemon_pid"] == d2.pid, "the session did not attach to the restarted daemon"
            if mode == "shared":  # the restart comes after the session is done
                d2 = LiveDaemon(folder, args=["--arena", "64M"])
            if d2 is not None:
                # the fresh daemon owns socket and lock; nothing of the dead one is left
                assert int((folder / "iod.lock").read_text()) == d2.pid
                assert stats(d2.socket)["pid"] == d2.pid
                assert d2.shm_name() in ["/" + n for n in shm_entries(d2.pid)]
            gone = [first] + [res["daemon_pid"]] * (res["daemon_pid"] != getattr(d2, "pid", 0))
            left = _stale(folder, gone)
            assert not left, f"stale after the restart: {left}"
            f = figures.setdefault(mode, {"runs": 0, "max_call_s": 0.0, "new_daemon": []})
            f["runs"] += 1
            runs += 1
            f["max_call_s"] = round(max(f["max_call_s"], res["max_call_s"]), 3)
            new = "shared" if res["daemon_pid"] == getattr(d2, "pid", 0) else "private"
            if new not in f["new_daemon"]:
                f["new_daemon"].append(new)
        finally:
            kill(gen)
            for x in (d, d2):
                if x is not None:
                    x.stop()
            shutil.rmtree(folder, ignore_errors=True)
    return emit("daemon_crash", {"runs": runs, "kill_after_tokens": list(kill_points),
                                 "modes": figures, "tokens_equal": True,
                                 "max_call_s": round(worst_call, 3), "bound_s": 5.0,
                                 "max_token_gap_s": round(worst_gap, 3), "stale": 0})


# ---- 3. corruption --------------------------------------------------------------

_CLEAN = {}


def clean_run(src, prep, n_tokens=16):
    """One uninterrupted generation on a private daemon: its tokens (checked
    against mlx-lm) and the experts it used per layer."""
    key = (str(prep), n_tokens)
    if key not in _CLEAN:
        folder = short_dir("iodrk-")
        try:
            gen = generator(prep, "auto", n_tokens, gens=1, cache=1, trace=True,
                            env=_env(IOD_RUN_DIR=folder))
            (res,) = gen_results(gen)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        assert res["error"] is None and res["tokens"] == expected_ids(src, n_tokens)
        _CLEAN[key] = (res["tokens"], {int(l): e for l, e in res["used"].items()})
    return _CLEAN[key]


def _record_off(layout, expert):
    return expert * layout.stride


def corrupt_copy(prep, dst, kind, layer, expert, other=None):
    """A copy of ``prep`` with one fault written into layer ``layer``."""
    shutil.copytree(prep, dst)
    lay = Manifest.load(dst).layer(layer)
    path = dst / lay.file
    with open(path, "r+b") as f:
        off = _record_off(lay, expert)
        if kind == "bitflip":
            for bit in (7, 1000 * 8 + 3, (lay.record_bytes - 1) * 8):
                f.seek(off + bit // 8)
                b = f.read(1)[0]
                f.seek(off + bit // 8)
                f.write(bytes([b ^ (1 << (bit % 8))]))
        elif kind == "swap":
            a = os.pread(f.fileno(), lay.stride, off)
            b = os.pread(f.fileno(), lay.stride, _record_off(lay, other))
            os.pwrite(f.fileno(), b, off)
            os.pwrite(f.fileno(), a, _record_off(lay, other))
        elif kind == "zeropage":
            page = min(4096, lay.record_bytes)
            os.pwrite(f.fileno(), bytes(page), off + (lay.record_bytes // 2) // 4096 * 4096
                      if lay.record_bytes > 8192 else off)
        elif kind == "truncate":
            f.truncate(_record_off(lay, expert) + lay.record_bytes // 2)
    return dst


def check_corruption(src, prep, workdir, n_tokens=16):
    tokens, used = clean_run(src, prep, n_tokens)
    layers = sorted(used)
    workdir = Path(workdir)
    pick = lambda l, i=0: used[l][i % len(used[l])]  # noqa: E731
    la, lb, lc, ld = (layers[i % len(layers)] for i in range(4))
    cases = {
        "bitflip": (la, pick(la), None),
        "swap": (lb, pick(lb), pick(lb, 1) if len(used[lb]) > 1 else (pick(lb) + 1) % 16),
        "zeropage": (lc, pick(lc, 2), None),
        "truncate": (ld, Manifest.load(prep).layer(ld).num_experts - 1, None),
    }
    folder = short_dir("iodrx-")
    d = LiveDaemon(folder, args=["--arena", "32M"])
    faulty = None
    figures = {}
    try:
        env = _env(IOD_RUN_DIR=folder)
        for name, (layer, expert, other) in cases.items():
            copy = corrupt_copy(prep, workdir / name, name, layer, expert, other)
            gen = generator(copy, d.socket, n_tokens, gens=1, cache=1, env=env) \
                if name != "truncate" else None
            if gen is None:  # refused at HELLO: the generator never says ready
                p = subprocess.run([PY, "-c", GEN_SCRIPT, str(copy), str(d.socket),
                                    str(n_tokens), "-", "1", "1", "0"], capture_output=True,
                                   text=True, env=env, cwd=ROOT, timeout=120)
                assert p.returncode != 0 and not p.stdout.strip()
                msg = p.stderr.strip().splitlines()[-1]
                assert "BAD_MODEL" in msg and f"layer {layer}" in msg and lay_file(copy, layer) in msg, msg
                figures[name] = {"layer": layer, "error": msg[-160:]}
                continue
            (res,) = gen_results(gen)
            err = res["error"]
            assert err is not None, f"{name}: corrupted record not detected"
            assert err["code"] == E.CHECKSUM, err
            named = {expert, other} - {None}
            assert err["layer"] == layer and err["expert"] in named, (err, layer, named)
            assert f"layer {layer} expert {err['expert']}" in err["message"], err["message"]
            # never a wrong token: what came out before the error is the clean run's prefix
            assert res["tokens"] == tokens[: len(res["tokens"])]
            figures[name] = {"layer": layer, "expert": err["expert"], "code": "CHECKSUM",
                             "tokens_before_error": len(res["tokens"])}
        # the CLI: exit 1, one clear line naming layer and expert, no JSON on stdout
        p = subprocess.run([PY, "-m", "infer.cli", "run", "--model", str(workdir / "bitflip"),
                            "--iod", str(d.socket), "--prompt", PROMPT, "--max-tokens",
                            str(n_tokens), "--json"], capture_output=True, text=True, env=env,
                           cwd=ROOT, timeout=120)
        la_, ea_ = cases["bitflip"][:2]
        assert p.returncode == 1 and not p.stdout.strip(), (p.returncode, p.stdout, p.stderr)
        assert f"layer {la_} expert {ea_}" in p.stderr and "CHECKSUM" in p.stderr, p.stderr
        figures["cli"] = {"exit": p.returncode, "stderr": p.stderr.strip().splitlines()[-1][-160:]}
        c = stats(d.socket)["counters"]
        assert c["internal_errors"] == 0 and d.proc.poll() is None
        figures["daemon"] = {"checksum_errors": c["checksum_errors"], "retries": c["retries"]}
        # transient: the record is corrupted once in the reader, read again, fine
        tl, te = la, pick(la)
        faulty = LiveDaemon(short_dir("iodry-"), args=["--arena", "32M"],
                            env={"IOD_FAULTS": f"corrupt:{tl}:{te}:1"})
        gen = generator(prep, faulty.socket, n_tokens, gens=1, cache=1, env=env)
        (res,) = gen_results(gen)
        assert res["error"] is None and res["tokens"] == tokens
        c = stats(faulty.socket)["counters"]
        assert c["retries"] == 1 and c["checksum_errors"] == 1, c
        figures["transient"] = {"layer": tl, "expert": te, "retries": c["retries"],
                                "tokens_equal": True}
        return emit("corruption", {"cases": figures, "wrong_tokens": 0})
    finally:
        d.stop()
        if faulty is not None:
            faulty.stop()
            shutil.rmtree(faulty.folder, ignore_errors=True)
        shutil.rmtree(folder, ignore_errors=True)


def lay_file(prep, layer):
    return Manifest.load(prep).layer(layer).file


# ---- 4. disk errors -------------------------------------------------------------

BLOCKERS = 10  # records read ahead of each faulted one (3 MB: 0.5 s past the burst)


def check_disk_errors(workdir, rounds=3, waiters=3):
    """``rounds`` records per kind fail (eio, short); each has ``waiters``
    sessions asking for it (DEMANDs, and one PREFETCH hint, which hears
    nothing: its session holds nothing and reads the record again later).

    So that every waiter surely attaches to the failing read, the first one
    asks for BLOCKERS records never read before just ahead of it (same
    session: FIFO), at a 2 MB/s emulated read rate (a burst of 2 MB is
    allowed): the faulted read starts ≥ 0.5 s after the requests are sent.
    The daemon's ``coalesced`` counter proves the attach."""
    n_faults = 2 * rounds
    model = Path(workdir) / "diskfaults"
    make_prep(model, records=(300_000,), num_experts=n_faults * (1 + BLOCKERS), seed=4)
    lay = Manifest.load(model).layers[0]
    rules, targets = [], []
    for i in range(rounds):
        for kind in ("eio", "short"):
            e = len(targets)
            rules.append(f"{kind}:{lay.layer}:{e}:1")
            targets.append((kind, e))
    d = LiveDaemon(args=["--arena", "16M", "--workers", "2", "--read-rate", "2"],
                   env={"IOD_FAULTS": ",".join(rules)})
    raws = []
    try:
        raws = [Raw(d.socket) for _ in range(waiters)]
        hellos = [r.hello(model) for r in raws]
        typed = attached = 0
        for kind, e in targets:
            blockers = list(range(n_faults + e * BLOCKERS, n_faults + (e + 1) * BLOCKERS))
            before = stats(d.socket)["counters"]["coalesced"]
            r0, h0 = raws[0], hellos[0]
            r0.send(P.Demand(2000 + e, h0.model_id, lay.layer, blockers, 1))
            for r, h in zip(raws[: waiters - 1], hellos):
                r.send(P.Demand(1000 + e, h.model_id, lay.layer, [e], 1))
            # every demand after the first joined its read (the read has not started)
            attached += stats(d.socket)["counters"]["coalesced"] - before
            r, h = raws[-1], hellos[-1]  # and a hint for it, which hears nothing
            r.send(P.Prefetch(r.req(), h.model_id, 0, [P.Hint(lay.layer, [e], 1)]))
            for i, r in enumerate(raws[: waiters - 1]):
                err = r.until(1000 + e, 60)
                assert isinstance(err, P.Error), (kind, e, i, err)
                assert f"layer {lay.layer} expert {e}" in err.message, err.message
                got = (err.code, err.layer, err.expert)
                assert got == (E.IO_ERROR, lay.layer, e), (kind, i, got)
                typed += 1
            ok = r0.until(2000 + e, 60)
            assert isinstance(ok, P.DemandOk), ok
            unpin_refs(h0, ok.refs)
            assert d.proc.poll() is None
            # the next read of the record works and holds the file's bytes
            ok = r0.rt(P.Demand(r0.req(), h0.model_id, lay.layer, [e], 2), 60)
            assert isinstance(ok, P.DemandOk), ok
            assert slot_bytes(d, h0, ok.refs[0]) == record_bytes(model, lay, e)
            unpin_refs(h0, ok.refs)
        st = stats(d.socket)
        c = st["counters"]
        assert attached == len(targets) * (waiters - 2), f"only {attached} demands attached"
        assert c["internal_errors"] == 0 and c["read_errors"] == len(targets)
        assert all(s["awaiting"] == 0 and s["pins"] == 0 for s in st["sessions"]), st["sessions"]
        for r in raws:
            r.rt(P.Bye(r.req()))
        return emit("disk_errors", {"faults": len(targets), "kinds": ["eio", "short"],
                                    "waiters_per_fault": waiters, "attached": attached,
                                    "typed_errors": typed,
                                    "missing_errors": len(targets) * (waiters - 1) - typed,
                                    "reread_ok": len(targets), "daemon_alive": True,
                                    "read_errors": c["read_errors"]})
    finally:
        for r in raws:
            r.close()
        d.stop()
        shutil.rmtree(d.folder, ignore_errors=True)
        shutil.rmtree(model, ignore_errors=True)


def check_disk_error_session(src, prep):
    """End to end: an injected EIO on a record the generation needs fails
    the session with IO_ERROR naming layer and expert; the next session on
    the same daemon generates the uninterrupted tokens. Without prediction:
    a prefetch that meets the fault fails silently and the demand reads the
    record again, fine (the fault spent)."""
    tokens, used = clean_run(src, prep)
    layer = sorted(used)[-1]
    expert = used[layer][0]
    d = LiveDaemon(short_dir("iodre-"), args=["--arena", "32M"],
                   env={"IOD_FAULTS": f"eio:{layer}:{expert}:1"})
    try:
        env = _env(IOD_RUN_DIR=d.folder, GEN_DEPTH=0)
        gen = generator(prep, d.socket, len(tokens), gens=1, cache=1, env=env)
        (res,) = gen_results(gen)
        err = res["error"]
        assert err and err["code"] == E.IO_ERROR and (err["layer"], err["expert"]) == (layer, expert)
        assert f"layer {layer} expert {expert}" in err["message"]
        assert res["tokens"] == tokens[: len(res["tokens"])]
        gen = generator(prep, d.socket, len(tokens), gens=1, cache=1, env=env)
        (res2,) = gen_results(gen)
        assert res2["error"] is None and res2["tokens"] == tokens
        assert d.proc.poll() is None
        return {"layer": layer, "expert": expert, "first": "IO_ERROR", "second": "tokens equal"}
    finally:
        d.stop()
        shutil.rmtree(d.folder, ignore_errors=True)


# ---- 5. hostile protocol input --------------------------------------------------

def _b(x):
    return msgpack.packb(x, use_bin_type=True)


def hostile_corpus(mid, model_dir):
    """Hand-written hostile frames (beyond tests/test_iod_hostile.py's typed cases)."""
    v, pid = P.PROTOCOL_VERSION, os.getpid()
    mh = manifest_hash(model_dir)
    deep = b"\x91" * 5000 + b"\x00"  # [[[...0...]]], deeper than any packer makes

    def demand(**kw):
        return _b({"req_id": 1, "model_id": mid, "layer": 0, "experts": [0], "now": 1, **kw})

    def hello(req_id, **kw):
        return _b({"req_id": req_id, "version": v, "pid": pid, "model_dir": str(model_dir),
                   "manifest_hash": mh, "working_set": 1, "profile": False, **kw})

    return [
        [b""], [b"", b""], [b"\x08\x08", _b({})], [b"\x08", b"\xc1"],  # 0xc1: never used
        [b"\x08", b"\x81"],  # a map that promises an entry
        [b"\x08", deep], [b"\x06", b"\x81\xa6req_id" + deep],
        [b"\x08", b"\xdd\xff\xff\xff\xff"],  # array32 of 4G entries, no data
        [b"\x08", b"\xdf\xff\xff\xff\xff"],  # map32 of 4G entries
        [b"\x08", b"\xdb\xff\xff\xff\xff" + b"x" * 10],  # str32 longer than the frame
        [b"\x08", demand(extra=1)],
        [b"\x08", demand(req_id=2 ** 64 - 1)],
        [b"\x08", demand(experts=[2 ** 63])],
        [b"\x08", demand(layer=0.0)],
        [b"\x08", demand(now=-(2 ** 63))],
        [b"\x08", _b({b"req_id": 5, "model_id": mid, "layer": 0, "experts": [0],
                      "now": 1})],  # bytes key
        [b"\x08", _b({1: 5})], [b"\x08", _b([1, 2, 3])], [b"\x08", _b(None)],
        [b"\x08", b"\x81\xa6req_id\xc7\x0c\xff" + b"\x00" * 12],  # a timestamp ext
        [b"\x08", b"\x81\xa6req_id\xc7\x05\xff" + b"\x00" * 5],  # a malformed timestamp
        [b"\x25", _b({"req_id": 6, "layer": 0, "stamps": [],  # a reply sent as a request
                      "refs": [{"expert": 0, "slot": 2 ** 64 - 1, "generation": 1, "size": 1}]})],
        [b"\x04", _b({"req_id": 7, "slots": [[-1, -1]]})],  # retired kinds
        [b"\x05", _b({"req_id": 8, "model_id": mid, "layer": 0})],
        [b"\x02", _b({"req_id": 9, "model_id": mid, "layer": 0, "experts": list(range(16)) * 50,
                      "now": 0, "due": 2 ** 63 - 1})],
        [b"\x01", hello(10, model_dir="/proc/self/root" + str(model_dir))],
        [b"\x01", hello(11, model_dir="\x00")],
        [b"\x01", hello(12, pid=2 ** 31)],
        [b"\x01", hello(13, pid=1)],
        [b"\x01", hello(14, working_set=2 ** 62)],
        [b"\x06", b"\x00" * ((1 << 20) + 100)],  # over the codec's limit
        [b"\x07", _b({"req_id": 15})] * 1,  # BYE without a session
    ]


def _rand_value(rnd, depth=0):
    r = rnd.random()
    if depth > 3 or r < 0.45:
        return rnd.choice([0, 1, -1, 2 ** 31, 2 ** 63 - 1, -(2 ** 63), 2 ** 64 - 1, 3.5,
                           float("nan"), True, False, None, "", "x" * rnd.randint(1, 300),
                           b"\x00" * rnd.randint(0, 64), "\udcff".encode("utf-8", "surrogatepass"),
                           rnd.randint(-10, 100)])
    if r < 0.6:
        return [_rand_value(rnd, depth + 1) for _ in range(rnd.randint(0, 6))]
    if r < 0.75:
        return {_rand_value(rnd, 4) if rnd.random() < 0.2 else
                rnd.choice(["req_id", "model_id", "layer", "experts", "now", "due",
                            "version", "pid", "model_dir", "manifest_hash", "working_set",
                            "profile", "refs", "x"]):
                _rand_value(rnd, depth + 1) for _ in range(rnd.randint(0, 6))}
    return msgpack.ExtType(rnd.randint(0, 127), rnd.randbytes(rnd.randint(0, 20)))


def _valid_message(rnd, mid, model_dir):
    req = rnd.randint(1, 10 ** 6)
    l, e = rnd.randint(0, 2), rnd.randint(0, 15)
    return rnd.choice([
        lambda: P.Demand(req, mid, l, [e], rnd.randint(0, 10 ** 6)),
        lambda: P.Prefetch(req, mid, rnd.randint(0, 100),
                           [P.Hint(l, rnd.sample(range(16), rnd.randint(1, 4)), rnd.randint(0, 200))]),
        lambda: P.Stats(req),
        lambda: P.Hello(req, P.PROTOCOL_VERSION, os.getpid(), str(model_dir),
                        manifest_hash(model_dir), rnd.randint(0, 4), rnd.random() < 0.5),
    ])()


def hostile_message(rnd, mid, model_dir):
    """One generated hostile message (a list of frames)."""
    from shared import codec

    kinds = [int(k) for k in P.MsgKind] + [0, 8, 9, 31, 99, 127, 128, 255]
    s = rnd.random()
    if s < 0.25:  # random kind, random msgpack body
        return [bytes([rnd.choice(kinds)]), _b(_rand_value(rnd))]
    if s < 0.5:  # a mutated valid message
        frames = codec.encode(_valid_message(rnd, mid, model_dir))
        body = bytearray(frames[1])
        for _ in range(rnd.randint(1, 4)):
            op = rnd.random()
            if op < 0.4 and body:
                i = rnd.randrange(len(body))
                body[i] ^= 1 << rnd.randrange(8)
            elif op < 0.6 and body:
                body = body[: rnd.randrange(len(body))]
            elif op < 0.8:
                body += rnd.randbytes(rnd.randint(1, 8))
            else:
                frames[0] = bytes([rnd.choice(kinds)])
        return [frames[0], bytes(body)] + ([b"x"] if rnd.random() < 0.05 else [])
    if s < 0.7:  # right field names, wrong types or values
        msg = _valid_message(rnd, mid, model_dir)
        frames = codec.encode(msg)
        fields = msgpack.unpackb(frames[1], raw=False)
        k = rnd.choice(sorted(fields))
        fields[k] = _rand_value(rnd, 2)
        if rnd.random() < 0.2:
            fields.pop(rnd.choice(sorted(fields)), None)
        return [frames[0], _b(fields)]
    if s < 0.8:  # ExtTypes in valid places
        msg = _valid_message(rnd, mid, model_dir)
        frames = codec.encode(msg)
        fields = msgpack.unpackb(frames[1], raw=False)
        k = rnd.choice(sorted(fields))
        fields[k] = msgpack.ExtType(rnd.randint(0, 127), b"x")
        return [frames[0], _b(fields)]
    if s < 0.85:  # truncated or empty frames, extra frames
        frames = codec.encode(_valid_message(rnd, mid, model_dir))
        return rnd.choice([[frames[0]], [b""], [frames[0], b""], [b"", frames[1]],
                           frames + [b""] * rnd.randint(1, 3), [frames[0] * 2, frames[1]]])
    if s < 0.87:  # huge lists and strings (up to ~1.5 MiB)
        n = rnd.choice([10 ** 3, 10 ** 4, 10 ** 5, 3 * 10 ** 5])
        return [bytes([rnd.choice([2, 3, 4])]),
                _b({"req_id": 1, "model_id": mid, "layer": 0,
                    "experts": [rnd.randint(0, 15)] * n, "slots": [[0, 0]] * (n // 10),
                    "demand": True})]
    if s < 0.88:  # deep nesting
        body = b"".join(rnd.choice([b"\x91", b"\x81\xa1a"])
                        for _ in range(rnd.randint(100, 3000))) + b"\x00"
        return [bytes([rnd.choice(kinds)]), body]
    return [bytes([rnd.choice(kinds)]), rnd.randbytes(rnd.randint(0, 200))]  # raw bytes


# (Fixed: HELLO with a pid >= 2**31 made os.kill overflow in pid_alive, an
# INTERNAL reply; and in e1aa1eb, a foreign uid's first request could be
# answered before the peer check shut the connection.)


def check_hostile(model, messages=5000, seed=0, batch=25):
    rnd = random.Random(seed)
    m = Manifest.load(model)
    d = LiveDaemon(args=["--arena", "16M", "--workers", "2"])
    good = fuzz = None
    try:
        good = Raw(d.socket)
        h = good.hello(model)
        fuzz = Raw(d.socket)
        fuzz.hello(model)
        corpus = hostile_corpus(h.model_id, model)
        sent = good_ok = 0
        rss0 = None
        while sent < messages + len(corpus):
            frames_list = corpus if sent == 0 else [
                hostile_message(rnd, h.model_id, model) for _ in range(batch)]
            for frames in frames_list:
                fuzz.send_frames(frames)
            sent += len(frames_list)
            # a STATS on the same connection: everything before it was handled
            sync = 10 ** 9 + sent
            fuzz.send(P.Stats(sync))
            reply = fuzz.until(sync, 60)
            assert isinstance(reply, P.StatsOk), reply
            fuzz.notes = []
            # a good request from another session, answered with the right bytes
            lay = rnd.choice(m.layers)
            e = rnd.randrange(lay.num_experts)
            ok = good.rt(P.Demand(good.req(), h.model_id, lay.layer, [e], sent), 60)
            assert isinstance(ok, P.DemandOk), ok
            assert slot_bytes(d, h, ok.refs[0]) == record_bytes(model, lay, e)
            unpin_refs(h, ok.refs)
            good_ok += 1
            assert d.proc.poll() is None, d.logtext()[-2000:]
            if rss0 is None and sent >= min(messages // 10, 2000):
                rss0 = rss_kb(d.pid)
        rss1 = rss_kb(d.pid)
        c = stats(d.socket)["counters"]
        assert c["internal_errors"] == 0, d.logtext()[-3000:]
        growth_mb = (rss1[0] - rss0[0]) / 1024
        assert growth_mb < 48, f"daemon heap grew {growth_mb:.1f} MiB"
        return emit("hostile", {"messages": sent, "corpus": len(corpus),
                                "generated": sent - len(corpus), "seed": seed,
                                "good_requests_ok": good_ok, "crashes": 0,
                                "internal_errors": c["internal_errors"],
                                "bad_messages": c["bad_messages"],
                                "rss_anon_mb": [round(rss0[0] / 1024, 1),
                                                round(rss1[0] / 1024, 1)],
                                "rss_growth_mb": round(growth_mb, 1)})
    finally:
        for r in (good, fuzz):
            if r is not None:
                r.close()
        d.stop()
        shutil.rmtree(d.folder, ignore_errors=True)


# ---- 6. other users -------------------------------------------------------------

OTHER_USER = "iodrel"


def other_user():
    """(uid, gid) of a real non-root account, created with useradd if needed."""
    import pwd

    try:
        pw = pwd.getpwnam(OTHER_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                        OTHER_USER], check=True, capture_output=True)
        pw = pwd.getpwnam(OTHER_USER)
    assert pw.pw_uid != 0
    return pw.pw_uid, pw.pw_gid


def as_user(uid, gid, fn, limit_s=120.0):
    """Run ``fn()`` in a child that has become ``uid``; its result (a dict).
    A child that has not answered within ``limit_s`` is killed and the test
    fails (a fork of a process with threads can hang; the suite must not)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            assert os.getuid() == uid and os.geteuid() == uid
            os.write(w, json.dumps(fn()).encode())
            code = 0
        except BaseException as e:  # noqa: BLE001  (report anything from the child)
            os.write(w, json.dumps({"child_error": repr(e)}).encode())
        finally:
            os._exit(code)
    os.close(w)
    data, deadline = b"", time.monotonic() + limit_s
    while True:
        ready, _, _ = select.select([r], [], [], max(deadline - time.monotonic(), 0))
        if not ready:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(r)
            raise AssertionError(f"the child running as uid {uid} did not finish in {limit_s:g} s")
        chunk = os.read(r, 65536)
        if not chunk:
            break
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    out = json.loads(data)
    assert "child_error" not in out, out
    return out


def _try(fn):
    try:
        fn()
        return "allowed"
    except PermissionError as e:
        return "EACCES" if e.errno else str(e)
    except OSError as e:
        return f"errno {e.errno}"


def check_other_users(model, probes=5):
    import zmq

    import native

    uid, gid = other_user()
    d = LiveDaemon(args=["--arena", "16M"])
    try:
        mine = Raw(d.socket)
        assert isinstance(mine.hello(model), P.HelloOk)
        shm = d.shm_name()
        lock = d.folder / "iod.lock"
        mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)  # noqa: E731
        modes = {"run_dir": oct(mode(d.folder)), "socket": oct(mode(d.socket)),
                 "lock": oct(mode(lock)), "shm": oct(mode("/dev/shm" + shm))}
        assert modes == {"run_dir": "0o700", "socket": "0o600", "lock": "0o600", "shm": "0o600"}

        def attempts():
            def connect():
                s = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
                try:
                    s.connect(str(d.socket))
                    # let in by the kernel: the daemon's peer check must close it
                    s.settimeout(3.0)
                    while s.recv(4096):  # the ZMTP greeting may come first
                        pass
                    raise PermissionError("closed by the daemon")
                except pysocket.timeout:
                    raise PermissionError("connected, no handshake")  # left mute
                finally:
                    s.close()

            def zmq_request():
                ctx = zmq.Context()
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.connect(f"ipc://{d.socket}")
                s.send_multipart([bytes([int(P.MsgKind.STATS)]), _b({"req_id": 1})])
                got = s.poll(2000)
                s.close()
                ctx.term()
                if got:
                    return  # answered: "allowed"
                raise PermissionError("no answer")

            def shm_open():
                os.close(native.shm_open_readonly(shm))

            def shm_file():
                open("/dev/shm" + shm, "rb").close()

            def read_lock():
                lock.read_text()

            def list_dir():
                os.listdir(d.folder)

            def start_daemon_here():
                # a foreign user cannot take over the run dir either
                from iod.runtime import ensure_run_dir

                ensure_run_dir(d.folder)

            return {"connect": _try(connect), "zmq_request": _try(zmq_request),
                    "shm_open": _try(shm_open), "shm_file": _try(shm_file),
                    "read_lock": _try(read_lock), "list_run_dir": _try(list_dir),
                    "own_run_dir": _try(start_daemon_here)}

        # the real modes: every door is shut
        closed = as_user(uid, gid, attempts)
        assert all(v != "allowed" for v in closed.values()), closed
        # each guard on its own: open the run dir's search bit, then the socket
        os.chmod(d.folder, 0o711)
        behind_dir = as_user(uid, gid, attempts)
        assert all(v != "allowed" for v in behind_dir.values()), behind_dir
        os.chmod(d.socket, 0o666)
        before = stats(d.socket)["counters"].get("refused_peers", 0)
        behind_socket = as_user(uid, gid, attempts)  # only the peer-uid check is left
        # the kernel lets the connect through now; the daemon refuses the
        # ZMTP handshake (ZAP), so the raw connection is closed or left mute
        raw = behind_socket.pop("connect")
        assert all(v != "allowed" for v in behind_socket.values()), behind_socket

        def probe(n=10):
            """Connect and ask at once, n times: STATS (needs no session) and HELLO."""
            out = {"attempts": n, "stats_answered": 0, "hello_answered": 0, "hello_ok": 0}
            for i in range(2 * n):
                ctx = zmq.Context()
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.connect(f"ipc://{d.socket}")
                if i % 2 == 0:
                    s.send_multipart([bytes([int(P.MsgKind.STATS)]), _b({"req_id": 1})])
                else:
                    s.send_multipart([bytes([int(P.MsgKind.HELLO)]), _b(
                        {"req_id": 2, "version": P.PROTOCOL_VERSION, "pid": os.getpid(),
                         "model_dir": str(model)})])
                if s.poll(500):
                    kind = s.recv_multipart()[0][0]
                    if i % 2 == 0:
                        out["stats_answered"] += 1
                    else:
                        out["hello_answered"] += 1
                        out["hello_ok"] += kind == int(P.MsgKind.HELLO_OK)
                s.close()
                ctx.term()
            return out

        race = as_user(uid, gid, lambda: probe(probes))
        # never an answer to another uid, whatever the timing
        assert race["hello_ok"] == 0 and race["hello_answered"] == 0, race
        assert race["stats_answered"] == 0, race
        st = stats(d.socket)
        refused = st["counters"]["refused_peers"] - before
        assert refused >= 1, "the peer-uid check refused nobody"
        assert all(s["pid"] == os.getpid() for s in st["sessions"])
        # and the owner is still served
        assert isinstance(mine.rt(P.Demand(mine.req(), 1, 0, [0], 1)), (P.DemandOk, P.Error))
        mine.close()
        return emit("other_users", {"user": OTHER_USER, "uid": uid, "modes": modes,
                                    "modes_in_place": closed, "dir_opened": behind_dir,
                                    "dir_and_socket_opened": {**behind_socket,
                                                              "raw_connect": raw},
                                    "refused_peers": refused,
                                    "foreign_requests_answered": race})
    finally:
        d.stop()
        shutil.rmtree(d.folder, ignore_errors=True)


# ---- 7. load --------------------------------------------------------------------

# One session at a steady request rate: fetch k random records and check each
# against the manifest checksum while pinned. argv: model sock seconds rate seed k
LOAD_SCRIPT = r"""
import json, random, sys, time
from infer.runtime.client import IodClient
from shared.blob import Manifest, record_checksum
model, sock, secs, rate, seed, k = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
rnd = random.Random(seed)
m = Manifest.load(model)
c = IodClient(model, iod=sock, timeout=5.0)
print("ready", flush=True)
sys.stdin.readline()
lat, bad, n = [], 0, 0
t0 = time.monotonic()
while True:
    due = t0 + n / rate
    now = time.monotonic()
    if due - t0 >= secs:
        break
    if due > now:
        time.sleep(due - now)
    l = rnd.choice(m.layers)
    ex = rnd.sample(range(l.num_experts), k)
    t = time.perf_counter()
    got = []
    def sink(batch):
        for i, e in enumerate(batch.experts):  # checked while pinned, in place
            got.append(f"{record_checksum(l.layer, e, batch.record(i)):016x}" == l.checksums[e])
    c.fetch_into(l.layer, ex, sink)
    if n >= rate:  # the first second warms up (cold slots, page faults)
        lat.append((time.perf_counter() - t) * 1e6)
    bad += got.count(False) + (k - len(got))
    n += 1
c.close()
print(json.dumps({"n": n, "bad": bad, "lat_us": lat}), flush=True)
"""


def _load_run(model, sock, sessions, seconds, rate, seed, k=2):
    procs = [subprocess.Popen([PY, "-c", LOAD_SCRIPT, str(model), str(sock), str(seconds),
                               str(rate), str(seed * 100 + i), str(k)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)
             for i in range(sessions)]
    try:
        for p in procs:
            assert readline(p, 120).strip() == "ready", p.stderr.read()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        out = []
        for p in procs:
            o, err = p.communicate(timeout=seconds + 120)
            assert p.returncode == 0, err  # an unanswered request would fail or hang here
            out.append(json.loads(o.strip().splitlines()[-1]))
        return out
    finally:
        for p in procs:
            kill(p)


def check_load(model, seconds=10, base_seconds=5, sessions=8, rate=20.0, seed=0,
               assert_ratio=False):
    d = LiveDaemon(args=["--arena", "16M"])
    try:
        single = _load_run(model, d.socket, 1, base_seconds, rate, seed)
        lat_daemon1 = stats(d.socket)["latency_us"]
        rss0 = rss_kb(d.pid)
        many = _load_run(model, d.socket, sessions, seconds, rate, seed + 1)
        rss1 = rss_kb(d.pid)
        st = stats(d.socket)
        lat1 = single[0]["lat_us"]
        latn = [x for o in many for x in o["lat_us"]]
        n = sum(o["n"] for o in many)
        bad = sum(o["bad"] for o in single + many)
        assert bad == 0, f"{bad} records with wrong bytes"
        assert n >= sessions, "the sessions made no requests"
        assert st["counters"]["internal_errors"] == 0 and d.proc.poll() is None
        growth_mb = (rss1[0] - rss0[0]) / 1024
        assert growth_mb < 48, f"daemon heap grew {growth_mb:.1f} MiB"
        p99_1, p99_n = pct(lat1, 99), pct(latn, 99)
        ratio = p99_n / p99_1 if p99_1 else 0.0
        figures = {"sessions": sessions, "seconds": seconds, "rate_per_session": rate,
                   "requests": n, "unanswered": 0, "wrong_bytes": 0,
                   "single_p50_us": round(pct(lat1, 50)), "single_p99_us": round(p99_1),
                   "p50_us": round(pct(latn, 50)), "p99_us": round(p99_n),
                   "p99_ratio": round(ratio, 2), "ratio_asserted": assert_ratio,
                   # inside the daemon (request received -> reply sent) for reads:
                   # after the single session, then over both phases (mostly the 8)
                   "daemon_miss_p99_us": [lat_daemon1["miss"]["p99"],
                                          st["latency_us"]["miss"]["p99"]],
                   "evictions": st["counters"]["evictions"], "reads": st["counters"]["reads"],
                   "rss_anon_mb": [round(rss0[0] / 1024, 1), round(rss1[0] / 1024, 1)],
                   "rss_growth_mb": round(growth_mb, 1)}
        emit("load", figures)
        if assert_ratio:
            assert ratio <= 2.0, f"p99 {p99_n:.0f} us is {ratio:.2f}x a single session's"
        return figures
    finally:
        d.stop()
        shutil.rmtree(d.folder, ignore_errors=True)


# ---- CI sizes -------------------------------------------------------------------

@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    folder = tmp_path_factory.mktemp("relfake")
    make_prep(folder, num_experts=32)
    return folder


@pytest.fixture
def tiny(synth_model, prep_model):
    return synth_model("qwen3_moe"), prep_model("qwen3_moe")


def test_session_crash(tiny):
    check_session_crash(*tiny, rounds=size("rounds", 20), seed=size("seed", 0))


def test_daemon_crash(tiny):
    points = tuple(int(k) for k in size("kill_points", "8").split(","))
    check_daemon_crash(*tiny, kill_points=points)


def test_corruption(tiny, tmp_path):
    check_corruption(*tiny, tmp_path)


def test_disk_errors(tiny, tmp_path):
    figures = check_disk_errors(tmp_path, rounds=size("disk_rounds", 2))
    emit("disk_errors_session", check_disk_error_session(*tiny))
    assert figures["missing_errors"] == 0


def test_hostile_input(fake):
    check_hostile(fake, messages=size("messages", 5000), seed=size("seed", 0))


@pytest.mark.skipif(os.getuid() != 0 or not hasattr(pysocket, "SO_PEERCRED"),
                    reason="needs root (useradd, setuid) and SO_PEERCRED")
def test_other_users(fake):
    check_other_users(fake, probes=size("probes", 5))


def test_load(fake):
    check_load(fake, seconds=size("load_seconds", 10.0), base_seconds=size("base_seconds", 5.0),
               sessions=size("sessions", 8), rate=size("rate", 20.0), seed=size("seed", 0),
               assert_ratio=size("assert_ratio", False))
