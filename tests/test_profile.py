"""IPC latency profiling: trace-event validity, exact percentiles on known
timings, lanes, and `infer run --profile DIR` end to end."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from infer.tools.profile import (HOPS, decode_split, demand_bursts, lanes, percentiles, summarize,
                           trace_events)
from shared.fixtures import short_dir

PHASES = set("BEXIiCbnesftPOND(M)") - set("()")
META_NAMES = {"process_name", "thread_name", "process_sort_index", "thread_sort_index",
              "process_labels"}


def validate_trace(obj) -> list:
    """Problems found in a Chrome trace-event document (empty if valid).

    Accepts the JSON array form and the object form {"traceEvents": [...]}.
    Checks the keys every event needs (ph, ts, pid, tid, name), phase
    letters, numeric non-negative timestamps and durations, metadata
    events' names and args, and balanced B/E pairs per thread."""
    if isinstance(obj, dict):
        if not isinstance(obj.get("traceEvents"), list):
            return ["object form without a traceEvents list"]
        events = obj["traceEvents"]
    elif isinstance(obj, list):
        events = obj
    else:
        return ["neither an array nor an object"]
    problems, depth, flows = [], {}, {}
    for i, ev in enumerate(events):
        if not isinstance(ev, dict):
            problems.append(f"#{i}: not an object")
            continue
        for key in ("ph", "ts", "pid", "tid", "name"):
            if key not in ev:
                problems.append(f"#{i}: no {key}")
        ph = ev.get("ph")
        if ph not in PHASES:
            problems.append(f"#{i}: unknown phase {ph!r}")
        ts = ev.get("ts")
        if not isinstance(ts, (int, float)) or isinstance(ts, bool) or ts < 0:
            problems.append(f"#{i}: bad ts {ts!r}")
        for key in ("pid", "tid"):
            if key in ev and not isinstance(ev[key], int):
                problems.append(f"#{i}: {key} is not an integer")
        if not isinstance(ev.get("name"), str):
            problems.append(f"#{i}: name is not a string")
        if ph == "X":
            dur = ev.get("dur")
            if not isinstance(dur, (int, float)) or dur < 0:
                problems.append(f"#{i}: complete event with bad dur {dur!r}")
        if ph == "M":
            if ev.get("name") not in META_NAMES:
                problems.append(f"#{i}: unknown metadata {ev.get('name')!r}")
            elif ev["name"].endswith("_name") and not isinstance(ev.get("args", {}).get("name"), str):
                problems.append(f"#{i}: metadata without args.name")
        if ph in ("B", "E"):
            key = (ev.get("pid"), ev.get("tid"))
            depth[key] = depth.get(key, 0) + (1 if ph == "B" else -1)
            if depth[key] < 0:
                problems.append(f"#{i}: E without B on {key}")
        if "args" in ev and not isinstance(ev["args"], dict):
            problems.append(f"#{i}: args is not an object")
        if ph in ("s", "t", "f"):
            if "id" not in ev:
                problems.append(f"#{i}: flow event without id")
            else:
                flows.setdefault(ev["id"], set()).add(ph)
    problems += [f"unclosed B on {k}" for k, d in depth.items() if d > 0]
    problems += [f"flow {k} ends without a start" for k, p in flows.items() if "f" in p and "s" not in p]
    return problems


def test_validator_accepts_both_forms_and_rejects_bad_events():
    good = [{"ph": "X", "ts": 1.5, "dur": 2, "pid": 1, "tid": 1, "name": "a"},
            {"ph": "M", "ts": 0, "pid": 1, "tid": 0, "name": "process_name", "args": {"name": "p"}}]
    assert validate_trace(good) == [] and validate_trace({"traceEvents": good}) == []
    bad = [
        {"ph": "X", "ts": 1, "dur": -1, "pid": 1, "tid": 1, "name": "neg"},
        {"ph": "Q", "ts": 1, "pid": 1, "tid": 1, "name": "phase"},
        {"ph": "X", "dur": 1, "pid": 1, "tid": 1, "name": "no ts"},
        {"ph": "B", "ts": 1, "pid": 1, "tid": 2, "name": "open"},
        {"ph": "M", "ts": 0, "pid": 1, "tid": 0, "name": "thread_name", "args": {}},
        {"ph": "X", "ts": 1, "dur": 1, "pid": "1", "tid": 1, "name": "pid"},
        {"ph": "f", "ts": 1, "pid": 1, "tid": 1, "name": "flow", "id": 9, "bp": "e"},
    ]
    problems = validate_trace(bad)
    for word in ("bad dur", "unknown phase", "no ts", "unclosed B", "args.name", "pid is not",
                 "without a start"):
        assert any(word in p for p in problems), (word, problems)
    assert validate_trace({"events": []}) and validate_trace("x")


