"""The device wait (infer.runtime.device): decode calls find their experts on
the GPU and wait there for misses, and give exactly mlx-lm's greedy ids.
MLX CUDA only; elsewhere the load leaves it off and every call syncs (the
rest of the suite)."""

import time

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from infer.runtime import device, streaming
from infer.runtime.loader import load_streaming
from infer.tools.profile import Profiler, summarize
from iod.inproc import InprocSource
from tests.test_streaming import PROMPT, greedy, mlx_reference

CUDA = mx.cuda.is_available()
ARCHS = [
    ("qwen3_moe", "affine4", "float32"),
    ("qwen3_next", "affine4", "float32"),
    ("mixtral", "affine4", "float32"),
    ("gpt_oss", "mxfp4", "float32"),
    # in float32 stock mlx-lm does not run it on MLX CUDA ("[quantized_matmul]
    # No implementation for problem shape: 20x32x64x4 ... activation: float32",
    # an H100, 2026-12-07); a real checkpoint is bfloat16
    ("deepseek_v3", "affine4", "bfloat16"),
]


def test_the_device_wait_is_off_where_the_backend_has_none(prep_model):
    if CUDA:
        pytest.skip("this machine has MLX CUDA")
    prep = prep_model("qwen3_moe")
    source = InprocSource(prep, arena=64 << 20)
    try:
        _, _, store = load_streaming(prep, source, 1 << 20)
        assert store.device is None
    finally:
        source.close()


@pytest.mark.skipif(not CUDA, reason="MLX CUDA only")
@pytest.mark.parametrize("arch,quant,dtype", ARCHS)
def test_device_wait_gives_mlx_lm_greedy_ids(arch, quant, dtype, synth_model, prep_model):
    prep = prep_model(arch, quant=quant, dtype=dtype)
    ids, expected = mlx_reference(synth_model(arch, quant=quant, dtype=dtype))
    for fraction in (0.15, 0.5):
        for device_wait in ("on", "off"):
            source = InprocSource(prep, arena=64 << 20)
            try:
                model, _, store = load_streaming(prep, source,
                                                 int(source.manifest.expert_bytes * fraction),
                                                 device_wait=device_wait)
                on = device_wait == "on"
                assert (store.device is not None) == on
                assert greedy(model, ids) == expected, f"{arch} {fraction} device wait {device_wait}"
                assert (store.stats["device_calls"] > 0) == on
                assert store.stats["misses"] > 0
            finally:
                source.close()


@pytest.mark.skipif(not CUDA, reason="MLX CUDA only")
def test_a_failed_miss_releases_the_gpu_and_the_session_goes_on(synth_model, prep_model):
    """A source that fails while the GPU waits: the forward raises at once
    (no kernel left waiting out its timeout), and the next forwards, their
    misses served, give the right ids again."""
    prep = prep_model("qwen3_moe")
    ids, expected = mlx_reference(synth_model("qwen3_moe"))
    source = InprocSource(prep, arena=64 << 20)
    try:
        model, _, store = load_streaming(prep, source, int(source.manifest.expert_bytes * 0.15))
        serve, failures = store.serve_device, [0]

        def failing(layer, stack, posted, guesses=None):
            if failures[0] == 0 and any(e not in stack for e in posted):
                failures[0] += 1
                raise OSError("the disk went away")
            return serve(layer, stack, posted, guesses)

        store.serve_device = failing
        t0 = time.monotonic()
        with pytest.raises(OSError, match="went away"):
            greedy(model, ids)
        mx.synchronize()
        assert time.monotonic() - t0 < store.device.timeout_s / 2
        assert not store.device.mail[1]  # no kernel timed out
        store.reset()  # a cold cache: the failed call's stack is rebuilt
        assert greedy(model, ids) == expected
    finally:
        source.close()


def _host_pinned(n):
    """``device._pinned`` on the CPU: host pages, "device" address their own."""
    import mmap

    import native

    buf = mmap.mmap(-1, max(n, mmap.PAGESIZE))
    return buf, native.address(buf)


def copy_chunk(dw, sources=None):
    """What a waiting CUDA kernel does with a copy chunk the host planned in
    its mailbox, if there is one it has not copied: each row's bytes, by
    address, then every block's done flag. ``sources`` gets each row's
    source address."""
    import ctypes

    chunk = int(dw.mail[2])
    if dw.backend == "cuda" and chunk != dw.done[0]:
        for dst, src, n in dw.plan[: int(dw.mail[3])].tolist():
            ctypes.memmove(dst, src, n)
            if sources is not None:
                sources.append(src)
        dw.done[:] = chunk


