"""The device wait: a decode call's routed ids mapped to stack positions on
the GPU, the host told the ids without stopping it, and the GPU waiting for
a miss, not the host for the GPU (MLX CUDA).

Per streamed layer a one-warp kernel reads the routed ids, looks each up in
the layer's table (expert -> stack position, -1 if not cached; host memory
the GPU reads, kept current by the host), and writes the ids and a posted
turn to a mailbox in pinned host memory. With every expert cached it hands
the positions to the layer's ``gather_qmm`` at once: the call is built and
run as the resident one is, no host read of device memory. With a miss it
spins on the layer's granted turn. The host, once the forward is built,
queues it a few layers at a time and walks the layers in order: it reads
each layer's ids as the GPU posts them, places the misses (``Placement``),
has the source read them and copies them into their rows on a stream of
its own (``LayerStack.copy_in``), writes the rows and grants the turn; the
GPU goes on. A table is rewritten
from its placement when the next forward is built, before any of its
kernels is queued.

Exact: the expert math is the same ``gather_qmm`` on the same stack rows
as the host-synced call. Safe by order: a row is written only while its
layer's kernel of this forward waits, after every earlier kernel that read
it ran (one stream), and before any later forward's kernels are queued.

Where this does not run (the CPU, Metal, a stack not written in place, a
cache narrower than a call) each call syncs at its router as before; the
run's summary says which path ran. On Metal, ``mx.fast.metal_kernel`` with
the unified memory the arena already is would give the same path; not
built, not measured."""

import mmap
import os
import sys
import time

import mlx.core as mx
import numpy as np

import native

MAX_K = 32  # ids a call may post (top k x one token); wider calls sync
TIMEOUT_NS = 20_000_000_000  # a kernel left waiting this long gives up
SPINS = 10_000  # polls of a post (1-3 ms) before the host sleeps between them
HEAD = 16  # words: 0 the turn, 1 the error (layer slot + 1 of a timed-out wait)
# One MLX command buffer a layer's graph, not one per 20 kernels: MLX blocks
# the host in async_eval while ~10 are in flight, and a queued call may be
# waiting for the host. MLX reads this at its first CUDA evaluation: set
# here where none has run yet (nothing allocated), as a CLI process imports
# this before it loads a model.
_FRESH = mx.cuda.is_available() and mx.get_peak_memory() == 0
if _FRESH:
    os.environ.setdefault("MLX_MAX_OPS_PER_BUFFER", "200")
# calls queued on the GPU past the one the host served last, computed while
# it serves the next: two where a layer's graph is one command buffer, else one
AHEAD = 2 if _FRESH and int(os.environ.get("MLX_MAX_OPS_PER_BUFFER", "0") or 0) >= 100 else 1

