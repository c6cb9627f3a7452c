"""IPC latency profiling: where each millisecond of an expert request goes.

Every record a session gets carries monotonic stamps (``time.monotonic_ns``,
one clock for every process of the machine). An arena hit: lookup start and
pinned (the session alone: no message). A demanded record: demand sent,
daemon received, queued, read start, read end, reply sent (the daemon's
stamps, in a profiling session's DEMAND_OK), reply received. Both: copied
into MLX (stamped here). ``Profiler`` collects
them with the session's per-layer spans (compute up to the router, the
layer's own host work, stall waiting for records, copy into MLX) and the
token times; ``write`` turns them into

- ``trace.json``: Chrome trace-event format (opens in Perfetto / chrome://tracing),
  one track per process and thread;
- ``latency.png``: a CDF per hop;
- ``summary.json`` / ``summary.md``: p50/p90/p99 per hop, time per layer,
  a decode token's time split (``decode_split``), bytes per token, and the
  rate at which bursts of demand reads (one layer's misses) came off the
  disk, against `iod doctor`'s ceiling.

The daemon's stamps do not say which reader thread read a record, so disk
reads are drawn on "lanes": overlapping reads go to different lanes, which
is as many lanes as reads were under way at once, not thread identities.
"""

import json
import os
import time
from pathlib import Path

import numpy as np

from infer.runtime.device import path_line

# hop name -> (start stamp, end stamp); a record lacking a stamp skips the hop
HOPS = {
    "arena hit: lookup→pinned": ("client_send", "client_recv"),
    "send→daemon": ("client_send", "received"),
    "daemon→queued": ("received", "queued"),
    "queue wait": ("queued", "read_start"),
    "disk read": ("read_start", "read_end"),
    "read→ready sent": ("read_end", "sent"),
    "demand hit: received→sent": ("received", "sent"),
    "daemon→client": ("sent", "client_recv"),
    "received→copied": ("client_recv", "copied"),
    "request→MLX array": ("client_send", "copied"),
}
QUANTILES = (50, 90, 99)


def percentiles(values, qs=QUANTILES) -> dict:
    """{"n", "p50", "p90", "p99", "max", "mean"} of ``values`` (linear
    interpolation between closest ranks, as numpy's default)."""
    a = np.asarray(list(values), dtype=np.float64)
    if a.size == 0:
        return {"n": 0, **{f"p{q}": None for q in qs}, "max": None, "mean": None}
    out = {"n": int(a.size)}
    for q, v in zip(qs, np.percentile(a, qs)):
        out[f"p{q}"] = float(v)
    out["max"] = float(a.max())
    out["mean"] = float(a.mean())
    return out


def record_kind(rec) -> str:
    """arena_hit (found ready, no message), demand_hit (ready at the daemon
    when the demand came), demand_read (read from disk for the demand)."""
    if rec["kind"] == "hit":
        return "arena_hit"
    return "demand_read" if rec.get("read_start") else "demand_hit"


def hop_samples(records) -> dict:
    """hop name -> list of durations in µs over the records that have both stamps."""
    out = {h: [] for h in HOPS}
    for r in records:
        arena = r["kind"] == "hit"
        hit = not r.get("read_start")
        for hop, (a, b) in HOPS.items():
            if (hop == "arena hit: lookup→pinned") != arena and hop not in ("received→copied",
                                                                        "request→MLX array"):
                continue
            if hop == "received→copied" and arena:
                continue
            if hop == "demand hit: received→sent" and not hit:
                continue
            if hop in ("daemon→queued", "queue wait", "disk read", "read→ready sent") and hit:
                continue
            ta, tb = r.get(a), r.get(b)
            # queued precedes received when a request joined an earlier read
            if ta and tb and tb >= ta:
                out[hop].append((tb - ta) / 1e3)
    return out


