"""The device wait: a decode call's routed ids mapped to stack positions on
the GPU, the host told the ids without stopping it, and the GPU waiting for
a miss, not the host for the GPU (MLX CUDA and Metal).

Per streamed layer a kernel reads the routed ids, looks each up in the
layer's table (expert -> stack position, -1 if not cached; host memory the
GPU reads, kept current by the host), and writes the ids and a posted turn
to a mailbox in host memory both sides see. With every expert cached it
hands the positions to the layer's ``gather_qmm`` at once: the call is
built and run as the resident one is, no host read of device memory. With
a miss it waits for the layer's granted turn. The host, once the forward
is built, queues all of it as the resident model is queued, while a thread
of its own walks the layers in order: it reads each layer's ids as the GPU
posts them, places the misses (``Placement``), has the source read them,
has them copied into their rows (``copy_in``), writes the rows and grants
the turn; the GPU goes on. A table is rewritten from its placement when
the next forward is built, before any of its kernels is queued.

The copy: on CUDA the waiting kernel itself copies, from pinned host
memory (the arena, or a staging buffer), the chunks of rows the host plans
in the mailbox, so the serving thread makes no CUDA call: its own
cudaMemcpyAsync hung on an H100 (2026-12-07) with the kernel waiting and
MLX's async_eval waiting too. On Metal the host copies into the unified
memory.

Exact: the expert math is the same ``gather_qmm`` on the same stack rows
as the host-synced call. Safe by order: a row is written only while its
layer's kernel of this forward waits, after every earlier kernel that read
it ran, and before any later forward's kernels are queued.

Where this does not run (the CPU, a stack not written in place, a cache
narrower than a call) each call syncs at its router as before; the run's
summary says which path ran.

Backends: MLX CUDA (``mx.fast.cuda_kernel``; the mailbox, tables and
staging buffer pinned host memory the kernel reaches by address) and Metal
(``mx.fast.metal_kernel``; they are MLX arrays in the unified memory, and
the kernel reads and writes them with system-scope fences on
coherent(system) memory, as MLX's own fence_wait / fence_update kernels
do). The CUDA path runs only when asked for (``wanted``) until it is
measured; the Metal one is built by the same host code, tested on the CPU
with its memory, and not run: a kernel that does not build or pass its
check at load leaves the session synced."""

import hashlib
import mmap
import sys
import threading
import time

import mlx.core as mx
import numpy as np

import native

from infer.args import first_line

MAX_K = 32  # ids a call may post (top k x one token); wider calls sync
TIMEOUT_NS = 20_000_000_000  # a kernel left waiting this long gives up
SPIN_S = 0.002  # a post is polled this long (a layer's compute) before the host sleeps between polls
CHECK_S = 5  # the load's check waits this long for a kernel's post
# words: 0 the turn, 1 the error (layer slot + 1 of a timed-out wait), 2 the
# last copy chunk's number, 3 its rows
HEAD = 16
# CUDA: the kernel that waits also copies a miss's records in, so the
# serving thread makes no CUDA call (one that hung, an H100, 2026-12-07):
# BLOCKS blocks of THREADS threads read them from pinned host memory (the
# arena, or a staging buffer) and write them to the stack rows
BLOCKS, THREADS = 32, 256
MAX_ROWS = 512  # copy rows (a record's tensor each) a chunk holds
STAGE_BYTES = 32 << 20  # the staging buffer, for records from an arena CUDA did not pin

_CUDA_HEADER = f"""
#define MAX_K {MAX_K}
#define MAX_ROWS {MAX_ROWS}
#define TIMEOUT {TIMEOUT_NS}ULL
// a load from memory the host rewrites between chunks: .cv never hits a
// line cached from an earlier chunk
__device__ inline uint4 iod_load16(const uint4* p) {{
    uint4 v;
    asm volatile("ld.global.cv.v4.u32 {{%0, %1, %2, %3}}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}}
"""

