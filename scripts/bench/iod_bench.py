"""Measure iod: request -> ready latency (arena hit, disk read) and the
daemon's read throughput against a plain O_DIRECT read loop over the same
records, in the same run.

    python scripts/bench/iod_bench.py [--data /tmp/iod-bench] [--gb 1.5] [--record-mb 2]
                                [--workers 4] [--runs 3] [--json out.json]

The data set is a fake prep folder (random bytes, correct checksums), built
once and reused. Both read paths use O_DIRECT, the same number of threads
and the same random record order; the daemon also verifies every checksum.
"""

import argparse
import json
import mmap
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import native  # noqa: E402
from iod.reader import open_blob  # noqa: E402
from shared import protocol as P  # noqa: E402
from shared.blob import Manifest, plan_layer, record_checksum  # noqa: E402


def build(folder: Path, gb: float, record_mb: float, experts: int = 128) -> Manifest:
    try:
        return Manifest.load(folder)
    except Exception:
        pass
    folder.mkdir(parents=True, exist_ok=True)
    nbytes = int(record_mb * 1e6)
    layers = max(1, round(gb * 1e9 / (nbytes * experts)))
    block = bytearray(np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8).tobytes())
    out = []
    for i in range(layers):
        l = plan_layer(i, f"layers.{i}", [("blob", "weight", "uint8", [nbytes], 1, experts)])
        with open(folder / l.file, "wb") as f:
            for e in range(experts):
                block[:8] = ((i << 32) | e).to_bytes(8, "little")  # records differ
                l.checksums.append(f"{record_checksum(i, e, block):016x}")
                f.write(block)
                f.write(bytes(l.stride - l.record_bytes))
        out.append(l)
    m = Manifest(model_type="bench", layers=out)
    m.save(folder)
    return m


def records(m: Manifest, seed: int):
    keys = [(l.layer, e) for l in m.layers for e in range(l.num_experts)]
    np.random.default_rng(seed).shuffle(keys)
    return keys


PLAIN_SLOTS = 256