class Profiler:
    """Collects a session's spans and its client's hop stamps.

    ``attach(store, client)`` makes one and turns the client's hop log on; the
    streaming modules then call ``span`` and ``copied``, the generation loop
    ``token``, and ``write`` produces the files.
    """

    def __init__(self, client=None, disk_ceiling=None):
        self.client = client
        self.disk_ceiling = disk_ceiling  # bytes/s, iod doctor's; None if unprofiled
        self.spans = []  # (kind, layer, t0 ns, t1 ns, n)
        self.tokens = []  # ns at which each token came out
        self.copies = []  # (layer, t ns, bytes)
        self._seen = 0  # hop_log entries indexed so far
        self._latest = {}  # (layer, expert) -> its latest hop_log entry

    def span(self, kind, layer, t0, t1, n=0):
        self.spans.append((kind, layer, t0, t1, n))

    def token(self, t=None):
        self.tokens.append(t or time.monotonic_ns())

    def copied(self, layer, experts, t, nbytes=0):
        """The records of ``experts`` are in MLX memory as of ``t``."""
        log = self.client.hop_log if self.client is not None else []
        for rec in log[self._seen:]:
            self._latest[(rec["layer"], rec["expert"])] = rec
        self._seen = len(log)
        for e in experts:
            rec = self._latest.pop((layer, int(e)), None)
            if rec is not None and "copied" not in rec:
                rec["copied"] = t
        self.copies.append((layer, t, nbytes))

    @property
    def records(self):
        return self.client.hop_log if self.client is not None else []

    def write(self, folder, meta=None) -> dict:
        """Write trace.json, latency.png, summary.json and summary.md; return the summary."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        meta = dict(meta or {})
        daemon_pid = self.client.daemon_pid if self.client is not None else 0
        events = trace_events(self.records, self.spans, self.tokens, os.getpid(), daemon_pid)
        (folder / "trace.json").write_text(json.dumps({"traceEvents": events,
                                                       "displayTimeUnit": "ms"}))
        summary = summarize(self.records, self.spans, self.tokens, self.copies, meta,
                            self.disk_ceiling)
        (folder / "summary.json").write_text(json.dumps(summary, indent=1))
        (folder / "summary.md").write_text(summary_markdown(summary))
        plot_cdf(hop_samples(self.records), folder / "latency.png", kind_samples(self.records))
        return summary


# ---- trace.json ---------------------------------------------------------------------


def lanes(intervals):
    """Greedy interval partitioning: a lane index per (t0, t1), in input order,
    such that intervals on one lane never overlap."""
    order = sorted(range(len(intervals)), key=lambda i: intervals[i][0])
    ends = []  # per lane: end of its last interval
    out = [0] * len(intervals)
    for i in order:
        t0, t1 = intervals[i]
        for k, end in enumerate(ends):
            if end <= t0:
                ends[k] = t1
                out[i] = k
                break
        else:
            out[i] = len(ends)
            ends.append(t1)
    return out


def _meta(pid, tid, what, name):
    return {"ph": "M", "pid": pid, "tid": tid, "name": what, "ts": 0, "args": {"name": name}}


def _x(pid, tid, name, t0, t1, cat, args=None):
    ev = {"ph": "X", "pid": pid, "tid": tid, "name": name, "cat": cat,
          "ts": t0 / 1e3, "dur": max(t1 - t0, 0) / 1e3}
    if args:
        ev["args"] = args
    return ev


MAIN_TID, TOKENS_TID, REQ_TID0 = 1, 2, 100
READ_TID0 = 1


def trace_events(records, spans, tokens, pid, daemon_pid) -> list:
    """Chrome trace events (timestamps in µs of the shared monotonic clock).

    infer process: the main thread's layer spans (compute / host / stall / copy),
    a token track, and request lanes (send → copied). iod process: disk
    reads on lanes, and request handling (received → sent) on lanes."""
    ev = [_meta(pid, 0, "process_name", f"infer (pid {pid})"),
          _meta(pid, MAIN_TID, "thread_name", "main: layers"),
          _meta(pid, TOKENS_TID, "thread_name", "tokens")]
    for kind, layer, t0, t1, n in spans:
        args = {"layer": layer}
        if kind == "stall":
            args["experts"] = n
        elif kind == "copy":
            args["bytes"] = n
        ev.append(_x(pid, MAIN_TID, f"{kind} L{layer}", t0, t1, kind, args))
    for i in range(1, len(tokens)):
        ev.append(_x(pid, TOKENS_TID, f"token {i}", tokens[i - 1], tokens[i], "token"))

    # one event per request: the records of an ACQUIRE share their stamps
    groups = {}
    for r in records:
        if r.get("client_send") and r.get("client_recv"):
            groups.setdefault((r["kind"], r["layer"], r["client_send"], r["client_recv"]), []).append(r)
    reqs = list(groups.values())
    ends = [(g[0]["client_send"], max(r.get("copied") or r["client_recv"] for r in g)) for g in reqs]
    req_lanes = lanes(ends)
    for g, lane, (t0, t1) in zip(reqs, req_lanes, ends):
        r = g[0]
        ev.append(_x(pid, REQ_TID0 + lane, f"{r['kind']} L{r['layer']} ×{len(g)}", t0, t1,
                     "request", {"kinds": sorted({record_kind(x) for x in g}),
                                 "experts": [x["expert"] for x in g],
                                 "bytes": sum(x["size"] for x in g)}))
    for lane in set(req_lanes):
        ev.append(_meta(pid, REQ_TID0 + lane, "thread_name", f"requests (lane {lane})"))

    if not daemon_pid:
        return ev
    ev.append(_meta(daemon_pid, 0, "process_name", f"iod (pid {daemon_pid})"))
    seen, reads = set(), []
    for r in records:
        if r.get("read_start") and r.get("read_end"):
            key = (r["layer"], r["expert"], r["read_start"])
            if key not in seen:
                seen.add(key)
                reads.append(r)
    spans_ = [(r["read_start"], r["read_end"]) for r in reads]
    read_lanes = lanes(spans_)
    for r, lane, (t0, t1) in zip(reads, read_lanes, spans_):
        ev.append(_x(daemon_pid, READ_TID0 + lane, f"read L{r['layer']} E{r['expert']}", t0, t1,
                     "disk", {"bytes": r["size"], "queued_us": (t0 - r["queued"]) / 1e3
                              if r.get("queued") else None}))
    for lane in set(read_lanes):
        ev.append(_meta(daemon_pid, READ_TID0 + lane, "thread_name", f"disk reads (lane {lane})"))
    # flow arrows: each request that waited on a read -> that read
    read_lane = {(r["layer"], r["expert"], r["read_start"]): l for r, l in zip(reads, read_lanes)}
    flow = 0
    for g, lane in zip(reqs, req_lanes):
        for x in g:
            target = read_lane.get((x["layer"], x["expert"], x.get("read_start")))
            if target is None:
                continue
            flow += 1
            common = {"name": "read", "cat": "flow", "id": flow}
            ev.append({"ph": "s", "pid": pid, "tid": REQ_TID0 + lane,
                       "ts": x["client_send"] / 1e3, **common})
            ev.append({"ph": "f", "bp": "e", "pid": daemon_pid, "tid": READ_TID0 + target,
                       "ts": x["read_start"] / 1e3, **common})
    held = {}
    for r in records:
        if r.get("received") and r.get("sent"):
            held.setdefault((r["kind"], r["layer"], r["received"], r["sent"]), []).append(r)
    held = list(held.values())
    spans_ = [(g[0]["received"], g[0]["sent"]) for g in held]
    base = READ_TID0 + (max(read_lanes) + 1 if read_lanes else 0)
    h_lanes = lanes(spans_)
    for g, lane, (t0, t1) in zip(held, h_lanes, spans_):
        ev.append(_x(daemon_pid, base + lane, f"{g[0]['kind']} L{g[0]['layer']} ×{len(g)}", t0, t1,
                     "daemon", {"kinds": sorted({record_kind(x) for x in g})}))
    for lane in set(h_lanes):
        ev.append(_meta(daemon_pid, base + lane, "thread_name", f"requests held (lane {lane})"))
    return ev


# ---- summary ------------------------------------------------------------------------


def kind_samples(records) -> dict:
    """record kind -> request→MLX array durations in µs."""
    by_kind = {}
    for r in records:
        if r.get("client_send") and r.get("copied"):
            by_kind.setdefault(record_kind(r), []).append((r["copied"] - r["client_send"]) / 1e3)
    return dict(sorted(by_kind.items()))


def demand_bursts(records) -> list:
    """(bytes, seconds) of each demand that read two records or more from
    disk: from its first read's start to its last read's end."""
    groups = {}
    for r in records:
        if r["kind"] != "hit" and r.get("read_start") and r.get("read_end") and r.get("client_send"):
            groups.setdefault((r["layer"], r["client_send"]), []).append(r)
    out = []
    for g in groups.values():
        t0, t1 = min(r["read_start"] for r in g), max(r["read_end"] for r in g)
        if len(g) >= 2 and t1 > t0:
            out.append((sum(r["size"] for r in g), (t1 - t0) / 1e9))
    return out


def burst_summary(bursts, ceiling=None) -> dict:
    """The bursts' rates (MB/s: percentiles, and all bytes over all their
    seconds) and that rate over the disk's ceiling when it is known."""
    out = {"n": len(bursts), "MBps": percentiles(b / s / 1e6 for b, s in bursts),
           "overall_MBps": None, "ceiling_MBps": ceiling / 1e6 if ceiling else None,
           "of_ceiling": None}
    if bursts:
        out["overall_MBps"] = sum(b for b, _ in bursts) / sum(s for _, s in bursts) / 1e6
        if ceiling:
            out["of_ceiling"] = out["overall_MBps"] * 1e6 / ceiling
    return out


