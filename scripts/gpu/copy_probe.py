"""Where a streamed layer's CUDA copies and small verify passes spend their
time, on the lent H200 (scripts/gpu/visit.sh probecopy):

- copies: records shaped like the small qwen3_next's (4-bit gate/up/down,
  bfloat16 scales and biases, 9 tensors) from a registered host mapping into
  MLX stacks by ``native.cuda_copy``, per batch size, with the GPU idle and
  behind queued kernels, pinned and staged; the same bytes as one row a
  record and as one row in all (whether a copy's time goes with its rows or
  its bytes); and a kernel reading the copied positions right after the
  copy against the same kernel again (a managed page that migrated would
  show there);
- kernels: ``mx.gather_qmm`` and a dense quantized matmul at 1-4 rows (a
  verify pass of K drafts has K+1 rows);
- a stack as one buffer of whole records (so a record is one copy), each
  tensor a strided view of it: whether ``gather_qmm`` on such views gives
  the contiguous stacks' bits, and whether its time grows with the stack
  (a kernel that copied the strided stack first would).

Prints one JSON object (and writes it with --json).
"""

import argparse
import ctypes
import json
import mmap
import statistics
import time

import mlx.core as mx
import numpy as np

import native

HIDDEN, INTER, EXPERTS, TOP, CAP = 1024, 384, 128, 8, 32


def median_ms(f, reps):
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out), min(out), max(out)


def cudart():
    """The CUDA runtime MLX loaded (the same handle), or None."""
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libcudart" in line}
    return ctypes.CDLL(sorted(paths)[0]) if paths else None


def pointer_type(rt, addr):
    """cudaPointerGetAttributes' type: 0 unregistered, 1 host, 2 device, 3 managed."""
    attrs = (ctypes.c_int * 64)()  # room for newer runtimes' reserved fields
    rc = rt.cudaPointerGetAttributes(attrs, ctypes.c_void_p(addr))
    return attrs[0] if rc == 0 else f"error {rc}"


def stacks(cap=CAP):
    """A stack of ``cap`` positions for each of the 9 tensors, as mlx-lm stores them."""
    out = []
    for rows, cols in ((INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER)):
        w = mx.random.normal((cap, rows, cols)).astype(mx.bfloat16)
        out += list(mx.quantize(w, group_size=64, bits=4))
    mx.eval(out)
    return out