def test_percentiles_on_known_values():
    p = percentiles(range(1, 101))
    assert p["n"] == 100 and p["max"] == 100 and p["mean"] == 50.5
    assert p["p50"] == pytest.approx(50.5) and p["p90"] == pytest.approx(90.1)
    assert p["p99"] == pytest.approx(99.01)
    one = percentiles([7.0])
    assert one["p50"] == one["p90"] == one["p99"] == one["max"] == 7.0
    assert percentiles([])["n"] == 0 and percentiles([])["p50"] is None


def known_records():
    """25 records with exactly known hops (ns): 10 demanded and ready at the
    daemon, 10 demanded and read from disk, 5 arena hits (no message)."""
    recs = []
    for i in range(20):
        t = 1_000_000_000 + i * 10_000_000
        hit = i < 10
        r = {"kind": "demand", "layer": i % 2, "expert": i, "size": 1000,
             "client_send": t, "received": t + 1000 * (i + 1)}  # send→daemon = i+1 µs
        if hit:
            r.update(queued=0, read_start=0, read_end=0, sent=r["received"] + 5000)
        else:
            r["queued"] = r["received"] + 2000
            r["read_start"] = r["queued"] + 3000
            r["read_end"] = r["read_start"] + 100_000 * (i - 9)  # 100..1000 µs
            r["sent"] = r["read_end"] + 4000
        r["client_recv"] = r["sent"] + 6000
        r["copied"] = r["client_recv"] + 7000
        recs.append(r)
    for i in range(5):
        t = 2_000_000_000 + i * 10_000_000
        recs.append({"kind": "hit", "layer": 0, "expert": 20 + i, "size": 1000,
                     "client_send": t, "client_recv": t + 2000 * (i + 1), "copied": t + 30_000})
    return recs


def test_summary_hops_are_exact_on_known_timings():
    recs = known_records()
    spans = [("compute", 0, 0, 2_000_000, 0), ("stall", 0, 2_000_000, 5_000_000, 2),
             ("copy", 0, 5_000_000, 6_000_000, 2000), ("compute", 1, 6_000_000, 7_000_000, 0),
             ("stall", 1, 7_000_000, 7_500_000, 1)]
    tokens = [10, 20, 30, 40]
    copies = [(0, 5, 4000), (1, 25, 3000), (0, 35, 3000)]
    s = summarize(recs, spans, tokens, copies, {"daemon_bytes_read": 8000})
    h = s["hops_us"]
    assert set(h) == set(HOPS)
    send = percentiles(range(1, 21))
    for q in ("p50", "p90", "p99", "max"):
        assert h["send→daemon"][q] == pytest.approx(send[q])
    assert h["disk read"]["n"] == 10
    assert h["disk read"]["p50"] == pytest.approx(550.0) and h["disk read"]["max"] == 1000.0
    assert h["disk read"]["p90"] == pytest.approx(910.0)
    assert h["demand hit: received→sent"] == percentiles([5.0] * 10)
    assert h["arena hit: lookup→pinned"] == percentiles([2.0, 4.0, 6.0, 8.0, 10.0])
    assert h["queue wait"]["p99"] == pytest.approx(3.0) and h["daemon→queued"]["p50"] == 2.0
    assert h["daemon→client"]["n"] == 20 and h["daemon→client"]["p90"] == pytest.approx(6.0)
    assert h["received→copied"]["n"] == 20 and h["received→copied"]["p50"] == pytest.approx(7.0)
    # request → MLX array: demand hits are 1..10 + 5 + 6 + 7 µs
    hit = s["request_to_mlx_us"]["demand_hit"]
    assert hit["p50"] == pytest.approx(percentiles([i + 18 for i in range(1, 11)])["p50"])
    assert s["request_to_mlx_us"]["demand_read"]["max"] == pytest.approx(20 + 2 + 3 + 1000 + 4 + 6 + 7)
    assert s["request_to_mlx_us"]["arena_hit"] == percentiles([30.0] * 5)
    assert h["request→MLX array"]["n"] == 25
    layer0 = s["per_layer"]["0"]
    assert layer0["compute_s"] == pytest.approx(0.002) and layer0["stall_s"] == pytest.approx(0.003)
    assert layer0["copy_s"] == pytest.approx(0.001) and layer0["calls"] == 1
    assert s["stall_s"] == pytest.approx(0.0035)
    assert s["bytes_copied"] == 10000 and s["bytes_per_token"] == 2500
    assert s["decode_bytes_per_token"] == pytest.approx(6000 / 3)
    assert s["daemon_bytes_read_per_token"] == 2000
    assert s["token_ms"]["p50"] == pytest.approx(1e-5)
    assert s["records_by_kind"] == {"arena_hit": 5, "demand_hit": 10, "demand_read": 10}


