"""`infer bench`: decode speed and IO of four ways to run the same MoE model.

Modes, each measured in a fresh subprocess so that its peak memory is its own:

- ``resident``: mlx-lm's own model with every expert in memory. It is built
  from the prep folder itself: mlx-lm loads the resident weights and the
  model's ``sanitize`` step adds every expert record, stacked per tensor
  under the expert module's name, so mlx-lm quantizes and loads it exactly
  as it would the source model (skipped when it does not fit in memory);
- ``sync``: streaming, each missed expert read when it is demanded, one at a
  time (the daemon's core in this process, one reader, no prediction);
- ``inproc``: streaming with prediction, the daemon's core and its reader
  threads in this process (``iod.inproc``);
- ``iod``: streaming with prediction through a private iod daemon.

Decode steps follow a fixed text (teacher forcing) unless ``--free-run``;
``tokens`` holds the model's greedy prediction at each step and must be the
same in every mode. Each run starts cold (empty expert cache, fresh daemon).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from shared.launch import start_daemon, stop_daemon
from shared.paths import check_out
from shared.units import format_size, parse_size

from infer.data import CORPUS
from infer.runtime.source import make_source
from infer.tools.resident import load_resident
from infer.tools import bench_draft
from infer.args import (Parser, add_device_wait, add_dtype, add_prefill, mx_dtype, nonneg_float, nonneg_int, positive_int,
                   write_atomic)

MODES = ("resident", "sync", "inproc", "iod")
DEFAULT_PROMPT = "The lighthouse keeper counted the ships that passed in the night"
FORCED_TEXT = CORPUS
DEFAULT_DEPTH = 3


def build_parser():
    p = Parser(prog="infer bench", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="prep folder")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--budget", default="0.25",
                   help="expert cache: a fraction of all expert bytes (<= 1) or a size, e.g. 400M")
    p.add_argument("--read-rate", type=nonneg_float, default=0.0,
                   help="MB/s cap on expert reads (emulates a slower device; 0 = none)")
    p.add_argument("--max-tokens", type=positive_int, default=64,
                   help="tokens each run generates, the prefill's first one included (at least 2)")
    p.add_argument("--runs", type=positive_int, default=3)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--free-run", action="store_true",
                   help="feed back the greedy tokens instead of following the fixed text")
    p.add_argument("--sessions", type=nonneg_int, default=0,
                   help="also run N concurrent sessions on one daemon, then with a daemon each")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of modes")
    p.add_argument("--depth", type=nonneg_int, default=DEFAULT_DEPTH,
                   help="deepest prediction (layers ahead); prefetch reads at the depths and "
                        "breadths the measured precision, read rate and compute time pay for")
    p.add_argument("--hits-first", choices=("auto", "on", "off"), default="auto",
                   help="streamed modes: compute a token's cached experts while its misses are "
                        "read (auto: on the CPU only)")
    p.add_argument("--predict", choices=("auto", "on", "off"), default="auto",
                   help="streamed modes with --depth > 0: predict and prefetch on every call, "
                        "never, or while decode passes measure faster with it (infer.runtime.gate: "
                        "its first decision is in force from the 65th decode pass)")
    add_device_wait(p)
    add_prefill(p)
    p.add_argument("--prefill-step-size", type=positive_int, default=2048,
                   help="prompt tokens per prefill call, as infer run's")
    p.add_argument("--warm", action="store_true",
                   help="time a long session's steady state: fill the expert cache, run the "
                        "prompt and text once untimed, then time them again (caches kept)")
    add_dtype(p)
    p.add_argument("--arena", default=None,
                   help="arena of the benchmark's daemons (default: a staging area, see budget.py)")
    p.add_argument("--ranks", type=positive_int, default=1, metavar="N",
                   help="run the streaming modes as N local ranks through mlx.launch (the layers "
                        "split across them, a fractional --budget of each rank's own experts, a size "
                        "per rank); resident stays one process")
    p.add_argument("--routing-trace", type=Path, default=None, metavar="FILE",
                   help="route as this recorded trace does (route_trace v1 CSV, Mixtral JSONL or an "
                        "infer routing trace), in every mode: a real model's IO pattern on a model "
                        "of the trace's shape (infer.tools.forced_routing)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--iod", default=None, help=argparse.SUPPRESS)
    p.add_argument("--wait-go", action="store_true", help=argparse.SUPPRESS)
    bench_draft.add_args(p)
    return p


def cache_bytes_of(budget: str, manifest, draft="none", model_dir=None) -> int:
    """``--budget``: a fraction of the expert bytes of the layers the cache
    is shared over (an MTP head's only when it drafts), or a size."""
    from infer.runtime.budget import cached_expert_bytes
    from infer.spec.mtp import drafts_with_mtp

    expert_bytes = cached_expert_bytes(manifest, drafts_with_mtp(draft, model_dir))
    try:
        f = float(budget)
    except ValueError:
        return parse_size(budget)
    if not 0 <= f <= 1:
        raise ValueError(f"--budget {budget}: a fraction must be between 0 and 1 (or give a size)")
    return int(expert_bytes * f)


# ---- memory -------------------------------------------------------------------------


def proc_status(pid="self") -> dict:
    """VmHWM, VmRSS, RssAnon, RssFile, RssShmem of a process, in bytes ({} off Linux)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


class PeakRSS:
    """Peak resident memory of this process, shared memory left out (it is
    the daemon's arena, counted with the daemon). Samples /proc every 10 ms
    and also takes VmHWM minus the shared memory mapped at the end."""

    def __init__(self):
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _sample(self):
        s = proc_status()
        if s:
            self.peak = max(self.peak, s.get("RssAnon", 0) + s.get("RssFile", 0))

    def _run(self):
        while not self._stop.wait(0.01):
            self._sample()

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        self._sample()
        s = proc_status()
        if not s:  # macOS: ru_maxrss (shared memory included)
            import resource

            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return max(self.peak, s["VmHWM"] - s.get("RssShmem", 0))


# ---- the decode loop ---------------------------------------------------------------


def forced_ids(tokenizer, n):
    """The fixed text that decode steps follow (teacher forcing)."""
    ids = tokenizer.encode(FORCED_TEXT.read_text(), add_special_tokens=False)
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def decode(model, prompt_ids, follow, n, store=None, routing=None, step=2048, layer_major=True):
    """One cold run: prefill (as ``infer run``: chunks of ``step`` tokens,
    ``layer_major`` or one after another), then ``n - 1`` decode steps.
    Returns timings, the greedy prediction at every step, and the stall
    time of decode. ``routing``: a ForcedRouting, started again at the
    trace's first token."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from infer.runtime.prefill import prefill
    from infer.runtime.streaming import MISS_KINDS

    if routing is not None:
        routing.reset()
    cache = make_prompt_cache(model)
    t0 = time.perf_counter()
    rest = prefill(model, store if layer_major else None, prompt_ids, cache, step)
    logits = model(mx.array(rest)[None], cache=cache)
    y = mx.argmax(logits[0, -1])
    tokens = [int(y.item())]
    t1 = time.perf_counter()
    before = dict(store.stats) if store else {}
    for i in range(n - 1):
        nxt = tokens[-1] if follow is None else follow[i]
        logits = model(mx.array([[nxt]]), cache=cache)
        tokens.append(int(mx.argmax(logits[0, -1]).item()))
    t2 = time.perf_counter()
    steps = max(n - 1, 1)
    out = {
        "tokens": tokens,
        "prefill_s": t1 - t0,
        "decode_s": t2 - t1,
        "prefill_tok_s": len(prompt_ids) / (t1 - t0),
        "decode_tok_s": (n - 1) / (t2 - t1) if n > 1 else 0.0,
    }
    if store is not None:
        out["prefill_bytes"] = before["fetched_bytes"]  # (the run starts from reset stats)
        delta = {k: v - before[k] for k, v in store.stats.items() if k in before}
        out["stall_s"] = delta["stall_s"]
        out["stall_s_per_token"] = delta["stall_s"] / steps
        out["copy_s"] = delta["copy_s"]
        out["copy_s_per_token"] = delta["copy_s"] / steps
        out["decode_bytes"] = delta["fetched_bytes"]
        out["decode_misses"] = delta["misses"]
        out["bytes_read_per_token"] = out["decode_bytes"] / steps
        # hinted for prefetch during decode, and of those not used by the call they were for
        out["prefetched_bytes"] = delta["prefetched_bytes"]
        out["prefetch_unused_bytes"] = delta["prefetch_unused_bytes"]
        out["hits_first_calls"] = delta["hits_first"]
        out["miss_split"] = {k: delta["miss_" + k] for k in MISS_KINDS}
        out["aside_calls"] = delta["aside_calls"]
        out["host_s_per_token"] = delta["host_s"] / steps
        out["predict_s_per_token"] = delta["predict_s"] / steps
        out["gate"] = store.prefetcher.gate.stats()
    return out


def mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os as _os

    return _os.sysconf("SC_PAGE_SIZE") * _os.sysconf("SC_PHYS_PAGES")


# ---- one mode, in its own process ---------------------------------------------------


def _daemon_bytes(client):
    return client.stats()["counters"]["bytes_read"]


def _source_counters(source) -> dict:
    """The reader's prefetch counters, where the source reports them."""
    try:
        c = source.stats()["counters"]
    except Exception:  # a source without stats (tests' fakes)
        return {}
    return {k: c[k] for k in ("prefetch_reads", "prefetched_unused", "prefetches_dropped",
                              "bytes_read") if k in c}


def worker(args) -> dict:
    """Measure one mode; returns its result dict."""
    import mlx.core as mx

    from shared.blob import Manifest
    from infer.tools.belady import belady_misses
    from infer.runtime.budget import staging_arena_bytes
    from infer.runtime.gate import PredictionGate
    from infer.spec.mtp import drafts_with_mtp
    from infer.runtime.streaming import copy_mode

    from infer.runtime import distributed

    peak = PeakRSS()
    mode = args.worker
    manifest = Manifest.load(args.model)
    g = distributed.group() if mode != "resident" else None
    if g is not None:  # a rank: its own layers, its own budget
        manifest = distributed.rank_manifest(manifest, args.model, g)
    cache_bytes = cache_bytes_of(args.budget, manifest, args.draft, args.model)
    rate = args.read_rate * 1e6
    result = {"mode": mode}

    if mode == "resident":
        from infer.runtime.budget import resident_bytes

        need = resident_bytes(args.model) + manifest.expert_bytes
        if need > 0.8 * mem_available():
            return {"mode": mode, "skipped": f"needs {format_size(need)}, "
                    f"{format_size(mem_available())} available"}
        model, tokenizer = load_resident(args.model)
        if args.dtype:
            from infer.runtime.loader import cast_model

            cast_model(model, mx_dtype(args.dtype))
        store = None
    else:
        from infer.runtime.loader import load_streaming

        depth = 0 if mode == "sync" else args.depth
        model, tokenizer, store = load_streaming(args.model, None, cache_bytes, dtype=mx_dtype(args.dtype),
                                                 mtp_cache=drafts_with_mtp(args.draft, args.model), group=g,
                                                 device_wait=args.device_wait)
        store.prefetcher.depth = depth
        if args.hits_first != "auto":
            store.hits_first = args.hits_first == "on"
        store.prefetcher.gate = PredictionGate(args.predict)
        if args.read_rate:  # reads are capped: plan prefetch with the cap
            store.prefetcher.disk_rate = min(store.prefetcher.disk_rate or float("inf"), args.read_rate * 1e6)

    routing = None
    if args.routing_trace is not None:
        from infer.tools.forced_routing import ForcedRouting
        from infer.tools.trace import read

        routing = ForcedRouting(read(args.routing_trace))
        routing.install(model, None if store is None else
                        [l.module for l in manifest.layers if not l.module.startswith("mtp.")])

    from infer.run import encode_prompt

    prompt_ids = encode_prompt(tokenizer, bench_draft.resolve_prompt(args.prompt), args.raw_prompt)
    follow = None if args.free_run else forced_ids(tokenizer, args.max_tokens)
    prefill_order = (args.prefill_step_size, args.prefill == "layer-major")
    arena = parse_size(args.arena) if args.arena else staging_arena_bytes(manifest, args.depth)
    runs, daemon_peak, daemon_read = [], 0, []
    for r in range(args.runs):
        daemon = client = None
        try:
            if mode == "iod":
                if not args.iod:
                    daemon = start_daemon(arena, args.read_rate)
                client = make_source(args.model, args.iod or str(daemon[2]))
                store.use(client)
                read0 = _daemon_bytes(client)
            if mode in ("sync", "inproc"):
                store.use(make_source(args.model, "inproc", arena=arena, read_rate=rate,
                                      workers=1 if mode == "sync" else 4))
                read0 = 0
            if store is not None:
                store.reset()
            if args.warm:
                if store is not None:
                    store.preload()
                decode(model, prompt_ids, follow, args.max_tokens, store, routing, *prefill_order)
                if store is not None:
                    store.reset(keep_cache=True)
            if args.wait_go and r == 0:
                print("READY", flush=True)
                sys.stdin.readline()
            run = decode(model, prompt_ids, follow, args.max_tokens, store, routing, *prefill_order)
            if store is not None:
                run["hits"], run["misses"] = store.stats["hits"], store.stats["misses"]
                run["whole_calls"] = store.stats["whole_calls"]
                run["device_calls"] = store.stats["device_calls"]
                run["trace"] = store.routing_trace()
                run["prediction"] = store.prefetcher.prediction_stats()
                run["source_counters"] = _source_counters(store.source)
                run["arena_pinned"] = store.source.cuda_pinned  # before close
            if mode in ("sync", "inproc"):
                daemon_read.append(store.source.bytes_read - read0)
                store.source.close()
            if client is not None:
                daemon_read.append(_daemon_bytes(client) - read0)
                if daemon is not None:
                    daemon_peak = max(daemon_peak, proc_status(daemon[1]).get("VmHWM", 0))
                client.close()
        finally:  # however the run ends, its daemon stops and its folder in /tmp goes
            if daemon is not None:
                stop_daemon(daemon)
        runs.append(run)
        mx.clear_cache()

    last = runs[-1]
    for run in runs:
        if run["tokens"] != last["tokens"]:
            raise AssertionError(f"{mode}: tokens differ between runs")
    med = statistics.median
    result.update({
        "decode_tok_s": med(r["decode_tok_s"] for r in runs),
        "decode_tok_s_runs": [r["decode_tok_s"] for r in runs],
        "prefill_tok_s": med(r["prefill_tok_s"] for r in runs),
        "prefill_tok_s_runs": [r["prefill_tok_s"] for r in runs],
        "prompt_tokens": len(prompt_ids),
        # infer run's prefill: chunks of this many tokens, in this order
        "prefill": {"order": args.prefill, "step": args.prefill_step_size},
        "tokens": last["tokens"],
        "peak_rss_infer": peak.stop(),
        "peak_rss_iod": daemon_peak,
    })
    if store is None:
        result.update({"stall_fraction": 0.0, "hit_rate": 1.0, "misses": 0, "belady_misses": 0,
                       "bytes_read_per_token": 0.0, "recall": None, "precision": None})
        if args.draft != "none":
            result["draft"] = bench_draft.measure(args, mode, model, tokenizer, None, manifest, arena)
        return result
    capacity = {l: s.capacity for l, s in store.stacks.items()}
    if g is not None:
        layers = sorted(l.layer for l in manifest.layers)
        result.update({"rank": g.rank(), "moe_layers": [layers[0], layers[-1] + 1] if layers else []})
    total = last["hits"] + last["misses"]
    pred = last["prediction"]
    result.update({
        "cache_bytes": cache_bytes,
        "cache_experts_per_layer": sorted(set(capacity.values())),
        "stall_fraction": med(r["stall_s"] / r["decode_s"] for r in runs),
        "stall_fraction_runs": [r["stall_s"] / r["decode_s"] for r in runs],
        "hit_rate": last["hits"] / total if total else 1.0,
        "hits": last["hits"],
        "misses": last["misses"],
        "prefill_bytes": last["prefill_bytes"],  # read by the prefill
        # Belady from a cold cache: not a bound for a run that starts warm
        "belady_misses": None if args.warm else belady_misses(last["trace"], capacity),
        "decode_misses": last["decode_misses"],
        "bytes_read_per_token": last["bytes_read_per_token"],
        "recall": pred.get(1, {}).get("recall"),
        "precision": pred.get(1, {}).get("precision"),
        "prediction": {str(d): v for d, v in pred.items()},
        "stall_s_per_token": med(r["stall_s_per_token"] for r in runs),
        # the bytes bound: a token takes no less than its records' bytes read
        # at the disk's ceiling (iod doctor's, or --read-rate's cap); None
        # where the disk is unprofiled and uncapped (time_over_bytes_bound)
        "read_ceiling_bytes_s": read_ceiling(store, args.read_rate),
        # records into the stacks: how (streaming.copy_mode), the time a token,
        # the rate (decode), and on CUDA whether the arena's mapping is pinned
        # (a refused cudaHostRegister leaves pageable copies, several times slower)
        "copy_mode": copy_mode(),
        # MLX CUDA's graphs (MLX_USE_CUDA_GRAPHS): a streaming session turns
        # them off (infer.runtime.loader.load_streaming); None off CUDA
        "cuda_graphs": os.environ.get("MLX_USE_CUDA_GRAPHS", "1") != "0" if copy_mode() == "cuda" else None,
        "copy_s_per_token": med(r["copy_s_per_token"] for r in runs),
        "copy_gb_s": last["decode_bytes"] / last["copy_s"] / 1e9 if last["copy_s"] else None,
        "arena_pinned": last["arena_pinned"],
        "prefetched_bytes": last["prefetched_bytes"],
        "prefetch_unused_bytes": last["prefetch_unused_bytes"],
        # decode misses: ready in the arena when the call came (read ahead in
        # time), hinted but still being read (late), guessed but left out of
        # the plan (unplanned), never guessed (cold)
        "miss_split": last["miss_split"],
        # whether a call computes its cached experts while its misses are read,
        # and the calls that did
        "hits_first": store.hits_first,
        "hits_first_calls": last["hits_first_calls"],
        # one-token calls that computed experts the cache did not admit from
        # a stack of their own
        "aside_calls": last["aside_calls"],
        # the streamed layer calls' own host work a decode token (stall and
        # copy left out), and of it the prediction's: guesses, plan, hints
        "host_s_per_token": med(r["host_s_per_token"] for r in runs),
        "predict_s_per_token": med(r["predict_s_per_token"] for r in runs),
        # infer.runtime.gate: passes decoded with prediction on and off, and its probes
        "gate": last["gate"],
        # the reader's view (whole run): reads started as prefetches, and
        # prefetched records evicted from the staging arena unused
        "source_counters": last["source_counters"],
        "calibrated": store.prefetcher.calibration is not None,
        "decode_s_per_token": med(r["decode_s"] for r in runs) / max(args.max_tokens - 1, 1),
        "trace_calls": len(last["trace"]),
        # of those, calls of whole layers (the resident call: no sync)
        "whole_calls": last["whole_calls"],
        # and calls that found their experts on the GPU (infer.runtime.device: no sync)
        "device_calls": last["device_calls"],
    })
    _with_bound(result)
    if daemon_read:
        # everything read from disk, prefetches that were never used included
        result["disk_bytes_read"] = daemon_read[-1]
        result["disk_bytes_read_per_token"] = daemon_read[-1] / max(args.max_tokens, 1)
    if args.draft != "none":
        result["draft"] = bench_draft.measure(args, mode, model, tokenizer, store, manifest, arena)
    return result


def read_ceiling(store, read_rate_mb):
    """Bytes/s the disk can give at best: the doctor's ceiling for the model's
    disk, lowered to ``--read-rate`` (MB/s) where that caps the reads."""
    rates = [r for r in (store.prefetcher.disk_ceiling, read_rate_mb * 1e6 if read_rate_mb else None) if r]
    return min(rates) if rates else None


# ---- orchestration ------------------------------------------------------------------


def _worker_argv(args, mode, out, extra=()):
    argv = [sys.executable, "-m", "infer.tools.bench", "--worker", mode, "--out", str(out),
            "--model", str(args.model), "--prompt", args.prompt, "--budget", str(args.budget),
            "--read-rate", str(args.read_rate), "--max-tokens", str(args.max_tokens),
            "--runs", str(args.runs), "--depth", str(args.depth), *extra]
    if args.free_run:
        argv.append("--free-run")
    if args.warm:
        argv.append("--warm")
    argv += ["--hits-first", args.hits_first, "--predict", args.predict, "--device-wait", args.device_wait,
             "--prefill", args.prefill, "--prefill-step-size", str(args.prefill_step_size)]
    if args.raw_prompt:
        argv.append("--raw-prompt")
    if args.arena:
        argv += ["--arena", str(args.arena)]
    if args.dtype:
        argv += ["--dtype", args.dtype]
    if args.routing_trace:
        argv += ["--routing-trace", str(args.routing_trace)]
    return argv + bench_draft.worker_argv(args) + ["--run-index", str(args.run_index)]


def run_mode(args, mode, tmp, tag="") -> dict:
    out = Path(tmp) / f"{mode}{tag}.json"
    if args.ranks > 1 and mode != "resident":
        return run_ranks(args, mode, out)
    p = subprocess.run(_worker_argv(args, mode, out), capture_output=True, text=True)
    if p.returncode != 0 or not out.exists():
        raise RuntimeError(f"mode {mode} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(out.read_text())


def _rank_out(out: Path, rank: int) -> Path:
    return out.with_name(f"{out.stem}.rank{rank}.json")


def run_ranks(args, mode, out) -> dict:
    """One run of a streaming mode as ``args.ranks`` ranks (mlx.launch), each
    writing its own figures; merged by ``merge_ranks``."""
    from infer.runtime import distributed

    rc = distributed.launch("bench", args.ranks, _worker_argv(args, mode, out)[3:])
    outs = [_rank_out(out, r) for r in range(args.ranks)]
    if rc != 0 or not all(o.exists() for o in outs):
        raise RuntimeError(f"mode {mode} failed as {args.ranks} ranks ({rc})")
    return merge_ranks([json.loads(o.read_text()) for o in outs])


SUMMED = ("misses", "belady_misses", "decode_misses", "bytes_read_per_token", "stall_s_per_token",
          "copy_s_per_token", "host_s_per_token", "predict_s_per_token",
          "prefetched_bytes", "prefetch_unused_bytes", "trace_calls", "whole_calls", "device_calls", "cache_bytes",
          "disk_bytes_read", "disk_bytes_read_per_token")


def merge_ranks(ranks) -> dict:
    """A pipeline's figures from its ranks' (each over its own layers): the
    timings and tokens of rank 0 (every rank decodes the same tokens at the
    same pace), reads, misses and stalls summed (a token waits for each
    rank's stalls in turn), the largest peak memory of a rank, and every
    rank's own figures under ``ranks``."""
    first = min(ranks, key=lambda r: r["rank"])
    if any(r["tokens"] != first["tokens"] for r in ranks):
        raise RuntimeError(f"mode {first['mode']}: the ranks decoded different tokens")
    out = dict(first)
    for key in SUMMED:
        if all(r.get(key) is not None for r in ranks):
            out[key] = sum(r[key] for r in ranks)
    for key in ("stall_fraction", "stall_fraction_runs"):
        vals = [r[key] for r in ranks]
        out[key] = [sum(v) for v in zip(*vals)] if key.endswith("_runs") else sum(vals)
    hits = sum(r["hits"] for r in ranks)
    out["hits"] = hits
    out["hit_rate"] = hits / (hits + out["misses"]) if hits + out["misses"] else 1.0
    for key in ("peak_rss_infer", "peak_rss_iod"):
        out[key] = max(r[key] for r in ranks)
    out["ranks"] = [{k: r.get(k) for k in ("rank", "moe_layers", "misses", "belady_misses",
                                           "bytes_read_per_token", "stall_fraction", "hit_rate",
                                           "recall", "precision", "peak_rss_infer", "peak_rss_iod")}
                    for r in sorted(ranks, key=lambda r: r["rank"])]
    out.pop("rank", None)
    out.pop("moe_layers", None)
    return _with_bound(out)


def merge_runs(runs) -> dict:
    """One mode's figures from its single-run processes: medians of the
    timings (and every run's value), the largest peaks, the rest from the
    last run (the routing, hence the cache figures, is the same every run)."""
    med = statistics.median
    out = dict(runs[-1])
    for key in ("decode_tok_s", "prefill_tok_s", "stall_fraction", "stall_s_per_token"):
        if key in out:
            vals = [x for r in runs for x in r.get(key + "_runs", [r[key]])]
            out[key], out[key + "_runs"] = med(vals), vals
    for key in ("copy_s_per_token", "copy_gb_s", "host_s_per_token", "predict_s_per_token"):
        vals = [r[key] for r in runs if r.get(key) is not None]
        if vals:
            out[key] = med(vals)
    for key in ("peak_rss_infer", "peak_rss_iod"):
        out[key] = max(r[key] for r in runs)
    if "decode_s_per_token" in out:
        out["decode_s_per_token"] = med(r["decode_s_per_token"] for r in runs)
    if any(r["tokens"] != out["tokens"] for r in runs):
        raise RuntimeError(f"mode {out['mode']}: tokens differ between runs")
    return _with_bound(out)


def _with_bound(m) -> dict:
    """``m`` with ``time_over_bytes_bound``: a decode token's time over its
    bytes' time at the read ceiling (issue 15's measure: 1.0 is a token that
    costs only its reads), from its own (merged) figures; None if unknown."""
    if "read_ceiling_bytes_s" in m:
        rate, nbytes, tok_s = m["read_ceiling_bytes_s"], m["bytes_read_per_token"], m["decode_tok_s"]
        m["time_over_bytes_bound"] = (1 / tok_s) / (nbytes / rate) if rate and nbytes and tok_s else None
    return m


def run_sessions(args, tmp, shared: bool) -> dict:
    """N sessions decoding the same prompt at once, on one daemon or one each."""
    from infer.runtime.budget import staging_arena_bytes
    from shared.blob import Manifest

    n = args.sessions
    sub = argparse.Namespace(**vars(args))
    sub.runs = 1
    arena = args.arena or staging_arena_bytes(Manifest.load(args.model), args.depth)
    daemons, probes, procs, outs = [], [], [], []
    try:
        for _ in range(1 if shared else n):
            daemons.append(start_daemon(arena, args.read_rate))
            probes.append(make_source(args.model, str(daemons[-1][2])))
        before = [_daemon_bytes(c) for c in probes]
        for i in range(n):
            d = daemons[0 if shared else i]
            out = Path(tmp) / f"{'shared' if shared else 'private'}{i}.json"
            outs.append(out)
            procs.append(subprocess.Popen(
                _worker_argv(sub, "iod", out, ["--iod", str(d[2]), "--wait-go"]),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        for p in procs:  # all loaded and cold: start together
            line = p.stdout.readline()
            if not line.startswith("READY"):
                raise RuntimeError(f"session failed to start:\n{p.stderr.read()[-3000:]}")
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        for p in procs:
            _, err = p.communicate()
            if p.returncode != 0:
                raise RuntimeError(f"session failed ({p.returncode}):\n{err[-3000:]}")
        results = [json.loads(o.read_text()) for o in outs]
        bytes_read = sum(_daemon_bytes(c) - b for c, b in zip(probes, before))
    finally:
        for p in procs:  # sessions left waiting when another failed
            if p.poll() is None:
                p.kill()
                p.wait()
        for c in probes:
            c.close()
        for d in daemons:
            stop_daemon(d)
    return {"bytes_read": bytes_read,
            "decode_tok_s": [r["decode_tok_s"] for r in results],
            "stall_fraction": [r["stall_fraction"] for r in results],
            "tokens_equal": all(r["tokens"] == results[0]["tokens"] for r in results)}


def merge_rounds(rounds) -> dict:
    """Sessions of several rounds: per session, the median over the rounds;
    bytes read, the median round; every round's figures kept."""
    med = statistics.median
    n = len(rounds[0]["decode_tok_s"])
    return {
        "bytes_read": med(r["bytes_read"] for r in rounds),
        "decode_tok_s": [med(r["decode_tok_s"][i] for r in rounds) for i in range(n)],
        "stall_fraction": [med(r["stall_fraction"][i] for r in rounds) for i in range(n)],
        "tokens_equal": all(r["tokens_equal"] for r in rounds),
        "rounds": rounds,
    }


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def _prediction_cell(m) -> str:
    """recall/precision at depths 1..3, '-' where nothing was guessed."""
    pred = m.get("prediction") or {}
    return " ".join(f"{pred[str(d)]['recall']:.2f}/{pred[str(d)]['precision']:.2f}"
                    if str(d) in pred else "-" for d in (1, 2, 3))


def _host_cell(m) -> str:
    """Host ms a token (prediction's, and the share of passes that predicted)."""
    if "host_s_per_token" not in m:
        return "-"
    g = m.get("gate") or {}
    passes = g.get("passes_on", 0) + g.get("passes_off", 0)
    on = f", {g['passes_on'] / passes:.0%}" if passes and m["predict_s_per_token"] else ""
    return f"{m['host_s_per_token'] * 1e3:.2f} ({m['predict_s_per_token'] * 1e3:.2f}{on})"


def _columns(rows) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _stalled(m) -> str:
    """Decode misses not ready in the arena when their call came."""
    split = m.get("miss_split")
    return str(sum(v for k, v in split.items() if k != "ready")) if split else "-"


def table(report) -> str:
    """The modes' figures (one line each, under 120 columns), the streamed
    modes' prediction, and the ratios that say how fast streaming is."""
    modes = report["modes"]
    rows = [("mode", "tok/s", "prefill", "stall ms", "hit", "misses", "decode", "stalled",
             "MB/tok", "/bound", "rss infer", "rss iod")]
    pred = [("mode", "host ms/tok (predict, on)", "recall/prec d1 d2 d3", "unused MB", "belady")]
    for name, m in modes.items():
        if "skipped" in m or "error" in m:
            rows.append((name, ("skipped: " + m["skipped"]) if "skipped" in m else "failed") + ("",) * 10)
            continue
        rows.append((
            name, _fmt(m["decode_tok_s"], ".2f"), _fmt(m["prefill_tok_s"], ".1f"),
            _fmt(m.get("stall_s_per_token", 0.0) * 1e3, ".2f"), _fmt(m["hit_rate"], ".3f"),
            str(m["misses"]), str(m.get("decode_misses", 0)), _stalled(m),
            _fmt(m["bytes_read_per_token"] / 1e6, ".2f"), _fmt(m.get("time_over_bytes_bound"), ".2f"),
            format_size(m["peak_rss_infer"]), format_size(m["peak_rss_iod"]) if m["peak_rss_iod"] else "-"))
        if "host_s_per_token" in m:
            pred.append((name, _host_cell(m), _prediction_cell(m),
                         _fmt(m.get("prefetch_unused_bytes", 0) / 1e6, ".2f"), _fmt(m["belady_misses"], "d")))
    out = [_columns(rows)]
    if len(pred) > 1:
        out.append(_columns(pred))
    out += ratio_lines(modes)
    return "\n".join(out)


def ratio_lines(modes) -> list:
    """Decode speed of each streamed mode over the resident one and iod over
    sync, and the runs' spread."""
    tok = {n: m["decode_tok_s"] for n, m in modes.items() if m.get("decode_tok_s")}
    parts = [f"{n}/resident {tok[n] / tok['resident']:.2f}" for n in tok if n != "resident" and "resident" in tok]
    if "iod" in tok and "sync" in tok:
        parts.append(f"iod/sync {tok['iod'] / tok['sync']:.2f}")
    lines = ["decode speed: " + ", ".join(parts)] if parts else []
    runs = {n: m["decode_tok_s_runs"] for n, m in modes.items() if len(m.get("decode_tok_s_runs", [])) > 1}
    if runs:
        lines.append("runs (decode tok/s): " + "; ".join(
            f"{n} {min(v):.2f}-{max(v):.2f}" for n, v in runs.items()))
    return lines


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        from infer.runtime import distributed

        res = worker(args)
        out = _rank_out(args.out, res["rank"]) if "rank" in res else args.out
        out.write_text(json.dumps(res))
        distributed.leave_status(0)
        return 0

    from infer.runtime.loader import PrepFolderError, check_prep_folder

    try:
        manifest = check_prep_folder(args.model)
        cache_bytes = cache_bytes_of(args.budget, manifest, args.draft, args.model)
        if args.arena:
            from shared.slots import arena_size_problem

            why = arena_size_problem(parse_size(args.arena))  # what `iod start` would refuse
            if why:
                raise ValueError(why)
        if args.max_tokens < 2:  # the prefill's token and at least one decode step to time
            raise ValueError("--max-tokens must be at least 2")
        if not [m for m in args.modes.split(",") if m]:
            raise ValueError(f"--modes {args.modes!r} names no mode (choose from {', '.join(MODES)})")
        why = args.json and check_out(args.json, "--json")
        if why:
            raise ValueError(why)
        bench_draft.check_args(args)
        if args.routing_trace is not None:
            if args.draft != "none" or args.ranks > 1:
                raise ValueError("--routing-trace works without --draft and --ranks")
            from infer.tools.forced_routing import ForcedRouting
            from infer.tools.trace import TraceError, read

            try:
                routed = ForcedRouting(read(args.routing_trace)).check(manifest)
            except TraceError as e:
                raise ValueError(str(e)) from None
        if args.ranks > 1:
            from infer.runtime.distributed import check_pipelined

            check_pipelined(args.model)
            if args.draft != "none" or args.sessions:
                raise ValueError("--ranks works without --draft and --sessions")
    except (PrepFolderError, ValueError) as e:
        print(f"infer bench: {e}", file=sys.stderr)
        return 2
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        print(f"infer bench: unknown mode(s) {', '.join(bad)} (choose from {', '.join(MODES)})",
              file=sys.stderr)
        return 2
    report = {"model": str(Path(args.model).resolve()), "budget_bytes": cache_bytes,
              "expert_bytes": manifest.expert_bytes, "read_rate": args.read_rate * 1e6,
              "prompt": args.prompt, "max_tokens": args.max_tokens, "runs": args.runs,
              "teacher_forcing": not args.free_run, "depth": args.depth, "modes": {}}
    if args.routing_trace is not None:
        report["routing_replayed"] = routed
    if args.draft != "none":
        report["draft"] = {"kind": args.draft, "num_draft": args.num_draft, "verify": args.verify,
                           "tokens": args.draft_tokens or args.max_tokens}
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        # runs interleaved over the modes (one process each), so that a change
        # in the machine's load touches every mode alike
        one = argparse.Namespace(**{**vars(args), "runs": 1})
        runs = {m: [] for m in modes}
        for r in range(args.runs):
            one.run_index = r
            for mode in modes:
                if mode in report["modes"]:
                    continue  # skipped or failed
                print(f"infer bench: {mode} run {r + 1}/{args.runs} ...", file=sys.stderr,
                      flush=True)
                try:
                    res = run_mode(one, mode, tmp, str(r))
                except RuntimeError as e:
                    print(f"infer bench: {e}", file=sys.stderr)
                    report["modes"][mode] = {"mode": mode, "error": str(e)[-2000:]}
                    continue
                if "skipped" in res:
                    report["modes"][mode] = res
                else:
                    runs[mode].append(res)
        for mode in modes:
            if mode not in report["modes"]:
                try:
                    report["modes"][mode] = merge_runs(runs[mode])
                    bench_draft.merge_into(report["modes"][mode], runs[mode])
                except RuntimeError as e:
                    report["modes"][mode] = {"mode": mode, "error": str(e)}
        report["modes"] = {m: report["modes"][m] for m in modes}
        failed = [m for m, r in report["modes"].items() if "error" in r]
        ran = {m: r["tokens"] for m, r in report["modes"].items() if "tokens" in r}
        report["tokens_equal"] = len({tuple(t) for t in ran.values()}) <= 1
        if args.sessions > 0:
            print(f"infer bench: {args.sessions} sessions ...", file=sys.stderr, flush=True)
            try:
                # rounds alternate shared / private, like the modes' runs
                rounds = {True: [], False: []}
                for _ in range(max(args.runs, 1)):
                    for setup in (True, False):
                        rounds[setup].append(run_sessions(args, tmp, shared=setup))
            except RuntimeError as e:
                print(f"infer bench: {e}", file=sys.stderr)
                return 1
            shared, private = merge_rounds(rounds[True]), merge_rounds(rounds[False])
            alone = report["modes"].get("iod", {}).get("decode_tok_s")
            report["sessions"] = {"n": args.sessions, "shared": shared, "private": private,
                                  "alone_decode_tok_s": alone}
    print(table(report))
    draft_rows = bench_draft.table(report)
    if draft_rows:
        print(draft_rows)
    if "sessions" in report:
        s = report["sessions"]
        print(f"sessions {s['n']}: shared read {format_size(s['shared']['bytes_read'])}, "
              f"decode {['%.2f' % x for x in s['shared']['decode_tok_s']]} tok/s; private read "
              f"{format_size(s['private']['bytes_read'])}, decode "
              f"{['%.2f' % x for x in s['private']['decode_tok_s']]} tok/s")
    if args.json:
        try:
            write_atomic(args.json, lambda tmp: tmp.write_text(json.dumps(report, indent=1)))
        except OSError as e:  # checked before the runs; the disk may still fill or go away
            print(f"infer bench: cannot write {args.json} ({e})", file=sys.stderr)
            return 1
    if not report["tokens_equal"]:
        print("infer bench: the modes generated different tokens", file=sys.stderr)
        return 1
    for line in bench_draft.not_exact(report):
        print(f"infer bench: {line}", file=sys.stderr)
        failed.append(line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