def strided_stacks(cap, reps):
    """gather_qmm on a stack of ``cap`` positions, contiguous per tensor and
    as strided views of one buffer of whole records: {"equal", "contiguous_ms",
    "strided_ms"}, or {"error"} where the backend refuses the views."""
    arrays = stacks(cap)
    nbytes = [a.nbytes // cap for a in arrays]
    record = sum(nbytes)
    whole = mx.concatenate([a.reshape(cap, -1).view(mx.uint8) for a in arrays], axis=1)
    mx.eval(whole)
    views, off = [], 0
    for a, n in zip(arrays, nbytes):
        size = a.itemsize
        inner = [int(np.prod(a.shape[i + 1:])) for i in range(1, a.ndim)]
        views.append(mx.as_strided(whole.view(a.dtype), a.shape, [record // size] + inner, off // size))
        off += n
    xs = mx.random.normal((1, 1, 1, HIDDEN)).astype(mx.bfloat16)
    idx = mx.array(np.random.default_rng(cap).integers(0, cap, (1, 1, TOP)).astype(np.uint32))

    def g(w, s, b):
        return mx.gather_qmm(xs, w, s, b, rhs_indices=idx, transpose=True, group_size=64, bits=4)
    ref, got = g(*arrays[:3]), g(*views[:3])
    try:
        mx.eval(ref, got)
    except RuntimeError as e:  # MLX 0.32.4 on CUDA: "No implementation for problem shape"
        return {"error": str(e)}
    return {"equal": bool(mx.array_equal(ref, got).item()),
            "contiguous_ms": median_ms(lambda: mx.eval(g(*arrays[:3])), reps)[0],
            "strided_ms": median_ms(lambda: mx.eval(g(*views[:3])), reps)[0]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--busy-dim", type=int, default=4096, help="side of the queued matmuls")
    p.add_argument("--json")
    args = p.parse_args()
    res = {"device": str(mx.default_device())}
    arrays = stacks()
    nbytes = [a.nbytes // CAP for a in arrays]
    record = sum(nbytes)
    addrs = [native.address(a) for a in arrays]
    res["record_bytes"] = record
    native.cuda_available()  # loads the runtime, which cudart() then finds
    rt = cudart()
    res["stack_pointer_type"] = pointer_type(rt, addrs[0]) if rt else None

    # the arena stand-in: 64 records, each tensor's bytes one after another
    n_records = 64
    arena = mmap.mmap(-1, n_records * record)
    arena[:] = np.random.default_rng(0).integers(0, 255, n_records * record, dtype=np.uint8).tobytes()
    res["arena_pinned"] = bool(native.cuda_register(arena, True))
    res["arena_pointer_type"] = pointer_type(rt, native.address(arena)) if rt else None
    offs = np.cumsum([0] + nbytes[:-1])

    def plan(records, positions):
        rows = [(addrs[t] + pos * nbytes[t], r * record + int(offs[t]), nbytes[t])
                for t in range(len(arrays)) for r, pos in zip(records, positions)]
        return np.array(rows, dtype=np.int64)

    x = mx.random.normal((args.busy_dim, args.busy_dim)).astype(mx.bfloat16)
    mx.eval(x)

    def busy(n=20):  # ~ms of queued GPU work
        y = x
        for _ in range(n):
            y = y @ x
        mx.async_eval(y)
        return y

    def timed(pl, pinned, queue=busy):
        """(median, min, max) ms of the copy with the GPU idle, and the median
        ms of the same copy issued right after ``queue()`` queued GPU work."""
        native.cuda_copy(arena, pl, pinned)  # warm
        idle = median_ms(lambda: native.cuda_copy(arena, pl, pinned), args.reps)
        behind = []
        for _ in range(max(args.reps // 4, 3)):
            y = queue()
            t = time.perf_counter()
            native.cuda_copy(arena, pl, pinned)
            behind.append((time.perf_counter() - t) * 1e3)
            mx.eval(y)
        return idle, statistics.median(behind)

    # whole records into one uint8 stack: one row a record, or one for all
    landing = mx.zeros((CAP, record), dtype=mx.uint8)
    mx.eval(landing)
    land = native.address(landing)
    ways = {"pinned": True, "staged": False}
    copies = {}
    for k in (1, 2, 4, 8, 16):
        plans = {name: (plan(list(range(k)), list(range(k))), pinned) for name, pinned in ways.items()}
        plans["whole-records"] = (np.array([(land + r * record, r * record, record) for r in range(k)],
                                           dtype=np.int64), True)
        plans["one-row"] = (np.array([(land, 0, k * record)], dtype=np.int64), True)
        for name, (pl, pinned) in plans.items():
            idle, behind = timed(pl, pinned)
            copies[f"{k}-{name}"] = {
                "rows": len(pl), "bytes": k * record, "idle_ms": idle,
                "gb_s_idle": k * record / idle[0] / 1e6, "behind_kernels_ms": behind}
    res["copies"] = copies
    res["landing_verified"] = np.array(landing[:16]).tobytes() == bytes(arena[:16 * record])
    # each way's copies land: the stacks zeroed, 16 records copied to
    # positions 15..0, each tensor's rows then equal to the arena's bytes
    buf = np.frombuffer(arena, dtype=np.uint8)
    zeros = bytearray(n_records * record)
    verified = {}
    for name, pinned in ways.items():
        native.cuda_copy(zeros, plan(list(range(16)), list(range(16))), False)
        native.cuda_copy(arena, plan(list(range(16)), list(range(15, -1, -1))), pinned)
        verified[name] = all(
            np.array(arrays[t][15 - r].view(mx.uint8)).tobytes()
            == buf[r * record + int(offs[t]):][:nbytes[t]].tobytes()
            for t in range(len(arrays)) for r in range(16))
    res["copies_verified"] = verified
    if rt:  # the same copies into plain device memory (cudaMalloc), not MLX's
        dev = ctypes.c_void_p()
        if rt.cudaMalloc(ctypes.byref(dev), ctypes.c_size_t(CAP * record)) == 0:
            base = dev.value
            for k in (2, 8):  # record r's tensors one after another at r * record
                pl = np.array([(base + r * record + int(offs[t]), r * record + int(offs[t]), nbytes[t])
                               for t in range(len(arrays)) for r in range(k)], dtype=np.int64)
                idle, behind = timed(pl, True)
                res[f"device_dest_{k}"] = {"idle_ms": idle[0], "behind_kernels_ms": behind}
            rt.cudaFree(dev)
        # the stacks' copies behind a queue of small kernels (decode-sized)
        small = mx.random.normal((1, HIDDEN)).astype(mx.bfloat16)
        sw = mx.random.normal((HIDDEN, HIDDEN)).astype(mx.bfloat16)
        mx.eval(small, sw)
        def small_kernels():
            y = small
            for _ in range(400):
                y = y @ sw
            mx.async_eval(y)
            return y

        res["behind_small_kernels_2_ms"] = timed(plan([0, 1], [0, 1]), True, small_kernels)[1]

    # a kernel reading copied positions: first after the copy, then again
    idx = mx.array(np.arange(8, dtype=np.uint32))
    xs = mx.random.normal((1, 1, 1, HIDDEN)).astype(mx.bfloat16)
    w, s, b = arrays[0], arrays[1], arrays[2]

    def read_kernel():
        mx.eval(mx.gather_qmm(xs, w, s, b, rhs_indices=idx[None], transpose=True,
                              group_size=64, bits=4))
    read_kernel()
    after, again = [], []
    for i in range(args.reps):
        native.cuda_copy(arena, plan(list(range(8)), list(range(8))), True)
        t = time.perf_counter(); read_kernel(); after.append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter(); read_kernel(); again.append((time.perf_counter() - t) * 1e3)
    res["read_after_copy_ms"] = statistics.median(after)
    res["read_again_ms"] = statistics.median(again)

    # kernels at the row counts of verify passes
    kern = {}
    wd, sd, bd = mx.quantize(mx.random.normal((HIDDEN, HIDDEN)).astype(mx.bfloat16), group_size=64, bits=4)
    for m in (1, 2, 3, 4, 8):
        xm = mx.random.normal((m, 1, 1, 1, HIDDEN)).astype(mx.bfloat16)
        ids = mx.array(np.random.default_rng(m).integers(0, CAP, (m, 1, TOP)).astype(np.uint32))
        xd = mx.random.normal((m, HIDDEN)).astype(mx.bfloat16)

        def g():
            mx.eval(mx.gather_qmm(xm, w, s, b, rhs_indices=ids, transpose=True, group_size=64, bits=4))

        def d():
            mx.eval(mx.quantized_matmul(xd, wd, sd, bd, transpose=True, group_size=64, bits=4))
        g(); d()
        kern[m] = {"gather_qmm_ms": median_ms(g, args.reps)[0], "qmm_ms": median_ms(d, args.reps)[0]}
    res["kernels_by_rows"] = kern
    res["strided_stacks"] = {str(cap): strided_stacks(cap, args.reps) for cap in (32, 256)}
    native.cuda_unregister(arena)
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