class FakeGPU:
    """The device wait's kernels run by a thread on the CPU, as the GPU runs
    them: in queue order, each posts its ids, looks them up in its layer's
    table and, with a miss, waits for the host's grant, then reads the rows.
    It records (layer, ids, rows) per call; the model's own output is not
    used (its positions are zeros), so this checks the host's protocol."""

    def __init__(self, monkeypatch):
        import threading

        from infer.runtime import device

        self.device = device
        self.log, self.pending, self.kernels = [], [], {}
        self.lock = threading.Condition()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.stop, self.running = False, False
        self.timeouts = 0  # kernels that gave up waiting for their grant
        # inside async_eval MLX may make the host wait for the GPU (its
        # back-pressure on work in flight, its allocator): with ``pressure``
        # a queue returns only once every kernel queued before has run, so a
        # kernel waiting for its grant holds the queueing thread (blocked:
        # queues that waited for one)
        self.waiting, self.pressure, self.blocked = None, False, 0
        self.queued = 0  # calls queued in all
        self.sources = []  # where each row a kernel copied came from
        monkeypatch.setattr(device, "_pinned", _host_pinned)
        for name in ("cuda_kernel", "metal_kernel"):
            monkeypatch.setattr(mx.fast, name, lambda **kw: self._kernel, raising=False)
        monkeypatch.setattr(device, "_queue", self._queue)
        monkeypatch.setattr(device.DeviceWait, "fits",
                            lambda dw, stack, n: stack.in_place and 0 < n <= stack.capacity)
        self.thread.start()

    def _kernel(self, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        ids, guess = inputs[:2]
        g = dict(template)["G"]
        dw = self.store.device
        slot = next(dw.slot[l] for l, mine in dw._inputs.items() if mine[-1] is inputs[-1])
        # the call being built's ids, layer slot and guessed ids
        self.last = (ids, slot, guess if g else None)
        return [mx.zeros(output_shapes[0], dtype=output_dtypes[0])]

    def _queue(self, y):
        """The calls built up to ``y`` that are not queued yet, in order."""
        dw = self.store.device
        calls = [c for c in dw.calls_seen if c[3] is not None]  # (None: queued already)
        upto = next(i for i, c in enumerate(calls) if c[3] is y)
        todo = []
        for call in calls[: upto + 1]:
            ids, slot, guess = call[4]
            guess = [] if guess is None else np.array(guess).astype(np.int64).tolist()
            todo.append((slot, np.array(ids).astype(np.int64).ravel().tolist(), guess))
            call[3] = None  # queued
        with self.lock:
            self.pending += todo
            self.queued += len(todo)
            self.lock.notify()
        waited = False
        while self.pressure and not self.stop and (self.pending or self.running):
            waited = waited or self.waiting is not None
            time.sleep(1e-4)
        self.blocked += waited

    def _run(self):
        import time

        while not self.stop:
            with self.lock:
                while not self.pending and not self.stop:
                    self.lock.wait(0.1)
                if self.stop:
                    return
                slot, ids, guess = self.pending[0]
                self.running = True
                self.pending.pop(0)
            dw = self.store.device
            turn = int(dw.mail[0])  # (read as the kernel starts, as the CUDA one does)
            dw.ids[slot, : len(ids)] = ids
            dw.guesses[slot, : len(guess)] = guess
            rows = [int(dw.tables[slot, e]) for e in ids]
            dw.posted[slot] = turn
            waited = min(rows) < 0
            if waited:
                t0 = time.monotonic()
                self.waiting = (slot, turn)
                while dw.granted[slot] != turn:
                    copy_chunk(dw, self.sources)
                    time.sleep(1e-4)
                    if time.monotonic() - t0 > 10:
                        dw.mail[1] = slot + 1
                        self.timeouts += 1
                        break
                self.waiting = None
                rows = [r if r >= 0 else int(dw.rows[slot, j]) for j, r in enumerate(rows)]
            with self.lock:
                self.log.append((slot, ids, rows, waited))
                self.running = False

    def watch(self, store):
        """Keep each call's kernel inputs as the store notes the call."""
        self.store = store
        dw = store.device
        dw.calls_seen = []
        noted = dw.called

        def called(layer, stack, n, y, *guesses):
            noted(layer, stack, n, y, *guesses)
            dw.calls_seen.append([layer, stack, n, y, self.last])

        dw.called = called

    def close(self):
        """Let the queued calls run, then stop."""
        import time

        t0 = time.monotonic()
        while self.pending and time.monotonic() - t0 < 20:
            time.sleep(0.01)
        self.stop = True
        self.thread.join()


def _fake_session(prep, gpu, fraction=0.15, backend="cuda", arena_pinned=False):
    """A session whose device wait runs on ``gpu``, its mailbox and tables
    in ``backend``'s memory: pinned host pages (CUDA) or MLX arrays (Metal);
    ``arena_pinned``: the kernels copy straight from the arena, as where
    CUDA pinned it (else through the staging buffer)."""
    import native
    from infer.runtime.device import DeviceWait

    source = InprocSource(prep, arena=64 << 20)
    if arena_pinned:
        source.cuda_address = native.address(source._arena)
    model, tokenizer, store = load_streaming(prep, source, int(source.manifest.expert_bytes * fraction),
                                             device_wait="off")
    gpu.store = store
    store.device = DeviceWait(store, store.cached, backend)
    gpu.watch(store)
    return source, model, tokenizer, store


def _checked(store, source):
    """``store.serve_device``, checking after each call that the stack rows
    of its experts hold their records, byte for byte."""
    serve = store.serve_device

    def checking(layer, stack, ids, guesses=None):
        places = serve(layer, stack, ids, guesses)
        records = source.read(layer, sorted(set(ids)))
        for s in stack.layout.segments:
            arr = np.array(stack.arrays[(s.projection, s.tensor)].view(mx.uint8))
            for e in set(ids):
                got = arr[stack.position[e]].tobytes()
                assert got == records[e][s.offset : s.offset + s.nbytes], (layer, e, s.tensor)
        return places

    return checking


@pytest.mark.parametrize("pinned", [True, False])
def test_a_miss_copied_in_many_chunks_lands_whole(prep_model, monkeypatch, pinned):
    """CUDA's copy in pieces: a plan of at most 4 rows a chunk (a record has
    9) and a staging buffer smaller than a tensor (which then goes in two
    pieces): every row still holds its expert's record once its call is
    served, and every block copied every chunk."""
    prep = prep_model("qwen3_moe")
    monkeypatch.setattr(device, "MAX_ROWS", 4)
    monkeypatch.setattr(device, "STAGE_BYTES", 3000)
    gpu = FakeGPU(monkeypatch)
    source, model, tokenizer, store = _fake_session(prep, gpu, arena_pinned=pinned)
    assert max(s.nbytes for l in store.cached for s in store.layouts[l].segments) > 3000
    store.serve_device = _checked(store, source)
    dw = store.device
    _generate(gpu, source, model, tokenizer, 12)
    assert store.stats["device_calls"] > 0 and gpu.timeouts == 0
    assert dw.chunk >= 3 * sum(waited for *_, waited in gpu.log) > 0
    assert (dw.done == dw.chunk).all()


def test_a_source_the_store_takes_is_pinned_for_the_kernels(prep_model, monkeypatch):
    """On CUDA a source given to the store (a benchmark's next run) has its
    arena pinned then, by the building thread, so the kernels copy straight
    from it; the serving thread never registers memory."""
    import native

    prep = prep_model("qwen3_moe")
    gpu = FakeGPU(monkeypatch)
    source, model, tokenizer, store = _fake_session(prep, gpu)
    registered = []
    monkeypatch.setattr(native, "cuda_register", lambda buf, ro: registered.append(buf) or True)
    monkeypatch.setattr(native, "cuda_unregister", lambda buf: None)
    monkeypatch.setattr(native, "cuda_device_pointer", native.address)
    fresh = InprocSource(prep, arena=64 << 20)
    store.use(fresh)
    base, size = native.address(fresh._arena), len(fresh._arena)
    assert registered == [fresh._arena] and fresh.cuda_address == base
    source.close()
    _generate(gpu, fresh, model, tokenizer, 8)
    assert len(registered) == 1 and store.stats["device_calls"] > 0
    assert gpu.sources and all(base <= a < base + size for a in gpu.sources)


def _generate(gpu, source, model, tokenizer, n):
    """``n`` greedy tokens of PROMPT on the fake GPU; then it stops and the source closes."""
    try:
        list(generate_step(mx.array(tokenizer.encode(PROMPT)), model, max_tokens=n))
    finally:
        gpu.close()
        source.close()


@pytest.mark.parametrize("backend,pressure,pinned", [("cuda", True, True), ("cuda", False, False),
                                                     ("metal", False, False)])
def test_the_host_serves_the_kernels_the_rows_that_hold_their_experts(prep_model, monkeypatch, backend,
                                                                       pressure, pinned):
    """On the CPU, with the kernels run by a thread as the GPU runs them:
    every call's rows, as the kernel reads them from its table and the
    host's grant, are the rows the host placed its experts in, and each of
    those rows holds that expert's record by then; every miss is granted,
    no kernel waits out its timeout, and the cache evicts as it goes. The
    same with the mailbox in MLX arrays, as on Metal. The host queues the
    forward's calls while they are served: calls are queued past a miss
    being served, and (``pressure``) a queue that waits for the GPU while a
    kernel waits for its grant does not hang the forward (MLX's async_eval
    may wait so; the kernels here give up after 10 s). On CUDA the kernels
    copy the records, from the arena where it is ``pinned``, else from the
    staging buffer; the serving thread makes no copy of its own."""
    import native

    prep = prep_model("qwen3_moe")
    gpu = FakeGPU(monkeypatch)
    gpu.pressure = pressure
    source, model, tokenizer, store = _fake_session(prep, gpu, backend=backend, arena_pinned=pinned)
    host_rows, ahead = [], []  # ahead: (layer, no miss, calls queued past this one as it is served)
    serve = _checked(store, source)

    def checking(layer, stack, ids, guesses=None):
        queued = gpu.queued - len(host_rows) - 1
        places = serve(layer, stack, ids, guesses)
        ahead.append((layer, places is None, queued))
        host_rows.append([stack.position[e] for e in ids])
        return places

    store.serve_device = checking
    store.profiler = Profiler()
    dw = store.device
    if backend == "cuda":
        import threading

        copied_by_host, copy_in = [], streaming.LayerStack.copy_in

        def host_copy(stack, batch, positions):  # (the synced calls' copies are the host's)
            copied_by_host.append(threading.current_thread().name)
            copy_in(stack, batch, positions)

        monkeypatch.setattr(streaming.LayerStack, "copy_in", host_copy)
        base, size = (native.address(source._arena), len(source._arena)) if pinned else \
            (dw._stage_dev, len(dw._stage))
    _generate(gpu, source, model, tokenizer, 24)
    if backend == "cuda":
        assert "iod-device-wait" not in copied_by_host and gpu.sources
        assert all(base <= a < base + size for a in gpu.sources)
    else:
        assert gpu.sources == []
    assert gpu.timeouts == 0 and (gpu.blocked > 0) == pressure
    # the profile: each device call's host work on the token's path, then aside
    spans = store.profiler.spans
    hits = sum(hit for _, hit, _ in ahead)
    assert sum(kind == "aside" for kind, *_ in spans) == len(ahead)
    assert sum(kind == "host" and n == 1 for kind, *_, n in spans) == hits
    assert summarize([], spans, [], [], {})["all_hit_host_us"]["n"] == hits
    # calls were queued past a miss being served (with pressure the queue
    # waits for the GPU to run what came before)
    assert pressure or any(q > 0 and not hit for _, hit, q in ahead)
    assert len(gpu.log) == store.stats["device_calls"] == len(host_rows) > 0
    assert [rows for _, _, rows, _ in gpu.log] == host_rows
    assert all(len(set(rows)) == len(set(ids)) for _, ids, rows, _ in gpu.log)
    assert any(waited for *_, waited in gpu.log) and not all(waited for *_, waited in gpu.log)
    assert store.stats["synced_calls"] > 0  # the prefill's calls sync
    assert any(len(s.position) == s.capacity for s in store.stacks.values())  # full: evicting


def test_a_failed_read_releases_every_waiting_kernel(prep_model, monkeypatch):
    """The source fails on a call's misses: the forward raises, and every
    kernel of it, that one's and those queued behind it, runs on at once
    (granted), none waits out its timeout."""
    prep = prep_model("qwen3_moe")
    gpu = FakeGPU(monkeypatch)
    source, model, tokenizer, store = _fake_session(prep, gpu)
    serve, served = store.serve_device, [0]

    def failing(layer, stack, ids, guesses=None):
        if any(e not in stack for e in ids):
            served[0] += 1
            if served[0] == 3:
                raise OSError("the disk went away")
        return serve(layer, stack, ids, guesses)

    store.serve_device = failing
    with pytest.raises(OSError, match="went away"):
        _generate(gpu, source, model, tokenizer, 24)
    assert not store.device.mail[1]
    queued = sum(1 for c in store.device.calls_seen if c[3] is None)
    assert len(gpu.log) == queued > 0


def _raises_then_runs_clear(gpu, source, model, tokenizer, store, error):
    """A generation on the fake GPU raises ``error``: every call built went
    to the GPU (none is left lazy), none waited out its timeout, and the
    next generation runs clear; then the GPU stops and the source closes."""
    prompt = mx.array(tokenizer.encode(PROMPT))
    try:
        with pytest.raises(error):
            list(generate_step(prompt, model, max_tokens=24))
        assert store.device.calls_seen and all(c[3] is None for c in store.device.calls_seen)
        assert len(list(generate_step(prompt, model, max_tokens=8))) == 8
    finally:
        gpu.close()
        source.close()
    assert gpu.timeouts == 0 and not store.device.mail[1]


def test_an_interrupt_while_a_forward_is_queued_leaves_no_kernel_waiting(prep_model, monkeypatch):
    """A Ctrl-C inside the queueing of a forward (MLX's async_eval) after
    some of its calls went to the GPU: the rest go to the GPU too (none is
    left to run later, with another forward's turn), none waits out its
    timeout, the interrupt is what the caller sees, and the next
    generation runs clear."""
    prep = prep_model("qwen3_moe")
    gpu = FakeGPU(monkeypatch)
    source, model, tokenizer, store = _fake_session(prep, gpu)
    queue, queues = gpu._queue, [0]

    def interrupted(y):
        queues[0] += 1
        if queues[0] == 40:  # a decode forward's third call
            raise KeyboardInterrupt
        queue(y)

    monkeypatch.setattr(device, "_queue", interrupted)
    _raises_then_runs_clear(gpu, source, model, tokenizer, store, KeyboardInterrupt)


def test_a_kernel_that_timed_out_fails_its_forward_only(prep_model, monkeypatch):
    """A kernel that gave up waiting (its slot in the error word): that
    forward raises, naming the slot, and the next generation runs clear."""
    prep = prep_model("qwen3_moe")
    gpu = FakeGPU(monkeypatch)
    source, model, tokenizer, store = _fake_session(prep, gpu)
    prompt = mx.array(tokenizer.encode(PROMPT))
    try:
        with pytest.raises(RuntimeError, match=r"waited 20 s for its experts \(slot 2\)"):
            for i, _ in enumerate(generate_step(prompt, model, max_tokens=24)):
                if i == 4:
                    store.device.mail[1] = 3  # as the kernel of slot 2 does when it gives up
        assert len(list(generate_step(prompt, model, max_tokens=8))) == 8
    finally:
        gpu.close()
        source.close()
    assert gpu.timeouts == 0


def test_the_next_layers_guesses_come_back_with_the_ids_and_are_hinted(prep_model, monkeypatch):
    """Each device-path call posts the next layers' guesses beside its ids:
    the host reads back exactly the guesses the predictor made from that
    call's input (layer, depth, ids), scores them at those layers' calls
    and hints the source to read them ahead."""
    prep = prep_model("qwen3_moe")
    gpu = FakeGPU(monkeypatch)
    source, model, tokenizer, store = _fake_session(prep, gpu)
    ahead = store.prefetcher
    made, hinted = [], []
    predict, prefetch = ahead.predict, ahead.prefetch

    def predicting(layer, x):
        guesses = predict(layer, x)
        if x.size != x.shape[-1] or not guesses:
            return guesses  # a prefill's (its calls sync), or none to post
        made.append([(g[0], g[1], np.array(g[2][0])[:, g[2][1], : g[2][2]] if isinstance(g[2], tuple)
                      else np.array(g[2])) for g in guesses])
        return guesses

    def prefetching(guesses, misses=None):
        if any(not isinstance(g[2], np.ndarray) or g[2].shape[0] != 1 for g in guesses):
            return prefetch(guesses, misses)  # a prefill's
        hinted.append([(g[0], g[1], np.array(g[2])) for g in guesses])
        return prefetch(guesses, misses)

    monkeypatch.setattr(ahead, "predict", predicting)
    monkeypatch.setattr(ahead, "prefetch", prefetching)
    _generate(gpu, source, model, tokenizer, 16)
    assert store.stats["device_calls"] > 0 and len(hinted) > 0
    assert len(made) == len(hinted)
    for ours, theirs in zip(made, hinted):
        assert [(l, d) for l, d, _ in ours] == [(l, d) for l, d, _ in theirs]
        assert all(np.array_equal(a.astype(np.int64), b.astype(np.int64)) for (_, _, a), (_, _, b) in zip(ours, theirs))
    assert any(g for g in hinted)
    assert store.stats["prefetched"] > 0
    assert sum(ahead.prediction[1][:2]) > 0  # depth-1 guesses scored at the next layers' calls


@pytest.mark.parametrize("backend", ["cuda", "metal"])
def test_a_kernel_that_does_not_work_here_leaves_the_session_synced(prep_model, monkeypatch, backend):
    """``DeviceWait.works`` runs the kernel on a hit and on a miss granted
    while it waits, before any forward: a kernel that posts and waits as
    the CUDA and Metal ones do (and on CUDA copies what the host plans)
    passes, and leaves the slot clear; one whose guesses the host never
    sees, one that reads its rows without waiting for the grant, or (CUDA)
    one that does not copy, fails, so the load keeps every call synced."""
    import threading

    from infer.runtime.device import DeviceWait

    prep = prep_model("qwen3_moe")
    source = InprocSource(prep, arena=64 << 20)
    try:
        _, _, store = load_streaming(prep, source, int(source.manifest.expert_bytes * 0.15),
                                     device_wait="off")
        monkeypatch.setattr(device, "_pinned", _host_pinned)
        monkeypatch.setattr(device, "CHECK_S", 1)  # (the copy a broken kernel never makes)
        for broken in (None, "no guesses", "no wait") + (("no copy",) if backend == "cuda" else ()):
            made, runs = [], {}

            def kernel(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
                # the kernel's effect on the host's view of the mailbox, run
                # by a thread once queued (or at once where only evaluated)
                out = mx.zeros(output_shapes[0], dtype=output_dtypes[0])
                dw = made[0]
                ids, guess = (np.array(a).astype(np.int64) for a in inputs[:2])
                slot = next(dw.slot[l] for l, mine in dw._inputs.items() if mine[-1] is inputs[-1])
                g, result = dict(template)["G"], []

                def run():
                    turn = int(dw.mail[0])
                    dw.ids[slot, : ids.size] = ids
                    if broken != "no guesses":
                        dw.guesses[slot, :g] = guess[:g]
                    rows = [int(dw.tables[slot, e]) for e in ids]
                    dw.posted[slot] = turn
                    if min(rows) < 0:
                        t0 = time.monotonic()
                        while broken != "no wait" and dw.granted[slot] != turn:
                            if broken != "no copy":
                                copy_chunk(dw)
                            time.sleep(1e-4)
                            assert time.monotonic() - t0 < 10
                        rows = [r if r >= 0 else int(dw.rows[slot, j]) for j, r in enumerate(rows)]
                    result.extend(rows)

                runs[id(out)] = (threading.Thread(target=run), result)
                return [out]

            def queue(y):
                runs[id(y)][0].start()

            def evaluated(y):
                thread, result = runs[id(y)]
                if not thread.is_alive() and not result:
                    thread.start()
                thread.join()
                return result

            for name in ("cuda_kernel", "metal_kernel"):
                monkeypatch.setattr(mx.fast, name, lambda **kw: kernel, raising=False)
            monkeypatch.setattr(device, "_queue", queue)
            monkeypatch.setattr(device, "_evaluated", evaluated)
            dw = DeviceWait(store, store.cached, backend)
            made.append(dw)
            assert dw.works() is (broken is None), broken
            assert (dw.tables == -1).all() and not dw.posted.any() and not dw.granted.any()
            assert not dw.mail[1] and dw.mail[0] == dw.turn
            dw.close()
    finally:
        source.close()


def test_auto_leaves_mlx_cuda_synced_and_on_tries_it(prep_model, monkeypatch, capsys):
    """``--device-wait auto`` builds no kernel on MLX CUDA (there the serving
    thread hung on an H100) and says nothing; ``on`` tries it (here its
    kernel does not build, so the session syncs and one line says why);
    on Metal auto tries it; off never does; the CPU has none."""

    from infer.runtime.device import DeviceWait, wanted

    assert [wanted(m, "cuda") for m in ("auto", "on", "off")] == [False, True, False]
    assert [wanted(m, "metal") for m in ("auto", "on", "off")] == [True, True, False]
    assert not any(wanted(m, None) for m in ("auto", "on", "off"))
    prep = prep_model("qwen3_moe")
    source = InprocSource(prep, arena=64 << 20)
    try:
        _, _, store = load_streaming(prep, source, int(source.manifest.expert_bytes * 0.15),
                                     device_wait="off")
        built = []

        def refused(**kw):
            built.append(kw["name"])

            def kernel(**call):
                raise RuntimeError("no kernel image is available for execution on the device")
            return kernel

        monkeypatch.setattr(device, "backend", lambda: "cuda")
        monkeypatch.setattr(device, "_pinned", _host_pinned)
        monkeypatch.setattr(mx.fast, "cuda_kernel", refused, raising=False)
        assert DeviceWait.make(store, "auto") is None and built == []
        assert capsys.readouterr().err == ""
        assert DeviceWait.make(store, "on") is None and [n[:16] for n in built] == ["iod_device_wait_"]
        assert capsys.readouterr().err.strip() == (
            "infer: no device wait on this cuda GPU (no kernel image is available for execution on "
            "the device); streamed calls sync at their routers")
    finally:
        source.close()


def test_a_kernel_that_fails_at_load_is_named_and_the_session_syncs(prep_model, monkeypatch, capsys):
    """A backend whose kernel does not build (here: Metal's compiler
    refuses it) gives no device wait and one line on stderr saying why."""
    from infer.runtime.device import DeviceWait

    prep = prep_model("qwen3_moe")
    source = InprocSource(prep, arena=64 << 20)
    try:
        _, _, store = load_streaming(prep, source, int(source.manifest.expert_bytes * 0.15),
                                     device_wait="off")

        def refused(**kw):
            def kernel(**call):
                raise RuntimeError("[metal::Device] Unable to build metal library from source\nerror: ...")
            return kernel

        monkeypatch.setattr(device, "backend", lambda: "metal")
        monkeypatch.setattr(mx.fast, "metal_kernel", refused, raising=False)
        assert DeviceWait.make(store) is None
        err = capsys.readouterr().err.strip().splitlines()
        assert err == ["infer: no device wait on this metal GPU ([metal::Device] Unable to build metal "
                       "library from source); streamed calls sync at their routers"]
    finally:
        source.close()


def test_a_layer_called_twice_in_one_forward_syncs_the_second_call(prep_model, monkeypatch):
    """A layer's mailbox slot holds one call a forward: a second call of the
    same layer before the forward is served takes the synced path (which
    serves the first), so no post is read for the wrong call."""
    from infer.runtime.streaming import StreamingExperts

    prep = prep_model("qwen3_moe")
    gpu = FakeGPU(monkeypatch)
    source, model, tokenizer, store = _fake_session(prep, gpu)
    try:
        mod = next(m for _, m in model.named_modules() if isinstance(m, StreamingExperts))
        k = store.prefetcher.routers[mod._layout.layer][1]
        x = mx.random.normal((1, 1, model.args.hidden_size))
        store.deferring = True
        first = mod(x, mx.arange(k, dtype=mx.uint32).reshape(1, 1, k))
        second = mod(x, mx.arange(k, 2 * k, dtype=mx.uint32).reshape(1, 1, k))
        store.deferring = False
        store.settle()
        mx.eval(first, second)
    finally:
        gpu.close()
        source.close()
    assert store.stats["device_calls"] == 1 and store.stats["synced_calls"] == 1
    assert [ids for _, ids, _, _ in gpu.log] == [list(range(k))]


def _with_a_synced_layer(prep_model, monkeypatch):
    """A fake-GPU session whose first cached layer's calls all sync: (gpu, its session)."""
    from infer.runtime.device import DeviceWait

    gpu = FakeGPU(monkeypatch)
    session = _fake_session(prep_model("qwen3_moe"), gpu)
    synced = min(session[3].device.slot)
    fits = DeviceWait.fits
    monkeypatch.setattr(DeviceWait, "fits", lambda dw, stack, n: stack.layout.layer != synced and fits(dw, stack, n))
    return gpu, session


def test_a_synced_calls_deferred_misses_are_copied_before_the_forward_is_queued(prep_model, monkeypatch):
    """A forward with a synced call (here: every call of one layer) among
    device-path calls: the synced call's misses, deferred to the end of the
    forward, are copied in before any of the forward's graph goes to the
    GPU, which would compute that call's experts from rows not written yet
    (on an H100, 2026-12-07, qwen3_next at 15% gave other ids until this)."""
    gpu, (source, model, tokenizer, store) = _with_a_synced_layer(prep_model, monkeypatch)
    queue, pending_at_queue = gpu._queue, []

    def queue_checked(y):
        pending_at_queue.append(len(store._pending))
        queue(y)

    monkeypatch.setattr(device, "_queue", queue_checked)
    deferred = [0]
    fill = store._fill

    def counting(layer, experts, copy, stacks, defer):
        deferred[0] += bool(defer)
        return fill(layer, experts, copy, stacks, defer)

    monkeypatch.setattr(store, "_fill", counting)
    _generate(gpu, source, model, tokenizer, 24)
    assert deferred[0] > 0 and store.stats["device_calls"] > 0
    assert pending_at_queue and not any(pending_at_queue)


def test_a_failed_deferred_copy_still_sends_the_forward_to_the_gpu(prep_model, monkeypatch):
    """A synced call's deferred copy fails at the end of a forward with
    device-path calls: the forward raises the copy's error, but each of its
    calls still runs (on row 0; none is left to run later with another
    forward's turn), none waits out its timeout, and the next generation
    runs clear."""
    gpu, (source, model, tokenizer, store) = _with_a_synced_layer(prep_model, monkeypatch)
    fetch, failed = store._fetch, [0]

    def failing(layer, experts, copy):
        if store._pending and store.device.calls and not failed[0]:
            failed[0] = 1
            raise OSError("the disk went away")
        return fetch(layer, experts, copy)

    monkeypatch.setattr(store, "_fetch", failing)
    _raises_then_runs_clear(gpu, source, model, tokenizer, store, OSError)
    assert failed[0]


def test_a_post_is_waited_for_without_the_gil():
    """``native.wait_u32`` (the serving thread's wait for a post) sees a word
    another thread stores, gives up after its timeout, and lets Python
    threads run while it waits (the thread queueing the forward)."""
    import mmap
    import threading

    import native

    buf = mmap.mmap(-1, mmap.PAGESIZE)
    later = threading.Timer(0.05, native.store_u32, (buf, 8, 7))
    later.start()
    t0 = time.monotonic()
    assert native.wait_u32(buf, 8, 7, 0.002, 5.0)
    assert 0.04 < time.monotonic() - t0 < 2.0
    stamps, stop = [], [False]

    def count():
        while not stop[0]:
            stamps.append(time.monotonic())
            time.sleep(0)

    other = threading.Thread(target=count)
    other.start()
    try:
        t0 = time.monotonic()
        assert not native.wait_u32(buf, 8, 9, 0.002, 0.2)
        t1 = time.monotonic()
        assert 0.19 < t1 - t0 < 2.0
        native.wait_u32(buf, 8, 9, 0.2, 0.2)  # spinning, all of it
        t2 = time.monotonic()
        # the other thread ran Python while each wait went on
        assert any(t0 + 0.02 < t < t1 - 0.02 for t in stamps)
        assert any(t1 + 0.02 < t < t2 - 0.02 for t in stamps)
    finally:
        stop[0] = True
        other.join()


def test_an_interrupt_while_a_forward_is_built_leaves_no_kernel_waiting(prep_model, monkeypatch):
    """A Ctrl-C in the graph's build outside any streamed call (a layer's
    attention) after earlier layers' calls were built: those calls still go
    to the GPU (none is left for the next forward to queue as its own),
    none waits out its timeout, and the next generation runs clear."""
    prep = prep_model("qwen3_moe")
    gpu = FakeGPU(monkeypatch)
    source, model, tokenizer, store = _fake_session(prep, gpu)
    attn = model.model.layers[-1].self_attn
    calls = [0]

    class Interrupting(type(attn)):
        def __call__(self, *args, **kwargs):
            calls[0] += 1
            if calls[0] == 3:  # the second decode forward, its last layer
                assert store.device.calls  # (earlier layers' calls are built)
                raise KeyboardInterrupt
            return super().__call__(*args, **kwargs)

    attn.__class__ = Interrupting
    _raises_then_runs_clear(gpu, source, model, tokenizer, store, KeyboardInterrupt)