# inputs: ids (N), guess (G), box_in: the mailbox's address, the table's,
# the layer slot, the slots, the guesses a slot holds, and where the done
# flags and the copy plan lie in the mailbox (words)
_CUDA_SOURCE = """
    const unsigned long long* box = (const unsigned long long*)box_in;
    volatile int* mail = (volatile int*)box[0];
    volatile const int* table = (volatile const int*)box[1];
    const int slot = (int)box[2];
    const int layers = (int)box[3];
    volatile int* posted = mail + 16;
    volatile int* granted = posted + layers;
    volatile int* ids_out = granted + layers + slot * MAX_K;
    volatile int* rows_in = granted + layers + (layers + slot) * MAX_K;
    volatile int* guess_out = granted + layers + 2 * layers * MAX_K + slot * (int)box[4];
    volatile int* done = mail + box[5];
    volatile const long long* plan = (volatile const long long*)(mail + box[6]);
    __shared__ int row[N];
    __shared__ int any_miss, chunk;
    __shared__ long long entry[3 * MAX_ROWS];
    const int t = threadIdx.x, b = blockIdx.x;
    const int turn = mail[0];
    if (t == 0) any_miss = 0;
    __syncthreads();
    if (t < N) {
        int e = (int)ids[t];
        row[t] = table[e];
        if (row[t] < 0) atomicOr(&any_miss, 1);
        if (b == 0) ids_out[t] = e;
    }
    if (b == 0) for (int i = t; i < G; i += blockDim.x) guess_out[i] = (int)guess[i];
    __threadfence_system();
    __syncthreads();
    if (b == 0 && t == 0) {
        posted[slot] = turn;
        __threadfence_system();
    }
    // a miss: copy each chunk the host writes (once a block: its done flag
    // says the last it copied; only the block writes it) until the grant
    int last = done[b];
    while (any_miss) {
        if (t == 0) {
            unsigned long long t0, now;
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
            chunk = 0;
            for (;;) {
                int c = mail[2];
                if (c != last) { chunk = c; break; }
                if (granted[slot] == turn) break;
                __nanosleep(b == 0 ? 500 : 2000);  // (fewer polls over the bus: block 0 gives the pace)
                asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
                if (now - t0 > TIMEOUT) { mail[1] = slot + 1; break; }
            }
            __threadfence_system();
        }
        __syncthreads();
        const int c = chunk;
        if (c == 0) break;
        last = c;
        const int rows = mail[3];
        for (int i = t; i < 3 * rows; i += blockDim.x) entry[i] = plan[i];
        __syncthreads();
        const long long first = (long long)b * blockDim.x + t, step = (long long)gridDim.x * blockDim.x;
        for (int r = 0; r < rows; r++) {
            char* dst = (char*)entry[3 * r];
            const char* src = (const char*)entry[3 * r + 1];
            const long long n = entry[3 * r + 2];
            long long body = 0;
            if ((((unsigned long long)dst | (unsigned long long)src) & 15) == 0) {
                body = n / 16;
                for (long long j = first; j < body; j += step)
                    ((uint4*)dst)[j] = iod_load16((const uint4*)src + j);
                body *= 16;
            }
            for (long long j = body + first; j < n; j += step)
                dst[j] = *(volatile const char*)(src + j);
        }
        __syncthreads();  // (every load of the block done: the host may reuse its source)
        if (t == 0) {
            __threadfence_system();
            done[b] = c;
        }
        __syncthreads();
    }
    if (b == 0 && t < N) {
        int r = row[t] >= 0 ? row[t] : rows_in[t];
        pos[t] = (uint32_t)(r >= 0 ? r : 0);
    }
"""


# one simdgroup; reads and writes of the mailbox go through coherent(system)
# memory with system-scope fences, so the CPU sees them while the kernel
# runs and the kernel sees the CPU's (MLX's fence.metal does the same); no
# clock on the GPU: SPIN_LIMIT polls, about 20 s at 100 ns a poll
_METAL_HEADER = """
#pragma METAL internals : enable
#ifndef __METAL_MEMORY_SCOPE_SYSTEM__
#define __METAL_MEMORY_SCOPE_SYSTEM__ 3
#endif
#define SYSTEM_FENCE() metal::atomic_thread_fence(metal::mem_flags::mem_device, \\
    metal::memory_order_seq_cst, static_cast<metal::thread_scope>(__METAL_MEMORY_SCOPE_SYSTEM__))
typedef volatile coherent(system) device int* shared_words;
"""