_SOURCE = """
    uint64_t* box = (uint64_t*)box_in;
    volatile int* mail = (volatile int*)box[0];
    volatile const int* table = (volatile const int*)box[1];
    const int slot = (int)box[2];
    const int layers = (int)box[3];
    volatile int* posted = mail + 16;
    volatile int* granted = posted + layers;
    volatile int* ids_out = granted + layers + slot * MAX_K;
    volatile int* rows_in = ids_out + layers * MAX_K;
    volatile int* guess_out = granted + layers + 2 * layers * MAX_K + slot * MAX_G;
    __shared__ int row[N];
    __shared__ int any_miss;
    const int t = threadIdx.x;
    const int turn = mail[0];
    if (t == 0) any_miss = 0;
    __syncthreads();
    if (t < N) {
        int e = (int)ids[t];
        ids_out[t] = e;
        row[t] = table[e];
        if (row[t] < 0) atomicOr(&any_miss, 1);
    }
    for (int i = t; i < G; i += 32) guess_out[i] = (int)guess[i];
    __threadfence_system();
    __syncthreads();
    if (t == 0) {
        posted[slot] = turn;
        __threadfence_system();
        if (any_miss) {
            unsigned long long t0, now;
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
            while (granted[slot] != turn) {
                __nanosleep(256);
                asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
                if (now - t0 > TIMEOUT) { mail[1] = slot + 1; break; }
            }
            __threadfence_system();
        }
    }
    __syncthreads();
    if (t < N) {
        int r = row[t] >= 0 ? row[t] : rows_in[t];
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
                f"it needs MLX CUDA, --device-wait auto, and a kernel that passes its check at load)")
    if calls["whole"]:
        line += f", {calls['whole']} ran as whole layers (no sync)"
    return line


def _queue(y):
    """Start the GPU on the graph up to ``y`` (a test runs a fake GPU here)."""
    mx.async_eval(y)


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


class DeviceWait:
    """The mailbox, the layers' tables and the calls of the forward being
    built; one per ExpertStore (``ExpertStore.device``)."""

    def __init__(self, store, layers):
        self.store = store
        self.slot = {layer: i for i, layer in enumerate(sorted(layers))}
        n = len(self.slot)
        self.experts = max(store.layouts[l].num_experts for l in self.slot)
        # guessed ids a call may post: every expert of each layer guessed
        # ahead (a calibration's ranks go that far at most); more posts none
        self.max_guessed = max(store.prefetcher.depth, 1) * self.experts
        words = HEAD + 2 * n + 2 * n * MAX_K + n * self.max_guessed
        mail, table = _pinned(4 * words), _pinned(4 * n * self.experts)
        if mail is None or table is None:
            raise OSError("CUDA did not pin the mailbox")
        (self._mail_buf, mail_dev), (self._table_buf, table_dev) = mail, table
        self.mail = np.frombuffer(self._mail_buf, dtype=np.int32, count=words)
        self.mail[:] = 0
        self.posted = self.mail[HEAD:HEAD + n]
        self.granted = self.mail[HEAD + n:HEAD + 2 * n]
        self.ids = self.mail[HEAD + 2 * n:HEAD + 2 * n + n * MAX_K].reshape(n, MAX_K)
        self.rows = self.mail[HEAD + 2 * n + n * MAX_K:HEAD + 2 * n + 2 * n * MAX_K].reshape(n, MAX_K)
        self.guesses = self.mail[HEAD + 2 * n + 2 * n * MAX_K:].reshape(n, self.max_guessed)
        self.tables = np.frombuffer(self._table_buf, dtype=np.int32,
                                    count=n * self.experts).reshape(n, self.experts)
        self.tables[:] = -1
        self._args = {layer: mx.array(np.array(
            [mail_dev, table_dev + 4 * i * self.experts, i, n], dtype=np.uint64))
            for layer, i in self.slot.items()}
        self._kernel = mx.fast.cuda_kernel(
            name="iod_device_wait", input_names=["ids", "guess", "box_in"], output_names=["pos"],
            source=_SOURCE,
            header=f"#define TIMEOUT {TIMEOUT_NS}ULL\n#define MAX_K {MAX_K}\n"
                   f"#define MAX_G {self.max_guessed}\n")
        self._no_guess = mx.zeros((1,), dtype=mx.uint32)
        self.turn = 1
        self.mail[0] = self.turn
        # (layer, stack, ids posted, output, guesses' readback or None, guessed
        # ids posted) of the forward being built
        self.calls = []
        self.timeout_s = TIMEOUT_NS / 1e9

    @classmethod
    def make(cls, store):
        """A DeviceWait for ``store``'s cached layers where this backend has
        one (MLX CUDA, records copied in place), else None."""
        if not mx.cuda.is_available() or mx.default_device() == mx.cpu or not native.cuda_available():
            return None
        try:
            dw = cls(store, store.cached)
            if dw.works():
                return dw
            dw.close()
            print("infer: the device wait's kernel failed its check on this GPU; streamed "
                  "calls sync at their routers", file=sys.stderr)
        except (OSError, RuntimeError, ValueError):
            pass
        return None

    def works(self) -> bool:
        """Run the kernel twice on the first slot before any forward, a hit
        and a miss already granted, and check what it wrote and posted: a
        kernel this GPU or driver does not build or run right leaves the
        session on the synced path instead of failing its first token. The
        slot is left as it was (its table -1, nothing posted or granted)."""
        layer = next(iter(self.slot))
        i, turn = self.slot[layer], self.turn
        ids = mx.array([1, 2], dtype=mx.uint32)
        guess = mx.array([7, 8, 9], dtype=mx.uint32)
        try:
            self.tables[i, [1, 2]] = 5
            hit = np.array(self._launch(layer, ids, guess)).tolist()  # (evaluated: the kernel ran)
            posted = int(self.posted[i]) == turn and self.ids[i, :2].tolist() == [1, 2] \
                and self.guesses[i, :3].tolist() == [7, 8, 9]
            self.tables[i, [1, 2]] = -1
            self.rows[i, :2] = [3, 4]
            self.granted[i] = turn
            miss = np.array(self._launch(layer, ids, None)).tolist()
            return hit == [5, 5] and posted and miss == [3, 4] and not self.mail[1]
        finally:
            self.tables[i] = -1
            self.posted[i] = self.granted[i] = 0  # (no forward's turn is 0)
            self.ids[i] = self.rows[i] = self.guesses[i] = 0
            self.mail[1] = 0

    def close(self):
        """Give the pinned mailbox and tables back (no kernel may run after)."""
        for buf in (self._mail_buf, self._table_buf):
            native.cuda_unregister(buf)
        self.mail = self.posted = self.granted = self.ids = self.rows = self.guesses = None
        self.tables = None  # (the mappings go with the last view of them)

    def fits(self, stack, n):
        """Whether a call of ``n`` ids on ``stack`` can wait on the device:
        a stack written in place by CUDA copies, holding at least the call."""
        return (stack.mode == "cuda" and stack.in_place and 0 < n <= MAX_K
                and n <= stack.capacity and stack.layout.layer in self.slot)

    def waiting(self, layer) -> bool:
        """Whether the forward being built has a call of ``layer`` already:
        its mailbox slot is taken until ``finish`` (a second call syncs)."""
        return any(c[0] == layer for c in self.calls)

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
            inputs=[ids, self._no_guess if guess is None else guess, self._args[layer]],
            template=[("N", ids.size), ("G", g)], grid=(32, 1, 1), threadgroup=(32, 1, 1),
            output_shapes=[(ids.size,)], output_dtypes=[mx.uint32])[0]

    def called(self, layer, stack, n, y, readback=None, guessed=0):
        """Note a call built on the device path, ``y`` its output; it posts
        ``guessed`` ids of guesses, which ``readback`` (Prefetcher.lazy_ids)
        turns into the next layers' guesses."""
        self.calls.append((layer, stack, n, y, readback, guessed))

    def sync_table(self, layer, stack):
        """The layer's table as its stack's placement is now."""
        t = self.tables[self.slot[layer]]
        t[:] = -1
        if stack.position:
            t[list(stack.position)] = list(stack.position.values())
        stack.table_stale = False

    def finish(self, serve, hint):
        """Queue the forward's calls and serve them in order as the GPU
        posts their ids: ``serve(layer, stack, ids, guesses)`` places and
        copies in a call's misses (hinting its guesses first) and returns
        {expert: row}, or None with no miss; such a call's guesses go to
        ``hint(guesses)`` once the calls ahead are queued, so the GPU does
        not wait for their plan. Then the next turn."""
        calls, self.calls = self.calls, []
        if not calls:
            return
        turn = self.turn
        prof = self.store.profiler
        done = 0
        _queue(calls[0][3])
        queued = 1
        try:
            for j, (layer, stack, n, _, readback, guessed) in enumerate(calls):
                i = self.slot[layer]
                t0 = time.monotonic_ns()
                self._wait_posted(i, turn)
                t1 = time.monotonic_ns()
                ids = self.ids[i, :n].tolist()
                guesses = readback(self.guesses[i, :guessed].astype(np.uint32)) if readback else None
                rows = serve(layer, stack, ids, guesses)
                if rows:  # (the table follows at the next forward's build: positions)
                    self.rows[i, :n] = [rows.get(e, -1) for e in ids]
                    self.granted[i] = turn  # (x86 stores are seen in order)
                done += 1
                # the graph up to AHEAD calls past this one to the GPU (queued
                # only once every call before them is served: an async_eval
                # that MLX makes wait waits for calls that go on by themselves)
                ahead = min(j + AHEAD, len(calls) - 1)
                if ahead >= queued:
                    _queue(calls[ahead][3])
                    queued = ahead + 1
                if guesses and rows is None:
                    hint(guesses)
                if prof:  # the wait for the GPU to post, then the host's work on the ids
                    prof.span("compute", layer, t0, t1)
                    prof.span("host", layer, t1, time.monotonic_ns())
        except BaseException:
            # the forward raises: its waiting layers go on at once (on row 0).
            # A kernel reads the turn as it starts, so this one stays until
            # each has posted: one that started after it moved on would wait
            # for a grant of the next turn, and the next forward would read
            # its stale post as its own
            for layer, *_ in calls[done:]:
                self.rows[self.slot[layer]] = 0
                self.granted[self.slot[layer]] = turn
            _queue(calls[-1][3])  # (what was not queued runs now, on those rows)
            try:
                for layer, *_ in calls[done:]:
                    self._wait_posted(self.slot[layer], turn)
            except RuntimeError:
                pass  # (the GPU never got there: the forward's own error is the one to raise)
            raise
        finally:
            self.turn += 1
            self.mail[0] = self.turn
        timed_out, self.mail[1] = int(self.mail[1]), 0  # (the next forward starts clear)
        if timed_out:
            raise RuntimeError(f"device wait: a layer waited {self.timeout_s:.0f} s for its "
                               f"experts (slot {timed_out - 1}), so this forward's output is "
                               f"wrong and is not used; --device-wait off syncs at each router "
                               f"instead")

    def _wait_posted(self, i, turn):
        # spun on for the first few ms (a layer's compute): a sleep costs the
        # GPU, should it wait for this call, 50 us or more to wake from
        t0 = time.monotonic()
        spins = 0
        while self.posted[i] != turn:
            spins += 1
            if spins > SPINS:
                time.sleep(20e-6)
                if time.monotonic() - t0 > self.timeout_s:
                    raise RuntimeError(f"device wait: the GPU never reached layer slot {i} "
                                       f"(--device-wait off syncs at each router instead)")