def summarize(records, spans, tokens, copies, meta, disk_ceiling=None) -> dict:
    hops = {h: percentiles(v) for h, v in hop_samples(records).items()}
    by_kind = kind_samples(records)
    per_layer = {}
    for kind, layer, t0, t1, n in spans:
        row = per_layer.setdefault(str(layer), {"compute_s": 0.0, "host_s": 0.0, "stall_s": 0.0,
                                                "copy_s": 0.0, "calls": 0, "stalls": 0})
        row[f"{kind}_s"] = row.get(f"{kind}_s", 0.0) + (t1 - t0) / 1e9
        if kind == "compute":
            row["calls"] += 1
        elif kind == "stall":
            row["stalls"] += 1
    for row in per_layer.values():  # a call's stall and copy lie inside its host spans
        row["host_s"] = max(row["host_s"] - row["stall_s"] - row["copy_s"], 0.0)
    n_tokens = len(tokens)
    copied = sum(c[2] for c in copies)
    decode = sum(c[2] for c in copies if tokens and c[1] > tokens[0])
    kinds = {}
    for r in records:
        kinds[record_kind(r)] = kinds.get(record_kind(r), 0) + 1
    out = {
        "records": len(records),
        "records_by_kind": dict(sorted(kinds.items())),
        "hops_us": hops,
        "request_to_mlx_us": {k: percentiles(v) for k, v in sorted(by_kind.items())},
        "per_layer": dict(sorted(per_layer.items(), key=lambda kv: int(kv[0]))),
        "stall_s": sum(r["stall_s"] for r in per_layer.values()),
        "tokens": n_tokens,
        "bytes_copied": copied,
        "bytes_per_token": copied / n_tokens if n_tokens else None,
        "decode_bytes_per_token": decode / (n_tokens - 1) if n_tokens > 1 else None,
        "demand_bursts": burst_summary(demand_bursts(records), disk_ceiling),
        # the device wait's all-hit calls: the host's work on the token's path
        # (from the GPU's post until the next call's graph was queued, 0 where
        # it was queued before), µs
        "all_hit_host_us": percentiles((t1 - t0) / 1e3 for kind, _, t0, t1, n in spans
                                       if kind == "host" and n == 1),
    }
    if n_tokens > 1:
        gaps = np.diff(np.asarray(tokens, dtype=np.float64)) / 1e6
        out["token_ms"] = percentiles(gaps)
        out["decode_ms_per_token"] = decode_split(spans, tokens)
    if meta.get("daemon_bytes_read") is not None and n_tokens:
        out["daemon_bytes_read_per_token"] = meta["daemon_bytes_read"] / n_tokens
    out["meta"] = meta
    return out