_METAL_SOURCE = """
    const uint t = thread_position_in_grid.x;
    const int slot = args[0];
    const int layers = args[1];
    const device int* tab = table + args[2];
    shared_words box = (shared_words)mail;
    shared_words posted = box + 16;
    shared_words granted = posted + layers;
    shared_words ids_out = granted + layers + slot * MAX_K;
    shared_words rows_in = ids_out + layers * MAX_K;
    shared_words guess_out = granted + layers + 2 * layers * MAX_K + slot * args[3];
    const int turn = box[0];
    int row = 0;
    if (t < N) {
        int e = (int)ids[t];
        ids_out[t] = e;
        row = tab[e];
    }
    for (uint i = t; i < (uint)G; i += 32) guess_out[i] = (int)guess[i];
    const bool any_miss = simd_any(row < 0);
    SYSTEM_FENCE();
    threadgroup_barrier(mem_flags::mem_device);
    if (t == 0) {
        posted[slot] = turn;
        SYSTEM_FENCE();
        if (any_miss) {
            for (ulong spins = 0; granted[slot] != turn; spins++) {
                SYSTEM_FENCE();
                if (spins > SPIN_LIMIT) { box[1] = slot + 1; break; }
            }
            SYSTEM_FENCE();
        }
    }
    threadgroup_barrier(mem_flags::mem_device);
    if (t < N) {
        int r = row >= 0 ? row : rows_in[t];
        pos[t] = (uint32_t)(r >= 0 ? r : 0);
    }
"""


def path_line(calls, device_wait) -> str:
    """Which path the streamed layers' calls took (``infer run``'s summary, the profile)."""
    if device_wait:
        line = (f"Streamed layers: {calls['device']} calls found their experts on the GPU and "
                f"waited there for misses (device wait), {calls['synced']} synced at their router")
    else:
        line = (f"Streamed layers: {calls['synced']} calls synced at their router (no device wait: "
                f"it needs Metal with --device-wait auto, or MLX CUDA or Metal with --device-wait on, "
                f"and a kernel that passes its check at load)")
    if calls["whole"]:
        line += f", {calls['whole']} ran as whole layers (no sync)"
    return line


def wanted(mode, kind) -> bool:
    """Whether a session of ``--device-wait`` ``mode`` ("auto", "on", "off")
    tries the device wait on backend ``kind`` ("cuda", "metal", None).
    "auto" leaves MLX CUDA synced: there, on an H100 (2026-12-07), the first
    forward hung with the serving thread inside its copy (cudaMemcpyAsync)
    while the queueing thread was inside MLX's async_eval, so a CUDA call
    of the serving thread may wait for the GPU that waits for it. On Metal
    the serving thread makes no GPU call (unified memory: host copies)."""
    return kind is not None and (mode == "on" or (mode == "auto" and kind == "metal"))


def backend():
    """The device wait's backend here: "cuda", "metal", or None (the CPU)."""
    if mx.default_device() == mx.cpu:
        return None
    if mx.metal.is_available():
        return "metal"
    return "cuda" if mx.cuda.is_available() and native.cuda_available() else None


def _kernel_name(source) -> str:
    """The kernel's name, with a digest of its source: MLX keeps a compiled
    kernel by name (in the process and in its kernel cache on disk), so an
    edited kernel must not be found under its old name."""
    return "iod_device_wait_" + hashlib.sha1(source.encode()).hexdigest()[:12]


def _queue(y):
    """Start the GPU on the graph up to ``y`` (a test runs a fake GPU here)."""
    mx.async_eval(y)


def _evaluated(y):
    """``y``'s values, once the GPU has run it (a test runs a fake GPU here)."""
    return np.array(y).tolist()


def _pinned(nbytes):
    """A page-aligned int32 buffer registered with CUDA, and the address
    kernels reach it at; None where CUDA refuses."""
    buf = mmap.mmap(-1, max(nbytes, mmap.PAGESIZE))
    if not native.cuda_register(buf, False):
        buf.close()
        return None
    dev = native.cuda_device_pointer(buf)
    if not dev:
        native.cuda_unregister(buf)
        buf.close()
        return None
    return buf, dev


