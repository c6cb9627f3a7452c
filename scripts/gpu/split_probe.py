#!/usr/bin/env python3
"""A demand miss's latency: one record read whole, or in N parallel chunks.

usage: split_probe.py FILE_OR_DIR [--make GB] [--sizes 0.66,2.5] [--chunks 1,2,4,8]
                      [--together 1,2] [--reads 200] [--json OUT]

Cold random reads that bypass the page cache (O_DIRECT), as iod reads: each
record at a random aligned offset of a file, read by one pread or split in
N page-aligned chunks read by N threads at once; with ``--together 2``, two
records at a time (two misses of one call). Pure Python (os.preadv releases
the GIL), so it runs on a bare machine. ``--make GB`` first writes a file
of that size at FILE.
"""
import argparse
import json
import mmap
import os
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

ALIGN = 4096


def make(path, gb):
    block = os.urandom(1 << 20)
    with open(path, "wb") as f:
        for _ in range(int(gb * 1024)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("path")
    p.add_argument("--make", type=float, default=0)
    p.add_argument("--sizes", default="0.66,2.5")
    p.add_argument("--chunks", default="1,2,4,8")
    p.add_argument("--together", default="1,2")
    p.add_argument("--reads", type=int, default=200)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.make:
        make(a.path, a.make)
    paths = [os.path.join(a.path, f) for f in sorted(os.listdir(a.path))] if os.path.isdir(a.path) else [a.path]
    paths = [q for q in paths if os.path.getsize(q) >= 64 << 20]  # the blobs, not the small files
    fds = [os.open(q, os.O_RDONLY | os.O_DIRECT) for q in paths]
    sizes = [os.fstat(fd).st_size for fd in fds]
    chunks = [int(c) for c in a.chunks.split(",")]
    together = [int(t) for t in a.together.split(",")]
    pool = ThreadPoolExecutor(max(chunks) * max(together))
    out = []
    for mb in [float(s) for s in a.sizes.split(",")]:
        rec = int(mb * 1e6) // ALIGN * ALIGN
        bufs = [mmap.mmap(-1, rec) for _ in range(max(together))]
        for t in together:
            times = {n: [] for n in chunks}
            random.seed(1)
            for _ in range(a.reads):
                for n in chunks:  # interleaved: drift hits all alike
                    futs = []
                    t0 = time.perf_counter()
                    for r in range(t):
                        i = random.randrange(len(fds))
                        off = random.randrange(sizes[i] // rec - 1) * rec
                        cuts = [k * rec // n // ALIGN * ALIGN for k in range(n)] + [rec]
                        view = memoryview(bufs[r])
                        futs += [pool.submit(os.preadv, fds[i], [view[cuts[k]:cuts[k + 1]]], off + cuts[k])
                                 for k in range(n)]
                    for f in futs:
                        f.result()
                    times[n].append(time.perf_counter() - t0)
            for n, v in times.items():
                med = statistics.median(v)
                q = statistics.quantiles(v, n=4)
                row = {"record_mb": rec / 1e6, "records": t, "chunks": n, "median_ms": med * 1e3,
                       "q1_ms": q[0] * 1e3, "q3_ms": q[2] * 1e3, "mb_s": t * rec / med / 1e6}
                out.append(row)
                print(f"{rec/1e6:5.2f} MB x{t}  chunks {n}: {med*1e3:7.3f} ms [{q[0]*1e3:.3f}-{q[2]*1e3:.3f}]"
                      f"  {row['mb_s']:6.0f} MB/s", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