def test_decode_split_takes_nested_stall_and_copy_out_of_host():
    ms = 1_000_000
    tokens = [0, 10 * ms, 20 * ms]  # two decode tokens, 20 ms
    spans = [("host", 0, 0, 1 * ms, 0), ("compute", 0, 1 * ms, 4 * ms, 0),
             ("host", 0, 4 * ms, 9 * ms, 0),  # holds the stall and the copy below
             ("stall", 0, 5 * ms, 7 * ms, 1), ("copy", 0, 7 * ms, 8 * ms, 100),
             ("compute", 1, 10 * ms, 16 * ms, 0), ("host", 1, 16 * ms, 17 * ms, 0),
             ("compute", 1, 25 * ms, 26 * ms, 0)]  # after the last token: not decode
    d = decode_split(spans, tokens)
    assert d["total"] == pytest.approx(10.0)
    assert d["compute"] == pytest.approx((3 + 6) / 2)
    assert d["stall"] == pytest.approx(1.0) and d["copy"] == pytest.approx(0.5)
    assert d["host"] == pytest.approx((1 + 5 + 1 - 2 - 1) / 2)
    assert d["other"] == pytest.approx(10.0 - 4.5 - 1.0 - 0.5 - 2.0)
    layer0 = summarize([], spans, tokens, [], {})["per_layer"]["0"]
    assert layer0["host_s"] == pytest.approx(0.003) and layer0["calls"] == 1


def test_demand_bursts_rate_on_known_reads():
    ms, MB = 1_000_000, 1_000_000

    def read(layer, send, t0, t1, size, kind="demand"):
        return {"kind": kind, "layer": layer, "expert": t0, "size": size, "client_send": send,
                "queued": t0, "read_start": t0, "read_end": t1}

    recs = [read(0, 1, 1 * ms, 3 * ms, MB), read(0, 1, 1 * ms, 3 * ms, MB),
            read(0, 1, 2 * ms, 4 * ms, MB),  # 3 MB in 3 ms
            read(1, 2, 10 * ms, 12 * ms, 2 * MB), read(1, 2, 10 * ms, 12 * ms, 2 * MB),  # 4 MB in 2 ms
            read(0, 3, 20 * ms, 21 * ms, MB),  # one read: not a burst
            {"kind": "hit", "layer": 1, "expert": 9, "size": MB, "client_send": 4}]
    bursts = sorted(demand_bursts(recs))
    assert bursts == [(3 * MB, pytest.approx(0.003)), (4 * MB, pytest.approx(0.002))]
    b = summarize(recs, [], [], [], {}, disk_ceiling=2000 * MB)["demand_bursts"]
    assert b["n"] == 2 and b["overall_MBps"] == pytest.approx(7 / 0.005)
    assert b["MBps"]["max"] == pytest.approx(2000) and b["MBps"]["p50"] == pytest.approx(1500)
    assert b["of_ceiling"] == pytest.approx(0.7) and b["ceiling_MBps"] == 2000
    unprofiled = summarize(recs, [], [], [], {})["demand_bursts"]
    assert unprofiled["of_ceiling"] is None and unprofiled["overall_MBps"] == b["overall_MBps"]


def test_lanes_never_overlap_and_use_the_peak_concurrency():
    iv = [(0, 10), (5, 15), (10, 20), (12, 13), (30, 31), (14, 40)]
    ln = lanes(iv)
    for a in range(len(iv)):
        for b in range(a + 1, len(iv)):
            if ln[a] == ln[b]:
                assert iv[a][1] <= iv[b][0] or iv[b][1] <= iv[a][0]
    assert max(ln) + 1 == 3  # at t=12..13: (5,15), (10,20), (12,13)


def test_trace_of_known_records_is_valid_with_a_track_per_process():
    recs = known_records()
    spans = [("compute", 0, 1_000_000_000, 1_002_000_000, 0)]
    ev = trace_events(recs, spans, [1_000_000_000, 1_050_000_000], 111, 222)
    assert validate_trace(ev) == []
    names = {(e["pid"], e["args"]["name"]) for e in ev if e["ph"] == "M"}
    assert (111, "main: layers") in names and (222, "disk reads (lane 0)") in names
    reads = [e for e in ev if e.get("cat") == "disk"]
    assert len(reads) == 10 and all(e["pid"] == 222 for e in reads)
    # an arrow from each request that waited on a read to that read
    ends = [e for e in ev if e["ph"] == "f"]
    assert len(ends) == 10 and {e["pid"] for e in ends} == {222}