def plain_read(folder: Path, m: Manifest, keys, threads: int, checksum=False) -> float:
    """Bytes/s of N threads preading the records with O_DIRECT (and, with
    ``checksum``, verifying each as iod does). Like iod, each read lands in
    the next of 256 page-aligned slots of one shared, prefaulted mapping."""
    fds = {l.layer: open_blob(folder / l.file)[0] for l in m.layers}
    lay = {l.layer: l for l in m.layers}
    it = iter(enumerate(keys))
    lock = threading.Lock()
    total = [0]
    stride = m.max_stride
    area = mmap.mmap(-1, PLAIN_SLOTS * stride, mmap.MAP_SHARED)
    try:
        area.madvise(23)  # MADV_POPULATE_WRITE, as iod's prefault
    except (OSError, ValueError):
        pass
    mv = memoryview(area)

    def work():
        n = 0
        while True:
            with lock:
                item = next(it, None)
            if item is None:
                break
            i, k = item
            l = lay[k[0]]
            dest = mv[(i % PLAIN_SLOTS) * stride:][: l.stride]
            n += native.pread_full(fds[k[0]], dest, 0, l.stride, k[1] * l.stride)
            if checksum:
                assert record_checksum(k[0], k[1], dest[: l.record_bytes]) == l.checksum(k[1])
            dest.release()
        with lock:
            total[0] += n

    ts = [threading.Thread(target=work) for _ in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    dt = time.perf_counter() - t0
    for fd in fds.values():
        os.close(fd)
    mv.release()
    area.close()
    return total[0] / dt


def daemon_read(raw, hello, m: Manifest, keys, window: int) -> float:
    """Bytes/s the daemon read from disk (its own bytes_read counter, so
    records still in the arena from an earlier run count for nothing) while
    serving single-record DEMANDs with ``window`` outstanding; each grant is
    unpinned at once."""
    from shared.fixtures import unpin_refs

    before = raw.rt(P.Stats(raw.req())).stats["counters"]["bytes_read"]
    lay = {l.layer: l for l in m.layers}
    it = iter(keys)
    out = nbytes = 0

    def ask():
        k = next(it, None)
        if k is None:
            return 0
        raw.send(P.Demand(raw.req(), hello.model_id, k[0], [k[1]], 0))
        return 1

    t0 = time.perf_counter()
    for _ in range(window):
        out += ask()
    while out:
        msg = raw.recv()
        if not isinstance(msg, P.DemandOk):
            raise RuntimeError(f"daemon error: {msg}")
        out -= 1
        nbytes += lay[msg.layer].stride
        unpin_refs(hello, msg.refs)
        out += ask()
    dt = time.perf_counter() - t0
    read = raw.rt(P.Stats(raw.req())).stats["counters"]["bytes_read"] - before
    assert read >= 0.9 * nbytes, f"only {read} of {nbytes} bytes came from disk"
    return read / dt


def latency(client, keys, n: int):
    """Client-measured request -> ready, and the daemon's received -> sent, in
    us: for each of n records never read before, a read (a demand and a disk
    read), then the same record again (an arena hit: the session alone, no
    message); then arena hits back to back over records already there."""
    client.hop_log.clear()
    for layer, e in keys[:n]:
        for _ in range(2):
            client.fetch_into(layer, [e], lambda batch: None)
    logs = {"disk": client.hop_log[0::2], "hit": client.hop_log[1::2]}
    client.hop_log.clear()
    for _ in range(max(n // 16, 1)):
        for layer, e in keys[n - 16:n]:
            client.fetch_into(layer, [e], lambda batch: None)
    logs["hit_back_to_back"] = list(client.hop_log)
    assert all(h["kind"] == "demand" and h["read_start"] for h in logs["disk"]), \
        "expected disk reads"
    assert all(h["kind"] == "hit" for h in logs["hit"] + logs["hit_back_to_back"]), \
        "expected arena hits"
    out = {}
    for name, log in logs.items():
        rt = np.array([h["client_recv"] - h["client_send"] for h in log]) / 1e3
        row = {"n": len(rt), "client_p50_us": round(float(np.percentile(rt, 50)), 1),
               "client_p99_us": round(float(np.percentile(rt, 99)), 1)}
        if name == "disk":
            dm = np.array([h["sent"] - h["received"] for h in log]) / 1e3
            row["daemon_p50_us"] = round(float(np.percentile(dm, 50)), 1)
            row["daemon_p99_us"] = round(float(np.percentile(dm, 99)), 1)
        out[name] = row
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=Path("/tmp/iod-bench"))
    ap.add_argument("--gb", type=float, default=1.5)
    ap.add_argument("--record-mb", type=float, default=2.0)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--window", type=int, default=0, help="outstanding demands (default 4x workers)")
    ap.add_argument("--arena", default="64M",
                    help="small, so few records of one run are still there for the next")
    ap.add_argument("--hashers", type=int, default=2, help="the daemon's --hashers")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--lat-n", type=int, default=150)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    from infer.runtime.client import IodClient
    from shared.launch import spawn
    from shared.fixtures import Raw, short_dir

    t = time.perf_counter()
    m = build(args.data, args.gb, args.record_mb)
    total = m.expert_bytes
    print(f"data: {args.data} {len(m.layers)} layers x {m.layers[0].num_experts} records of "
          f"{m.layers[0].record_bytes / 1e6:.1f} MB = {total / 1e9:.2f} GB "
          f"(ready in {time.perf_counter() - t:.1f} s)", file=sys.stderr)
    folder = short_dir("iodb-")
    sock = folder / "iod.sock"
    proc, pid = spawn(sock, ["--arena", args.arena, "--workers", str(args.workers),
                             "--hashers", str(args.hashers)],
                      log=folder / "iod.log")
    result = {"data_gb": round(total / 1e9, 3), "record_bytes": m.layers[0].record_bytes,
              "workers": args.workers, "hashers": args.hashers, "runs": args.runs}
    try:
        c = IodClient(args.data, iod=str(sock), profile=True)
        while not c.stats()["arena"]["prefaulted"]:  # let the arena's pages commit first
            time.sleep(0.05)
        keys = records(m, 1)
        result["latency"] = latency(c, keys, args.lat_n)
        c.close()
        raw = Raw(sock)
        hello = raw.hello(args.data)
        window = args.window or 4 * args.workers
        plain, plain_ck, daemon, ratio, ratio_ck = [], [], [], [], []
        for run in range(args.runs):  # interleaved, so load changes hit all three alike
            p = plain_read(args.data, m, records(m, 100 + run), args.workers)
            d = daemon_read(raw, hello, m, records(m, 200 + run), window)
            pc = plain_read(args.data, m, records(m, 300 + run), args.workers, checksum=True)
            plain.append(p / 1e6)
            plain_ck.append(pc / 1e6)
            daemon.append(d / 1e6)
            ratio.append(d / p)
            ratio_ck.append(d / pc)
            print(f"run {run}: plain O_DIRECT {p / 1e6:.0f} MB/s, with checksums "
                  f"{pc / 1e6:.0f} MB/s, iod {d / 1e6:.0f} MB/s ({d / p:.0%}, {d / pc:.0%})",
                  file=sys.stderr)
        st = raw.rt(P.Stats(raw.req())).stats
        result["throughput_MBps"] = {
            "plain": [round(x) for x in plain], "iod": [round(x) for x in daemon],
            "plain_checksum": [round(x) for x in plain_ck],
            "ratio": [round(x, 3) for x in ratio],
            "ratio_vs_checksum": [round(x, 3) for x in ratio_ck],
            "ratio_vs_checksum_median": round(statistics.median(ratio_ck), 3),
            "plain_checksum_median": round(statistics.median(plain_ck)),
            "plain_median": round(statistics.median(plain)),
            "iod_median": round(statistics.median(daemon)),
            "ratio_median": round(statistics.median(ratio), 3),
            "ratio_min": round(min(ratio), 3), "ratio_max": round(max(ratio), 3)}
        result["read_mode"] = st["models"][0]["read_mode"]
        result["daemon_latency_us"] = st["latency_us"]
        raw.close()
    finally:
        proc.terminate()
        proc.wait(30)
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