def decode_split(spans, tokens) -> dict:
    """Where a decode token's time goes, in ms per token, from the first
    token to the last: ``compute`` (waiting for the model's work up to each
    router, the one sync per streamed layer), ``stall`` (waiting for
    records), ``copy`` (records into MLX), ``host`` (the streamed layers' own
    work on the host: prediction, lookup, prefetch plan, the expert call's
    graph), ``aside`` (the device wait's serving of a call while the GPU
    runs on) and ``other`` (the rest: the model's
    other layers built on the host, sampling; with no streamed layer, all
    of it)."""
    start, end = tokens[0], tokens[-1]
    total = {"compute": 0, "stall": 0, "copy": 0, "host": 0, "aside": 0}
    for kind, _, t0, t1, _ in spans:
        if kind in total and t0 >= start and t1 <= end:
            total[kind] += t1 - t0
    total["host"] = max(total["host"] - total["stall"] - total["copy"], 0)
    n = len(tokens) - 1
    out = {k: v / 1e6 / n for k, v in total.items()}
    out["total"] = (end - start) / 1e6 / n
    out["other"] = max(out["total"] - sum(total.values()) / 1e6 / n, 0.0)
    return out


def _f(v, digits=1):
    return "–" if v is None else f"{v:.{digits}f}"


