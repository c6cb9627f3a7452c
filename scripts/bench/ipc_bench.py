"""IPC latency of iod with 1, 2, 4 and 8 concurrent sessions.

    python scripts/bench/ipc_bench.py [--sessions 1,2,4,8] [--hits 400] [--misses 60]
                                [--record-bytes 2654208] [--runs 1] [--json PATH]

Each session is its own process with an ``IodClient`` (the client the
streaming modules use) on one shared daemon. Per request it measures

- request → ready: an arena hit is looked up and pinned by the session alone
  (no message); a miss is a DEMAND and its DEMAND_OK (``client_send`` →
  ``client_recv`` hop stamps), and for a read its hops' p50 (sent → daemon,
  queued → read, the read, read → reply sent, reply → client);
- request → MLX array: from the call to ``fetch_into`` until the record is in
  a layer stack's MLX arrays (``LayerStack.copy_in``, the streaming modules'
  own copy), and, beside it, a plain ``numpy.copyto`` of as many bytes.

Arena hits: all sessions cycle over a hot set read in beforehand. Disk reads:
each session cycles over its own share of a cold set twice the arena's size,
so eviction makes every request a read; each sample is classified by its hop
stamps (a demand with read_start set, or an arena hit), never by intent.
Hits and reads are measured in separate phases, all sessions starting together.

The default record size is one Qwen3-30B-A3B expert at 4 bits (gate, up and
down projections of 768×2048 with bf16 scales and biases: 2,654,208 bytes).
"""

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared.blob import Manifest, plan_layer, record_checksum  # noqa: E402

QWEN3_30B_EXPERT = 2_654_208
# a read's hops, as (from, to) hop stamps
HOPS = [("client_send", "received"), ("queued", "read_start"), ("read_start", "read_end"),
        ("read_end", "sent"), ("sent", "client_recv")]


def build(folder: Path, record_bytes: int, hot: int, cold: int) -> Manifest:
    """Layer 0: the hot set; layer 1: the cold set (random bytes, real checksums)."""
    folder.mkdir(parents=True, exist_ok=True)
    block = bytearray(np.random.default_rng(0).integers(0, 256, record_bytes, dtype=np.uint8).tobytes())
    layers = []
    for i, n in enumerate((hot, cold)):
        l = plan_layer(i, f"model.layers.{i}.mlp.switch_mlp",
                       [("blob", "weight", "uint8", [record_bytes], 1, n)])
        with open(folder / l.file, "wb") as f:
            for e in range(n):
                block[:8] = ((i << 32) | e).to_bytes(8, "little")  # every record differs
                l.checksums.append(f"{record_checksum(i, e, block):016x}")
                f.write(block)
                f.write(bytes(l.stride - l.record_bytes))
        layers.append(l)
    m = Manifest(model_type="ipc-bench", layers=layers)
    m.save(folder)
    return m


def _session(model, sock, index, n_sessions, hits, misses, run, barrier, out):
    """One session process: hit phase, then read phase; puts its samples on ``out``."""
    import mlx.core as mx

    from infer.runtime.client import IodClient
    from infer.runtime.streaming import LayerStack

    m = Manifest.load(model)
    hot_l, cold_l = m.layers
    c = IodClient(model, iod=sock, profile=True)
    stacks = {0: LayerStack(hot_l, 1), 1: LayerStack(cold_l, 1)}
    # as many source buffers as hot records, so the plain copy's source is as
    # cold in the CPU caches as the arena's
    plain_src = [np.ones(hot_l.record_bytes, np.uint8) for _ in range(hot_l.num_experts)]
    plain_dst = np.empty_like(plain_src[0])

    def one(layer, e):
        t0 = time.monotonic_ns()
        n = len(c.hop_log)
        c.fetch_into(layer, [e], lambda batch: stacks[layer].copy_in(batch, [0]))
        mx.eval(list(stacks[layer].arrays.values()))
        t1 = time.monotonic_ns()
        h = c.hop_log[n]
        read = h["kind"] == "demand" and bool(h["read_start"])
        held = (h["sent"] - h["received"]) / 1e3 if h["kind"] == "demand" else 0.0
        # a read's hops (µs): sent → daemon, queued → read starts, read, read → reply sent, → client
        hops = tuple((h[b] - h[a]) / 1e3 for a, b in HOPS) if read else None
        p0 = time.monotonic_ns()
        np.copyto(plain_dst, plain_src[e % len(plain_src)])
        plain = (time.monotonic_ns() - p0) / 1e3
        return ((h["client_recv"] - h["client_send"]) / 1e3, (t1 - t0) / 1e3, read, held,
                (t1 - h["client_recv"]) / 1e3, plain, h["kind"] == "hit", hops)

    samples = {"hit": [], "miss": []}
    for e in range(hot_l.num_experts):  # warm up; reads back a hot set a previous run evicted
        one(0, e)
    c.hop_log.clear()
    barrier.wait()
    for i in range(hits):
        samples["hit"].append(one(0, (i + index) % hot_l.num_experts))
    barrier.wait()
    mine = list(range(index, cold_l.num_experts, n_sessions))
    for i in range(misses):
        # later runs go on through the cold set: what earlier runs read may still be cached
        samples["miss"].append(one(1, mine[(run * misses + i) % len(mine)]))
    c.close()
    out.put((index, samples))


def _pct(values, q):
    return round(float(np.percentile(values, q)), 1) if values else None