@pytest.fixture
def run_dir(monkeypatch):
    folder = short_dir("iodp-")
    monkeypatch.setenv("IOD_RUN_DIR", str(folder))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_infer_run_profile_writes_trace_plot_and_summary(synth_model, prep_model, run_dir, tmp_path):
    from shared.blob import Manifest
    from tests.test_run import PROMPT, mlx_greedy_ids

    from shared import disk

    prep = prep_model("qwen3_moe")
    out = tmp_path / "prof"
    # a doctor's profile of the disk the blobs lie on: the bursts are judged against it
    blob = prep / Manifest.load(prep).layers[0].file
    profile = tmp_path / "disk.json"
    disk.save(disk.Profile(os.stat(blob).st_dev, str(blob), 1 << 20, "direct",
                           ((1, 500e6, 1e-3, 2e-3), (4, 1000e6, 2e-3, 4e-3))), profile)
    env = dict(os.environ, IOD_DISK_PROFILE=str(profile))
    r = subprocess.run([sys.executable, "-m", "infer.cli", "run", "--model", str(prep),
                        "--prompt", PROMPT, "--max-tokens", "24", "--json", "--profile", str(out)],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["tokens"] == mlx_greedy_ids(synth_model("qwen3_moe"), 24)  # unchanged output

    trace = json.loads((out / "trace.json").read_text())
    assert validate_trace(trace) == []
    ev = trace["traceEvents"]
    pids = {e["pid"] for e in ev}
    assert len(pids) == 2  # infer and iod
    daemon_pid = result["stats"]["daemon_pid"]
    assert daemon_pid in pids
    cats = {e.get("cat") for e in ev if e["ph"] == "X"}
    assert {"compute", "stall", "copy", "disk", "token", "request"} <= cats

    s = json.loads((out / "summary.json").read_text())
    for hop in ("send→daemon", "disk read", "daemon→client", "request→MLX array",
                "arena hit: lookup→pinned"):
        assert s["hops_us"][hop]["n"] > 0
        p = s["hops_us"][hop]
        assert 0 <= p["p50"] <= p["p90"] <= p["p99"] <= p["max"]
    layers = {str(l.layer) for l in Manifest.load(prep).layers}
    assert set(s["per_layer"]) == layers
    assert s["tokens"] == 24 and s["bytes_per_token"] > 0
    split = s["decode_ms_per_token"]  # the parts add up to the time between tokens
    parts = sum(split[k] for k in ("compute", "host", "stall", "copy", "other"))
    assert split["compute"] > 0 and split["host"] > 0
    assert parts == pytest.approx(split["total"]) and split["total"] > 0
    assert s["bytes_copied"] == result["stats"]["bytes_read"]
    bursts = s["demand_bursts"]  # the prefill misses many experts of a layer at once
    assert bursts["n"] > 0 and bursts["ceiling_MBps"] == 1000
    assert bursts["of_ceiling"] == pytest.approx(bursts["overall_MBps"] / 1000)
    md = (out / "summary.md").read_text()
    assert "| disk read |" in md and "Per MoE layer" in md and "Bytes per token" in md
    assert "Bursts of demand reads" in md and "the `iod doctor` ceiling of 1000 MB/s" in md
    # which path the streamed calls took: on the CPU each syncs at its router
    calls = result["stats"]["layer_calls"]
    assert calls["synced"] > 0 and calls["device"] == 0
    assert f"Streamed layers: {calls['synced']} calls synced at their router (no device wait" in md
    assert (out / "latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ipc_bench_json_schema(tmp_path):
    out = tmp_path / "ipc.json"
    script = Path(__file__).resolve().parent.parent / "scripts" / "bench" / "ipc_bench.py"
    r = subprocess.run([sys.executable, str(script), "--sessions", "1,2", "--hits", "20",
                        "--misses", "6", "--record-bytes", "65536", "--arena-mb", "4",
                        "--json", str(out)], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert set(data["sessions"]) == {"1", "2"}
    for n, row in data["sessions"].items():
        for key in ("hit_p50_us", "hit_p99_us", "miss_p50_us", "miss_p99_us",
                    "hit_mlx_p50_us", "hit_mlx_p99_us"):
            assert isinstance(row[key], float) and row[key] > 0, (n, key, row)
        assert row["hit_p50_us"] <= row["hit_p99_us"] and row["miss_p50_us"] <= row["miss_p99_us"]
        assert row["hit_n"] + row["miss_n"] == int(n) * 26
        # a read's hops, each measured, together within its request → ready
        hops = [row[f"read_{a}_to_{b}_p50_us"] for a, b in
                [("client_send", "received"), ("queued", "read_start"), ("read_start", "read_end"),
                 ("read_end", "sent"), ("sent", "client_recv")]]
        assert all(isinstance(h, float) and h >= 0 for h in hops), (n, hops)
        assert row["read_read_start_to_read_end_p50_us"] > 0