def summary_markdown(s) -> str:
    lines = ["# Expert request profile", "",
             f"{s['records']} records fetched, {s['tokens']} tokens, "
             f"stall {s['stall_s']:.3f} s in total.", "",
             "Records by kind: "
             + (", ".join(f"{k} {v}" for k, v in s["records_by_kind"].items()) or "none")
             + " (arena hits cost no message; prefetched records are arena hits).", "",
             "## Latency per hop (µs)", "",
             "| hop | n | p50 | p90 | p99 | max |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for hop, p in s["hops_us"].items():
        lines.append(f"| {hop} | {p['n']} | {_f(p['p50'])} | {_f(p['p90'])} | {_f(p['p99'])} "
                     f"| {_f(p['max'])} |")
    lines += ["", "## Request → usable MLX array, by kind (µs)", "",
              "| kind | n | p50 | p90 | p99 |", "| --- | ---: | ---: | ---: | ---: |"]
    for kind, p in s["request_to_mlx_us"].items():
        lines.append(f"| {kind} | {p['n']} | {_f(p['p50'])} | {_f(p['p90'])} | {_f(p['p99'])} |")
    lines += ["", "## Per MoE layer (s)", "",
              "| layer | calls | compute | host | stalls | stall | copy |",
              "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for layer, r in s["per_layer"].items():
        lines.append(f"| {layer} | {r['calls']} | {r['compute_s']:.4f} | {r['host_s']:.4f} | "
                     f"{r['stalls']} | {r['stall_s']:.4f} | {r['copy_s']:.4f} |")
    d = s.get("decode_ms_per_token")
    if d:
        lines += ["", "## A decode token's time (ms)", "",
                  "| compute | host | stall | copy | aside | other | total |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
                  f"| {d['compute']:.2f} | {d['host']:.2f} | {d['stall']:.2f} | {d['copy']:.2f} "
                  f"| {d['aside']:.2f} | {d['other']:.2f} | {d['total']:.2f} |", "",
                  "compute: waiting for the model's work up to each streamed layer's router "
                  "(one sync a layer); host: the streamed layers' own host work (prediction, "
                  "lookup, prefetch plan, the expert call's graph); aside: the device wait's "
                  "serving of a call while the GPU runs on; other: the rest of the "
                  "model's host work and sampling."]
    h = s.get("all_hit_host_us") or {}
    if h.get("n"):
        lines += ["", f"Device wait: an all-hit call's host work on the token's path (from its "
                  f"post until the next call's graph was queued, 0 if it was already): "
                  f"p50 {_f(h['p50'])} µs, p90 {_f(h['p90'])} µs, p99 {_f(h['p99'])} µs "
                  f"over {h['n']} calls."]
    meta = s.get("meta") or {}
    if meta.get("layer_calls"):
        lines += ["", "## Path", "", path_line(meta["layer_calls"], meta["device_wait"])
                  + (" (device wait: compute is the wait for the GPU to post a layer's ids, host the "
                     "host's work on them, off the token's path unless the GPU waits for a miss)"
                     if meta["device_wait"] else "")]
    lines += ["", "## Bytes per token", "",
              f"- copied into MLX: {s['bytes_copied']} bytes, "
              f"{_f(s['bytes_per_token'], 0)} per token "
              f"({_f(s['decode_bytes_per_token'], 0)} per decode token)"]
    if s.get("daemon_bytes_read_per_token") is not None:
        lines.append(f"- read from disk by the daemon: {_f(s['daemon_bytes_read_per_token'], 0)} "
                     "per token (every session's reads count)")
    if s.get("token_ms"):
        t = s["token_ms"]
        lines.append(f"- time between tokens: p50 {_f(t['p50'], 2)} ms, p99 {_f(t['p99'], 2)} ms")
    b = s.get("demand_bursts") or {}
    if b.get("n"):
        ceiling = (f", {b['of_ceiling']:.2f}× the `iod doctor` ceiling of {b['ceiling_MBps']:.0f} MB/s"
                   if b.get("of_ceiling") else " (no `iod doctor` profile for this disk)")
        lines += ["", "## Bursts of demand reads", "",
                  f"{b['n']} demands read two records or more: {b['overall_MBps']:.0f} MB/s over "
                  f"all of them, first read's start to last read's end{ceiling}; per burst "
                  f"p50 {_f(b['MBps']['p50'], 0)}, p90 {_f(b['MBps']['p90'], 0)} MB/s."]
    return "\n".join(lines) + "\n"


def plot_cdf(samples, path, by_kind=None):
    """One CDF line per hop (left) and per record kind, request → MLX array
    (right); µs on log axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 5.5), dpi=100)
    panels = ((axes[0], samples, "Expert request latency per hop"),
              (axes[1], by_kind or {}, "Request → usable MLX array, by kind"))
    for ax, series, title in panels:
        for name, values in series.items():
            if not values:
                continue
            x = np.sort(np.maximum(np.asarray(values), 0.1))
            y = np.arange(1, len(x) + 1) / len(x)
            ax.step(x, y, where="post", label=f"{name} (n={len(x)})")
        ax.set_xscale("log")
        ax.set_xlabel("latency (µs)")
        ax.set_ylabel("fraction of records")
        ax.set_title(f"{title} (CDF)")
        ax.grid(True, which="both", alpha=0.3)
        if any(series.values()):
            ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def attach(store, client) -> Profiler:
    """Profile ``store``'s layers and ``client``'s requests from now on."""
    client.profile = True
    store.profiler = Profiler(client, store.prefetcher.disk_ceiling)
    return store.profiler