def measure(model, sock, n, hits, misses, ctx, run=0):
    barrier = ctx.Barrier(n)
    out = ctx.Queue()
    procs = [ctx.Process(target=_session, args=(str(model), str(sock), i, n, hits, misses, run, barrier, out))
             for i in range(n)]
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
    ready = {"hit": [], "miss": []}
    mlx = {"hit": [], "miss": []}
    daemon = {"hit": [], "miss": []}
    copy = {"hit": [], "miss": []}
    plain = {"hit": [], "miss": []}
    hops = []  # per read: the HOPS' durations
    wrong = arena = 0
    for _, s in results:
        for phase, rows in s.items():
            for rtt, to_mlx, was_read, held, copied, plain_us, arena_hit, read_hops in rows:
                if read_hops is not None:
                    hops.append(read_hops)
                kind = "miss" if was_read else "hit"
                wrong += kind != phase
                arena += arena_hit and phase == "hit"
                ready[kind].append(rtt)
                mlx[kind].append(to_mlx)
                daemon[kind].append(held)
                copy[kind].append(copied)
                plain[kind].append(plain_us)
    row = {}
    for kind in ("hit", "miss"):
        row[f"{kind}_p50_us"] = _pct(ready[kind], 50)
        row[f"{kind}_p99_us"] = _pct(ready[kind], 99)
        row[f"{kind}_mlx_p50_us"] = _pct(mlx[kind], 50)
        row[f"{kind}_mlx_p99_us"] = _pct(mlx[kind], 99)
        row[f"{kind}_daemon_p50_us"] = _pct(daemon[kind], 50)  # received → sent in iod
        row[f"{kind}_daemon_p99_us"] = _pct(daemon[kind], 99)
        row[f"{kind}_copy_p50_us"] = _pct(copy[kind], 50)  # ready → in the stack's MLX arrays
        row[f"{kind}_copy_p99_us"] = _pct(copy[kind], 99)
        row[f"{kind}_plain_copy_p50_us"] = _pct(plain[kind], 50)  # numpy.copyto, same bytes
        row[f"{kind}_n"] = len(ready[kind])
    for (a, b), values in zip(HOPS, zip(*hops) if hops else [()] * len(HOPS)):
        row[f"read_{a}_to_{b}_p50_us"] = _pct(list(values), 50)
    row["misclassified"] = wrong  # samples whose kind differed from the phase's intent
    row["arena_hits"] = arena  # hit-phase requests served with no message
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", default="1,2,4,8")
    p.add_argument("--hits", type=int, default=400, help="arena-hit requests per session")
    p.add_argument("--misses", type=int, default=60, help="disk-read requests per session")
    p.add_argument("--record-bytes", type=int, default=QWEN3_30B_EXPERT)
    p.add_argument("--arena-mb", type=int, default=64)
    p.add_argument("--workers", type=int, default=4, help="daemon reader threads")
    p.add_argument("--runs", type=int, default=1, help="repeat and report the median run")
    p.add_argument("--dir", type=Path, default=None, help="where to build the data (default: a temp dir)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    from shared.launch import spawn

    work = Path(tempfile.mkdtemp(prefix="ipcb-", dir=args.dir or "/tmp"))
    try:
        slots = (args.arena_mb << 20) // (args.record_bytes + 4096)
        hot = max(8, min(16, slots // 3))
        cold = 2 * slots + 8
        t = time.time()
        build(work / "model", args.record_bytes, hot, cold)
        print(f"data: {hot} hot + {cold} cold records of {args.record_bytes} bytes "
              f"({time.time() - t:.1f} s); arena {args.arena_mb} MiB ≈ {slots} slots", file=sys.stderr)
        sock = work / "iod.sock"
        proc, _ = spawn(sock, ["--arena", f"{args.arena_mb}M", "--workers", str(args.workers)],
                        log=work / "iod.log")
        ctx = mp.get_context("spawn")
        result = {"record_bytes": args.record_bytes, "arena_mb": args.arena_mb,
                  "workers": args.workers, "cpus": os.cpu_count(), "runs": args.runs,
                  "sessions": {}}
        try:
            from infer.runtime.client import IodClient

            with IodClient(work / "model", iod=str(sock)) as c:  # the hot set into the arena
                c.read(0, range(hot))
                st = c.stats()
                result["read_mode"] = st["models"][0]["read_mode"]
            for n in [int(x) for x in args.sessions.split(",")]:
                runs = [measure(work / "model", sock, n, args.hits, args.misses, ctx, run)
                        for run in range(args.runs)]
                row = {}
                for key in runs[0]:
                    vals = [r[key] for r in runs if r[key] is not None]
                    row[key] = statistics.median(vals) if vals else None
                    if args.runs > 1 and key.endswith("_us") and vals:
                        row.setdefault("spread", {})[key] = [min(vals), max(vals)]
                result["sessions"][str(n)] = row
                print(f"{n} session(s): hit p50 {row['hit_p50_us']} p99 {row['hit_p99_us']} µs "
                      f"(→MLX p50 {row['hit_mlx_p50_us']} p99 {row['hit_mlx_p99_us']}) | "
                      f"miss p50 {row['miss_p50_us']} p99 {row['miss_p99_us']} µs "
                      f"(→MLX p99 {row['miss_mlx_p99_us']})", file=sys.stderr)
        finally:
            proc.terminate()
            proc.wait(30)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(result, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