def _shared(words):
    """An int32 MLX array in the memory the host and a Metal kernel both
    see (unified memory: the host writes it through its buffer)."""
    a = mx.array(np.zeros(words, dtype=np.int32))
    mx.eval(a)
    return a


class DeviceWait:
    """The mailbox, the layers' tables and the calls of the forward being
    built; one per ExpertStore (``ExpertStore.device``)."""

    def __init__(self, store, layers, backend="cuda"):
        self.store = store
        self.backend = backend
        self.slot = {layer: i for i, layer in enumerate(sorted(layers))}
        n = len(self.slot)
        self.experts = max(store.layouts[l].num_experts for l in self.slot)
        # guessed ids a call may post: every expert of each layer guessed
        # ahead (a calibration's ranks go that far at most); more posts none
        self.max_guessed = max(store.prefetcher.depth, 1) * self.experts
        guesses_at = HEAD + 2 * n + 2 * n * MAX_K
        self._done_at = guesses_at + n * self.max_guessed  # BLOCKS words: each block's last chunk
        self._plan_at = self._done_at + BLOCKS + (self._done_at + BLOCKS) % 2  # (int64 aligned)
        words, table_words = self._plan_at + 6 * MAX_ROWS, n * self.experts
        # what differs between sessions goes in each call's inputs: a kernel
        # is compiled once a process (per name and template)
        layout = [n, self.max_guessed, self._done_at, self._plan_at]
        self._stage = None
        if backend == "cuda":
            mail, table, stage = _pinned(4 * words), _pinned(4 * table_words), _pinned(STAGE_BYTES)
            if mail is None or table is None or stage is None:
                for pinned in (mail, table, stage):
                    if pinned is not None:
                        native.cuda_unregister(pinned[0])
                raise OSError("CUDA did not pin the mailbox")
            (self._mail_buf, mail_dev), (self._table_buf, table_dev) = mail, table
            self._stage, self._stage_dev = stage
            # each kernel's one input beyond its ids: the addresses it reaches
            self._inputs = {layer: [mx.array(np.array(
                [mail_dev, table_dev + 4 * i * self.experts, i, *layout], dtype=np.uint64))]
                for layer, i in self.slot.items()}
            self._kernel = mx.fast.cuda_kernel(
                name=_kernel_name(_CUDA_HEADER + _CUDA_SOURCE), input_names=["ids", "guess", "box_in"],
                output_names=["pos"], source=_CUDA_SOURCE, header=_CUDA_HEADER)
            self._grid, self._block = (BLOCKS * THREADS, 1, 1), (THREADS, 1, 1)
            # the load's check copies into it (``works``); its address taken now, as a stack's
            self._probe = mx.zeros((64,), dtype=mx.uint8)
            mx.eval(self._probe)
            self._probe_addr = native.address(self._probe)
        else:
            self._mail_buf, self._table_buf = _shared(words), _shared(table_words)
            self._inputs = {layer: [self._mail_buf, self._table_buf,
                                    mx.array([i, n, i * self.experts, self.max_guessed], dtype=mx.int32)]
                            for layer, i in self.slot.items()}
            header = _METAL_HEADER + f"#define MAX_K {MAX_K}\n#define SPIN_LIMIT {TIMEOUT_NS // 100}UL\n"
            self._kernel = mx.fast.metal_kernel(
                name=_kernel_name(header + _METAL_SOURCE),
                input_names=["ids", "guess", "mail", "table", "args"], output_names=["pos"],
                source=_METAL_SOURCE, header=header)
            self._grid = self._block = (32, 1, 1)  # one simdgroup
        self.mail = np.frombuffer(self._mail_buf, dtype=np.int32, count=words)
        self.mail[:] = 0
        self.posted = self.mail[HEAD:HEAD + n]
        self.granted = self.mail[HEAD + n:HEAD + 2 * n]
        self.ids = self.mail[HEAD + 2 * n:HEAD + 2 * n + n * MAX_K].reshape(n, MAX_K)
        self.rows = self.mail[HEAD + 2 * n + n * MAX_K:guesses_at].reshape(n, MAX_K)
        self.guesses = self.mail[guesses_at:self._done_at].reshape(n, self.max_guessed)
        self.done = self.mail[self._done_at:self._done_at + BLOCKS]
        self.plan = self.mail[self._plan_at:].view(np.int64).reshape(MAX_ROWS, 3)
        self.chunk = 0  # the last copy chunk's number
        self.tables = np.frombuffer(self._table_buf, dtype=np.int32,
                                    count=table_words).reshape(n, self.experts)
        self.tables[:] = -1
        self._no_guess = mx.zeros((1,), dtype=mx.uint32)
        self.turn = 1
        self.mail[0] = self.turn
        # (layer, stack, ids posted, output, guesses' readback or None, guessed
        # ids posted) of the forward being built
        self.calls = []
        self._called = set()  # their layers
        self.timeout_s = TIMEOUT_NS / 1e9

    @classmethod
    def make(cls, store, mode="auto"):
        """A DeviceWait for ``store``'s cached layers where ``mode`` wants
        one on this backend (``wanted``: MLX CUDA or Metal, records copied in
        place) and its kernel passes its check here, else None (one line on
        stderr says why its kernel did not)."""
        kind = backend()
        if not wanted(mode, kind):
            return None
        try:
            dw = cls(store, store.cached, kind)
        except (OSError, RuntimeError, ValueError) as e:
            why = first_line(e)
        else:
            try:
                if dw.works():
                    dw.attach(store.source)
                    return dw
                why = "its kernel failed its check at load"
            except (RuntimeError, ValueError) as e:  # (a kernel that does not build)
                why = first_line(e)
            dw.close()
        print(f"infer: no device wait on this {kind} GPU ({why}); streamed calls sync at "
              f"their routers", file=sys.stderr)
        return None

    def works(self) -> bool:
        """Run the kernel on the first slot before any forward, on a hit and
        then on a miss granted while it waits, and check what it wrote and
        posted, and (CUDA) what it copied while it waited: a kernel this GPU
        or driver does not build or run right (one whose writes the host
        does not see while it runs, or that does not see the host's) leaves
        the session on the synced path instead of failing its first token.
        The slot is left as it was (its table -1, nothing posted or granted)."""
        layer = next(iter(self.slot))
        i, turn = self.slot[layer], self.turn
        ids = mx.array([1, 2], dtype=mx.uint32)
        guess = mx.array([7, 8, 9], dtype=mx.uint32)
        try:
            self.tables[i, [1, 2]] = 5
            hit = _evaluated(self._launch(layer, ids, guess))
            posted = int(self.posted[i]) == turn and self.ids[i, :2].tolist() == [1, 2] \
                and self.guesses[i, :3].tolist() == [7, 8, 9]
            self.tables[i, [1, 2]] = -1
            self.posted[i] = 0
            miss = self._launch(layer, ids, None)
            _queue(miss)
            # its rows written once it has posted: a kernel that did not wait reads zeros
            seen = self._posted(i, turn, CHECK_S)
            copied = self.backend != "cuda"
            if seen and not copied:  # it copies a chunk from the staging buffer
                pattern = (np.arange(64, dtype=np.uint8) * 3 + 1).tolist()
                self._stage[:64] = bytes(pattern)
                try:
                    self._copy_chunk(np.array([[self._probe_addr, self._stage_dev, 64]]), CHECK_S)
                    copied = True
                except TimeoutError:
                    pass
            self.rows[i, :2] = [3, 4]
            self._grant(i, turn)
            miss = _evaluated(miss)
            if copied and self.backend == "cuda":
                copied = np.array(self._probe).tolist() == pattern
            return (hit == [5, 5] and posted and seen and miss == [3, 4] and copied
                    and not self.mail[1])
        finally:
            self.tables[i] = -1
            self.posted[i] = self.granted[i] = 0  # (no forward's turn is 0)
            self.ids[i] = self.rows[i] = self.guesses[i] = 0
            self.mail[1] = 0

    def attach(self, source):
        """A source the store serves from: on CUDA its arena is pinned now,
        by the thread that builds the forwards, so the kernels copy straight
        from it and the serving thread registers nothing (one it could not
        pin goes through the staging buffer)."""
        if self.backend == "cuda" and source is not None:
            source.pin_for_cuda()

    def close(self):
        """Give the mailbox and tables back (no kernel may run after)."""
        if self.backend == "cuda":
            for buf in (self._mail_buf, self._table_buf, self._stage):
                native.cuda_unregister(buf)
        self.mail = self.posted = self.granted = self.ids = self.rows = self.guesses = None
        self.done = self.plan = self.tables = None  # (the mappings go with the last view of them)
        self._inputs = self._mail_buf = self._table_buf = self._stage = None

    def fits(self, stack, n):
        """Whether a call of ``n`` ids on ``stack`` can wait on the device:
        a stack written in place by CUDA copies, holding at least the call."""
        written = "cuda" if self.backend == "cuda" else "host"  # (Metal: unified memory)
        return (stack.mode == written and stack.in_place and 0 < n <= MAX_K
                and n <= stack.capacity and stack.layout.layer in self.slot)

    def copy_in(self, stack, batch, positions):
        """The serving thread's copy of a miss: ``batch``'s records into
        ``positions`` of ``stack``, while the layer's kernel waits. On CUDA
        the kernel copies them, straight from the arena where CUDA pinned
        it, else from the staging buffer the host fills; the host writes
        the plan and returns once the kernel has read every record (their
        slots may be unpinned then). On Metal the host copies into the
        unified memory itself (``LayerStack.copy_in``)."""
        if self.backend != "cuda":
            stack.copy_in(batch, positions)
            return
        regions = stack.regions(batch, positions)
        base = getattr(batch.source, "cuda_address", 0)
        if base:
            regions[:, 1] += base
            for k in range(0, len(regions), MAX_ROWS):
                self._copy_chunk(regions[k:k + MAX_ROWS], self.timeout_s)
            return
        src = np.frombuffer(batch.buf, dtype=np.uint8)
        plan, used = [], 0
        for dst, off, n in regions.tolist():
            for k in range(0, n, STAGE_BYTES):  # (a tensor larger than the buffer, in pieces)
                m = min(n - k, STAGE_BYTES)
                if used + m > STAGE_BYTES or len(plan) == MAX_ROWS:
                    self._copy_chunk(np.array(plan, dtype=np.int64), self.timeout_s)
                    plan, used = [], 0
                self._stage[used:used + m] = src[off + k:off + k + m]
                plan.append((dst + k, self._stage_dev + used, m))
                used = (used + m + 15) // 16 * 16  # (16-byte copies where the rows allow)
        if plan:
            self._copy_chunk(np.array(plan, dtype=np.int64), self.timeout_s)

    def _copy_chunk(self, plan, timeout_s):
        """Have the waiting kernel copy ``plan`` (int64 rows of destination,
        source address in pinned memory, bytes; at most MAX_ROWS), and wait
        until each of its blocks has."""
        self.plan[:len(plan)] = plan
        self.mail[3] = len(plan)
        self.chunk += 1
        native.store_u32(self._mail_buf, 8, self.chunk)  # (after the plan, on any CPU)
        for b in range(BLOCKS):
            if not native.wait_u32(self._mail_buf, 4 * (self._done_at + b), self.chunk, SPIN_S,
                                   timeout_s):
                self.done[:] = self.chunk  # no later kernel may take it up
                raise TimeoutError(f"device wait: the GPU did not copy a miss's records "
                                   f"in {timeout_s:.0f} s")

    def waiting(self, layer) -> bool:
        """Whether the forward being built has a call of ``layer`` already:
        its mailbox slot is taken until ``finish`` (a second call syncs)."""
        return layer in self._called

    def positions(self, layer, stack, indices, guess=None):
        """The stack positions of ``indices`` (uint32, same shape), found on
        the device; the host is told the ids, and ``guess`` (the next layers'
        guessed ids, flat uint32, or None) with them, when it ``finish``es."""
        if stack.table_stale:
            self.sync_table(layer, stack)
        ids = indices.reshape(-1)
        if ids.dtype != mx.uint32:  # (one compiled kernel per N: its inputs' types fixed)
            ids = ids.astype(mx.uint32)
        return self._launch(layer, ids, guess).reshape(indices.shape)

    def _launch(self, layer, ids, guess):
        """The kernel on ``layer``'s slot: ``ids`` (flat uint32) posted, with
        ``guess`` (flat uint32, or None) beside them; their positions."""
        g = 0 if guess is None else guess.size
        return self._kernel(
            inputs=[ids, self._no_guess if guess is None else guess, *self._inputs[layer]],
            template=[("N", ids.size), ("G", g)], grid=self._grid, threadgroup=self._block,
            output_shapes=[(ids.size,)], output_dtypes=[mx.uint32])[0]

    def called(self, layer, stack, n, y, readback=None, guessed=0):
        """Note a call built on the device path, ``y`` its output; it posts
        ``guessed`` ids of guesses, which ``readback`` (Prefetcher.lazy_ids)
        turns into the next layers' guesses."""
        self.calls.append((layer, stack, n, y, readback, guessed))
        self._called.add(layer)

    def sync_table(self, layer, stack):
        """The layer's table as its stack's placement is now."""
        t = self.tables[self.slot[layer]]
        t[:] = -1
        if stack.position:
            t[list(stack.position)] = list(stack.position.values())
        stack.table_stale = False

    def finish(self, serve, hint):
        """Queue the forward's calls, every one in order, as the resident
        model is queued, while a thread of its own serves them as the GPU
        posts their ids: ``serve(layer, stack, ids, guesses)`` places and
        copies in a call's misses (hinting its guesses first) and returns
        {expert: row}, or None with no miss; such a call's guesses go to
        ``hint(guesses)`` after. Inside MLX's async_eval this thread may wait
        for the GPU (its back-pressure on work in flight, its allocator)
        while a kernel waits for a grant: the serving thread gives it
        (async_eval lets go of the GIL), so the GPU never waits for a graph
        to be built, only for a miss. Then the next turn."""
        calls, self.calls = self.calls, []
        self._called.clear()
        if not calls:
            return
        run = _Run()
        serving = threading.Thread(target=self._serve, args=(calls, self.turn, serve, hint, run),
                                   name="iod-device-wait", daemon=True)
        serving.start()
        try:
            for call in calls:
                if run.failed:
                    break
                _queue(call[3])
                run.queued_ns.append(time.monotonic_ns())
                run.queued += 1
        finally:
            if run.queued < len(calls):
                # the forward raises, but every call of it still goes to the GPU
                # now, on row 0 (the serving thread grants the rest as it stops):
                # none may run later, with another forward's turn
                run.stop = True
                try:
                    _queue(calls[-1][3])
                    run.queued = len(calls)
                except BaseException:
                    pass  # (MLX queues nothing: the forward's own error is the one to raise)
            run.queue_done = True
            interrupted = None
            while serving.is_alive():  # (a Ctrl-C here still waits for the GPU to be let go)
                try:
                    serving.join()
                except BaseException as e:
                    run.stop, interrupted = True, e
            self.turn += 1
            self.mail[0] = self.turn
            self._profile(calls, run)
            if interrupted is not None:
                raise interrupted
        timed_out, self.mail[1] = int(self.mail[1]), 0  # (the next forward starts clear)
        if run.error is not None:
            raise run.error
        if timed_out:
            raise RuntimeError(f"device wait: a layer waited {self.timeout_s:.0f} s for its "
                               f"experts (slot {timed_out - 1}), so this forward's output is "
                               f"wrong and is not used; --device-wait off syncs at each router "
                               f"instead")

    def abandon(self):
        """The forward being built raises before it is queued (a synced
        call's deferred copy failed): each of its calls still runs now, on
        row 0, so none is left to run later with another forward's turn."""
        calls, self.calls = self.calls, []
        self._called.clear()
        if not calls:
            return
        turn = self.turn
        try:
            self._release(calls, turn)
            _queue(calls[-1][3])
            self._await_posts(calls, turn)
        except BaseException:
            pass  # (the forward's own error is the one to raise)
        finally:
            self.turn += 1
            self.mail[0] = self.turn
            self.mail[1] = 0

    def _serve(self, calls, turn, serve, hint, run):
        """The serving thread: each call in order, once the GPU has posted it."""
        done = 0
        try:
            for j, (layer, stack, n, _, readback, guessed) in enumerate(calls):
                i = self.slot[layer]
                t0 = time.monotonic_ns()
                if run.stop or not self._posted(i, turn, self.timeout_s, lambda: run.stop):
                    raise RuntimeError("device wait: the forward stopped" if run.stop else
                                       f"device wait: the GPU never reached layer slot {i} "
                                       f"(--device-wait off syncs at each router instead)")
                t1 = time.monotonic_ns()
                ids = self.ids[i, :n].tolist()
                hit = bool((self.tables[i, ids] >= 0).all())
                guesses = readback(self.guesses[i, :guessed].astype(np.uint32)) if readback else None
                rows = serve(layer, stack, ids, guesses)
                if rows:  # (the table follows at the next forward's build: positions)
                    self.rows[i, :n] = [rows.get(e, -1) for e in ids]
                    self._grant(i, turn)
                t2 = time.monotonic_ns()
                done += 1
                if guesses and rows is None:
                    hint(guesses)
                run.served.append((t0, t1, t2, time.monotonic_ns(), hit))
        except BaseException as e:
            run.error, run.failed = e, True
            self._release(calls[done:], turn)
            while not run.queue_done:
                time.sleep(1e-4)
            self._await_posts(calls[done:run.queued], turn)

    def _release(self, calls, turn):
        """The forward raises: ``calls``' kernels go on at once, on row 0."""
        for layer, *_ in calls:
            self.rows[self.slot[layer]] = 0
            self._grant(self.slot[layer], turn)

    def _await_posts(self, calls, turn):
        """Wait until each of ``calls``' kernels (queued) has posted ``turn``.
        A kernel reads the turn as it starts, so the turn stays until then:
        one that started after it moved on would wait for a grant of the
        next turn, and the next forward would read its stale post as its
        own. Gives up at the first the GPU never reaches (the forward's own
        error is the one to raise)."""
        for layer, *_ in calls:
            if not self._posted(self.slot[layer], turn, self.timeout_s):
                break

    def _profile(self, calls, run):
        """The spans of the calls served: the wait for each post (compute);
        the host's work on the token's path (host: a miss's serving up to
        its grant; for a call that hit every expert, the time from its post
        until the next call's graph was queued, 0 where it was queued
        already); the serving after that (aside)."""
        prof = self.store.profiler
        if not prof:
            return
        for j, ((t0, t1, t2, t3, hit), call) in enumerate(zip(run.served, calls)):
            layer = call[0]
            prof.span("compute", layer, t0, t1)
            if hit:
                nxt = max(t1, run.queued_ns[j + 1] if j + 1 < len(run.queued_ns) else t1)
                prof.span("host", layer, t1, nxt, 1)
                prof.span("aside", layer, nxt, max(nxt, t3))
            else:
                prof.span("host", layer, t1, t2, 0)
                prof.span("aside", layer, t2, t3)

    def _grant(self, i, turn):
        """Let slot ``i``'s kernel go on: a store that follows every store
        before it (its rows, the records copied in) on any CPU."""
        native.store_u32(self._mail_buf, 4 * (HEAD + len(self.slot) + i), turn)

    def _posted(self, i, turn, timeout_s, stop=lambda: False) -> bool:
        """Whether slot ``i``'s kernel posts ``turn`` within ``timeout_s``
        (or before ``stop()``); what it wrote before is seen after (a load
        no later load passes). Spun on for the first SPIN_S (a layer's
        compute: a sleep costs the GPU, should it wait for this call, 50 us
        or more to wake from), without the GIL."""
        at = 4 * (HEAD + i)
        end = time.monotonic() + timeout_s
        while not native.wait_u32(self._mail_buf, at, turn, SPIN_S, min(0.05, timeout_s)):
            if stop() or time.monotonic() > end:
                return False
        return True


class _Run:
    """A forward being served: how far the host has queued it (calls, and
    when each was queued), the calls served (t0 waiting, t1 posted, t2
    granted or served, t3 done, hit) and what stopped it."""

    def __init__(self):
        self.queued, self.queued_ns, self.queue_done = 0, [], False
        self.served = []
        self.error, self.failed, self.stop = None, False, False
