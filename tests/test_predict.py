"""Expert prediction and prefetch (infer.runtime.predict, ExpertStore) on the
tiny-trained checkpoints: the calibrated predictors beat the router on the
residual, the calibration round-trips through `infer prep --calibrate`,
greedy ids stay mlx-lm's with prediction and prefetch on, and prefetched
records the call did not use are counted."""

import time
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from infer.runtime import predict
from infer.runtime.prefetch import DECODE_ROWS

from infer.tools import routing
from infer.runtime.streaming import MISS_KINDS
from infer.prep.prep import main as prep_main

ARCHS = ["qwen3_moe", "qwen3_next"]
SPLIT = 10000  # heldout.txt (text never trained on): calibrate on its start, measure on the rest


def heldout_part(folder, tmp_path_factory, first: bool) -> Path:
    text = (folder / "heldout.txt").read_text(encoding="utf-8")
    path = tmp_path_factory.mktemp("text") / ("calibration.txt" if first else "measured.txt")
    path.write_text(text[:SPLIT] if first else text[SPLIT:], encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory, trained_model):
    """``calibrated(arch) -> Path``: a prep folder made by `infer prep --calibrate`."""
    cache = {}
    root = tmp_path_factory.mktemp("calibrated")

    def make(arch):
        if arch not in cache:
            out = root / arch
            text = heldout_part(trained_model(arch), tmp_path_factory, True)
            argv = ["--model", str(trained_model(arch)), "--out", str(out), "--no-progress",
                    "--calibrate", str(text)]
            assert prep_main(argv) == 0
            cache[arch] = out
        return cache[arch]

    return make


def test_calibration_round_trips(calibrated, tmp_path):
    folder = calibrated("qwen3_moe")
    cal = predict.Calibration.load(folder)
    assert cal is not None and cal.text["fit_tokens"] >= cal.text["tokens"] // 2
    modules = [f"model.layers.{i}.mlp.switch_mlp" for i in range(4)]
    pairs = {(modules[s], s + d, d) for s in range(4) for d in predict.DEPTHS if s + d < 4}
    assert set(cal.choice) == {(m, d) for m, _, d in pairs}
    for m, t, d in pairs:
        w, b = cal.maps[(m, modules[t])]
        assert w.shape == (128, 64) and b.shape == (64,)
        name, breadth = cal.choice[(m, d)]
        assert name in predict.NAMES and 8 <= breadth <= 16
        assert cal.use[(m, d, name)].shape == (16,)
    cal.save(tmp_path)
    again = predict.Calibration.load(tmp_path / predict.CALIBRATION_NAME)
    assert again.choice == cal.choice and again.text == cal.text
    for key, (w, b) in cal.maps.items():
        assert np.array_equal(again.maps[key][0], w) and np.array_equal(again.maps[key][1], b)
    for key, u in cal.use.items():
        assert np.array_equal(again.use[key], u)
    # the same text's expert counts, for the cold start (infer.runtime.coldstart)
    from infer.runtime.coldstart import CALIBRATION_TOKENS, read_usage

    usage = read_usage(folder)
    assert sorted(usage) == [0, 1, 2, 3]
    for counts in usage.values():  # one call a token, top-8 each
        assert sum(counts.values()) == 8 * CALIBRATION_TOKENS


def test_calibrate_refuses_a_missing_empty_or_binary_text(trained_model, tmp_path, capsys):
    """Checked before the prep: one line, exit 2, nothing written."""
    (tmp_path / "empty.txt").write_text(" \n")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00binary")
    for name, why in (("none.txt", "is not a file"), ("empty.txt", "is empty"),
                      ("bin.txt", "is not UTF-8 text")):
        argv = ["--model", str(trained_model("qwen3_moe")), "--out", str(tmp_path / "p"),
                "--calibrate", str(tmp_path / name)]
        assert prep_main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and why in err, err
        assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("arch", ARCHS)
def test_calibrated_predictors_beat_the_router(arch, calibrated, trained_model, tmp_path_factory):
    """Calibrated on one part of the held-out text, measured on the other:
    the linear map's recall is above the router-on-residual's at every
    depth, and the combined predictor reaches depth-1 recall >= 0.85 at
    precision >= 0.5."""
    text = heldout_part(trained_model(arch), tmp_path_factory, False)
    rep = routing.report(calibrated(arch), text, 2048)
    p = rep["summary"]["predictors"]
    assert "calibration" in rep
    for d in ("1", "2", "3"):
        assert p["linear"][d]["recall"] > p["moe_input"][d]["recall"], (d, p)
        assert p["temporal"][d]["recall"] > 0
    assert p["combined"]["1"]["recall"] >= 0.85, p["combined"]
    assert p["combined"]["1"]["precision"] >= 0.5, p["combined"]


def record_source_calls(store):
    """Log the store's streamed calls and its source's hints and fetches:
    ("call", (layer, rows)), ("hint", [(layer, calls ahead)]), ("fetch", layer)."""
    log, source = [], store.source
    begin, hint, fetch = store.prefetcher.begin_call, source.prefetch_many, source.fetch_into

    def begin_call(layer, rows):
        log.append(("call", (layer, rows)))
        return begin(layer, rows)

    def prefetch_many(hints):
        log.append(("hint", [(layer, ahead) for layer, _, ahead in hints]))
        return hint(hints)

    def fetch_into(layer, experts, sink):
        log.append(("fetch", layer))
        return fetch(layer, experts, sink)

    store.prefetcher.begin_call, source.prefetch_many, source.fetch_into = begin_call, prefetch_many, fetch_into
    return log


def split_calls(log):
    """[((layer, rows), entries of its call)] from record_source_calls' log."""
    calls = []
    for kind, arg in log:
        if kind == "call":
            calls.append((arg, []))
        elif calls:
            calls[-1][1].append((kind, arg))
    return calls


def greedy(model, ids, n=32):
    return [t for t, _ in generate_step(mx.array(ids), model, max_tokens=n)]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_unchanged_with_prediction_and_prefetch(arch, calibrated, trained_model):
    """Streamed with the calibrated predictors, prefetch at depths 1-3 and a
    quarter of the experts cached: mlx-lm's greedy ids."""
    import mlx_lm
    from iod.inproc import InprocSource

    from infer.runtime.loader import load_streaming

    folder = calibrated(arch)
    model, tok = mlx_lm.load(str(trained_model(arch)))
    ids = tok.encode((trained_model(arch) / "heldout.txt").read_text())[:48]
    ref = greedy(model, ids)
    source = InprocSource(folder)
    try:
        streamed, _, store = load_streaming(folder, source, cache_bytes=int(source.manifest.expert_bytes * 0.25))
        store.prefetcher.depth = 3
        assert store.prefetcher.calibration is not None
        log = record_source_calls(store)
        assert greedy(streamed, ids) == ref
        assert store.stats["prefetched"] > 0
        assert store.stats["prefetch_used"] + store.stats["prefetch_unused"] <= store.stats["prefetched"]
        split = sum(store.stats["miss_" + k] for k in MISS_KINDS)
        assert 0 < split <= store.stats["misses"]
        # a decode call that waits for misses hints the next layers' guesses
        # before it demands them, never after; with hits-first (this CPU) its
        # misses go in the same message. The prefill's calls hint the next
        # layer once they have their own experts
        calls, early, merged = split_calls(log), 0, 0
        last = max(layer for (layer, _), _ in calls)
        for (layer, rows), entries in calls:
            if rows > DECODE_ROWS:
                at = entries.index(("fetch", layer))
                after = [arg for kind, arg in entries[at:] if kind == "hint"]
                assert after == ([[(layer + 1, 1)]] if layer < last else []), entries
            elif ("fetch", layer) in entries:
                at = entries.index(("fetch", layer))
                assert not any(kind == "hint" and any(l > layer for l, _ in arg)
                               for kind, arg in entries[at:]), entries
                early += any(kind == "hint" and any(l > layer for l, _ in arg)
                             for kind, arg in entries[:at])
                merged += any(kind == "hint" and (layer, 0) in arg and any(l > layer for l, _ in arg)
                              for kind, arg in entries[:at])
        assert early > 0 and merged > 0
        assert store.prefetcher.prediction_stats()[1]["recall"] > 0.5
        assert source.stats()["counters"]["prefetches"] > 0
    finally:
        source.close()


@contextmanager
def quarter_store(folder):
    """(store, source): ``folder`` streamed at a 25% cache through the
    in-process core, with no cold-start preload: nothing is cached or staged
    before a test's hints."""
    from iod.inproc import InprocSource

    from infer.runtime.loader import load_streaming

    source = InprocSource(folder)
    try:
        _, _, store = load_streaming(folder, source, cache_bytes=int(source.manifest.expert_bytes * 0.25),
                                     preload=False)
        yield store, source
    finally:
        source.close()


def test_unused_prefetch_is_counted(calibrated):
    """Hints for three experts, a call that uses one of them (and another):
    one used, two unused, their bytes counted."""
    with quarter_store(calibrated("qwen3_moe")) as (store, source):
        rec = store.layouts[1].record_bytes
        store.prefetcher.prefetch([(1, 1, mx.array([[3, 4, 5]]), None, 3)])
        assert store.stats["prefetched"] == 3 and store.stats["prefetched_bytes"] == 3 * rec
        store.gather(1, np.array([3, 9]))
        assert store.stats["prefetch_used"] == 1
        assert store.stats["prefetch_unused"] == 2
        assert store.stats["prefetch_unused_bytes"] == 2 * rec
        # a call without hints counts nothing more
        store.gather(1, np.array([4]))
        assert store.stats["prefetch_unused"] == 2


def test_a_calls_misses_are_counted_by_how_they_were_found(calibrated):
    """A decode call's misses: read ahead and ready (hinted, read in time),
    hinted and still being read (late), guessed but left out of the plan
    (unplanned), never guessed (cold); a prefill's misses are not counted."""
    with quarter_store(calibrated("qwen3_moe")) as (store, source):
        store.prefetcher.prefetch([(1, 1, mx.array([[3, 4]]), None, 2), (2, 1, mx.array([[5, 6]]), None, 2)])
        # the in-process core ends a read when it is polled: layer 1's are being read
        split = lambda: {k: store.stats["miss_" + k] for k in MISS_KINDS}
        store.gather(1, np.array([3, 9]), decode=True)
        assert split() == {"ready": 0, "late": 1, "unplanned": 0, "cold": 1}
        deadline = time.monotonic() + 10
        while not (source._is_ready(2, 5) and source._is_ready(2, 6)):
            assert time.monotonic() < deadline
            source._poll()
        store.gather(2, np.array([5, 7]), decode=True)
        assert split() == {"ready": 1, "late": 1, "unplanned": 0, "cold": 2}
        # guesses used by none of the calibration's calls: scored, not read
        store.prefetcher.prefetch([(3, 1, mx.array([[10, 11]]), np.zeros(2), 2)])
        assert 3 not in store.prefetcher._hinted
        store.gather(3, np.array([10, 12]), decode=True)
        assert split() == {"ready": 1, "late": 1, "unplanned": 1, "cold": 3}
        store.gather(0, np.arange(16))
        assert store.stats["miss_cold"] == 3


def test_a_calls_guesses_go_in_one_message(calibrated):
    """Guesses for two layers are hinted in one PREFETCH, and the daemon
    queues the reads of both (depth 1 each: with no measured rate the plan
    reads the nearest depth only)."""
    with quarter_store(calibrated("qwen3_moe")) as (store, source):
        sent = source.counters["prefetch_hints"]
        store.prefetcher.prefetch([(1, 1, mx.array([[3, 4]]), None, 2), (2, 1, mx.array([[5, 6]]), None, 2)])
        assert source.counters["prefetch_hints"] == sent + 1
        assert store.stats["prefetched"] == 4
        assert store.prefetcher._hinted == {1: {3, 4}, 2: {5, 6}}
        assert source.stats()["counters"]["prefetches"] == 1
        # each being read (the core runs in this thread: a read ends when it is
        # polled), or ready already
        reading = {k[1:] for k in source.core.sched.reads if k[0] == source.model_id}
        for layer, e in ((1, 3), (1, 4), (2, 5), (2, 6)):
            assert (layer, e) in reading or source._is_ready(layer, e)


def test_verify_passes_are_planned_and_a_prefill_reads_its_next_layer(calibrated):
    """A verify pass of 4 tokens guesses 32 distinct experts (more than twice
    a token's 8): still decode-sized, so its guesses are planned and read
    ahead. A 32-token prefill's guesses for the next layer are read, every
    one not cached or hinted, unplanned (it computes while they are read);
    its guesses for the layers after are scored, not read."""
    with quarter_store(calibrated("qwen3_moe")) as (store, source):
        verify = mx.arange(32).reshape(1, 4, 8)
        store.prefetcher.prefetch([(1, 1, verify, None, 8)])
        assert store.stats["prefetched"] == 32
        prefill = mx.arange(32 * 8).reshape(1, 32, 8) % 64
        cached = store.stack(2)
        cached.assign([7], {7})
        store.prefetcher.prefetch([(2, 1, prefill, None, 8), (3, 2, prefill, None, 8)])
        assert store.prefetcher._hinted[2] == set(range(64)) - {7}
        assert 3 not in store.prefetcher._hinted
        assert store.stats["prefetched"] == 32 + 63
        assert store.prefetcher._predicted[2][1] == (set(range(64)), False)
        assert store.prefetcher._predicted[3][2] == (set(range(64)), False)
        # the next call's wanted experts were hinted: used, none unused
        store.gather(2, np.arange(64))
        assert store.stats["prefetch_unused"] == 0
        # at most half the arena's slots, the experts most rows guessed first
        arena = source.layout
        source.layout = type(arena)(arena.slot_size, 10)
        try:
            rows = mx.array([[[40, 41]] * 3 + [[42, 43]] * 2 + [[e, e + 1] for e in range(44, 60, 2)]])
            store.prefetcher.prefetch([(3, 1, rows, None, 2)])
            assert store.prefetcher._hinted[3] == {40, 41, 42, 43, 44}
        finally:
            source.layout = arena


def test_plan_reads_what_fits_in_time():
    """Most likely first; within D layer calls no more than reads_in(D)
    records; guesses used less than MIN_USE only into spare disk time; deeper
    depths only when the next layer's guesses do not fit in one layer's compute."""
    c = [(0.9, 1, 1, e) for e in range(6)] + [(0.1, 1, 1, 6)] + [(0.6, 2, 2, e) for e in range(4)]
    # plenty of time: depth 1 only, all its likely guesses, and the unlikely one in spare time
    chosen = predict.plan(c, lambda d, rec: 100.0 * d, 1)
    assert sorted(x[3] for x in chosen) == list(range(7)) and all(x[1] == 1 for x in chosen)
    # the unlikely one not while the rate or the compute time is unknown
    chosen = predict.plan(c, lambda d, rec: float("inf"), 1)
    assert sorted(x[3] for x in chosen) == list(range(6))
    # 4 records per layer of compute: depth 1 does not fit in one, depth 2 is read too,
    # no more than 4 due within one call and 8 within two
    chosen = predict.plan(c, lambda d, rec: 4.0 * d, 1)
    assert sum(1 for x in chosen if x[1] == 1) == 4 and len(chosen) == 8
    # outstanding hints take their share
    assert len(predict.plan(c, lambda d, rec: 4.0 * d, 1, pending=3)) == 5


def test_uncalibrated_store_guesses_with_the_loaded_routers(trained_prep, trained_model):
    """Without a calibration the store applies the next layers' routers as
    mlx-lm loaded them (quantized, trained weights), not the modules the
    constructor made before loading: recall far above chance (8/64). Its
    guess is the router's top k, scored; ranks k + 1 to 2k come with it, for
    spare disk time only."""
    from iod.inproc import InprocSource

    from infer.runtime.loader import load_streaming
    from infer.runtime.prefetch import SPARE_RANKS

    folder = trained_prep("qwen3_moe")
    source = InprocSource(folder)
    try:
        model, tok, store = load_streaming(folder, source, cache_bytes=0)
        ahead = store.prefetcher
        assert ahead.calibration is None
        layer = min(ahead.routers)
        x = mx.random.normal((1, 1, model.args.hidden_size))
        for nxt, d, lazy, use, breadth in ahead.predict(layer, x):
            k = ahead.routers[nxt][1]
            assert use is None and breadth == k and lazy[2] == SPARE_RANKS * k
            ranked = np.array(lazy[0][:, lazy[1], : lazy[2]])
            assert len(set(ranked.ravel().tolist())) == SPARE_RANKS * k
        # with a measured rate and compute time: ranks past k only where half
        # the disk's time is free
        guess = (mx.array([list(range(2 * k))]), None, k)
        ahead.layer_s, ahead.disk_rate = 1.0, 2 * k * store.layouts[layer + 1].record_bytes
        ahead.prefetch([(layer + 1, 1, *guess)])
        assert store.stats["prefetched"] == k  # half of 2k reads: the guess fills it
        ahead.disk_rate *= 4
        ahead.prefetch([(layer + 2, 1, *guess)])
        assert store.stats["prefetched"] == k + 2 * k
        ahead.layer_s = ahead.disk_rate = None
        store.reset_stats()
        ids = tok.encode((trained_model("qwen3_moe") / "heldout.txt").read_text())[:16]
        greedy(model, ids, n=24)
        assert ahead.prediction_stats()[1]["recall"] > 0.5
    finally:
        source.close()


def test_plan_spare_reads_stay_within_half_the_disk_time():
    """Guesses used 3-15% of the time fill at most SPARE of what the disk reads
    in time, likeliest first; below SPARE_USE never; none without a likely one."""
    sure = [(0.9, 1, 1, e) for e in range(4)]
    spare = [(0.14 - 0.01 * e, 1, 1, 10 + e) for e in range(10)] + [(0.01, 1, 1, 99)]
    chosen = predict.plan(sure + spare, lambda d, rec: 16.0 * d, 1)
    extra = [x[3] for x in chosen if x[0] < predict.MIN_USE]
    assert len(chosen) == 8 and extra == [10, 11, 12, 13]  # 4 sure + 4 more = half of 16
    assert predict.plan(spare, lambda d, rec: 16.0 * d, 1) == []
    # a disk that reads 8 in time: the likely ones alone fit, nothing spare
    assert len(predict.plan(sure + spare, lambda d, rec: 8.0 * d, 1)) == 4


def test_guesses_past_the_breadth_are_read_in_spare_time_only(calibrated):
    """A calibrated guess goes on past its predictor's breadth; those ranks
    are read only within half of what the disk reads in time, however often
    they are used (the likely ones take the rest)."""
    with quarter_store(calibrated("qwen3_moe")) as (store, source):
        use = np.array([0.9] * 4 + [0.5] * 4)  # ranks 4-7 used half the time, past a breadth of 4
        ids = mx.array([[0, 1, 2, 3, 4, 5, 6, 7]])
        store.prefetcher.layer_s = 1.0
        store.prefetcher.disk_rate = 6 * store.layouts[1].record_bytes  # 6 records a layer's compute: half is 3
        store.prefetcher.prefetch([(1, 1, ids, use, 4)])
        assert store.stats["prefetched"] == 4  # the guess alone: ranks 4-7 would pass half
        store.reset_stats()
        store.prefetcher.disk_rate = 20 * store.layouts[2].record_bytes  # half is 10: all eight
        store.prefetcher.prefetch([(2, 1, ids, use, 4)])
        assert store.stats["prefetched"] == 8
        assert store.prefetcher._predicted[2][1] == ({0, 1, 2, 3}, True)  # scored: the guess


def test_layer_time_runs_router_to_router_less_io(calibrated, monkeypatch):
    """``layer_s`` (what the disk has for reads ahead per layer) is the time
    from one streamed call's router to the next one's in the same pass, IO
    waits left out, split over the layers passed; a new pass and calls past
    decode size update nothing."""
    from infer.runtime import streaming

    with quarter_store(calibrated("qwen3_moe")) as (store, source):
        first, _, third, *_ = sorted(store.prefetcher.routers)
        now = [100.0]
        monkeypatch.setattr(streaming.time, "monotonic", lambda: now[0])
        store.prefetcher.CLOCK_DECAY = 0.0  # the last figure alone
        store.prefetcher.clock(first, True)
        now[0] += 0.010
        store.io_s += 0.004  # waited for reads: the disk was busy with them
        store.prefetcher.clock(third, True)  # two layers on
        assert store.prefetcher.layer_s == pytest.approx(0.003)
        now[0] += 0.050
        store.prefetcher.clock(first, True)  # the next token: not a layer's time
        assert store.prefetcher.layer_s == pytest.approx(0.003)
        now[0] += 0.020
        store.prefetcher.clock(third, False)  # a prefill's call
        assert store.prefetcher.layer_s == pytest.approx(0.003)


def test_a_calls_linear_guesses_are_one_sort_and_read_back_with_its_ids(calibrated):
    """The linear maps of a call's next layers go as one matmul and one sort,
    read back in the call's one sync: the same ids, per layer and depth, as
    each map applied on its own."""
    with quarter_store(calibrated("qwen3_moe")) as (store, source):
        cal = store.prefetcher.calibration
        for (m, d) in list(cal.choice):  # every layer and depth linear, with its measured ranks
            cal.choice[(m, d)] = ("linear", cal.choice[(m, d)][1])
        layer = min(store.prefetcher.next_layers)
        module = store.layouts[layer].module
        x = mx.random.normal((1, 2, 128), key=mx.random.key(3))
        indices = mx.array([[[1, 2], [3, 4]]], dtype=mx.uint32)
        guesses = store.prefetcher.predict(layer, x)
        assert [g[:2] for g in guesses] == [(layer + d, d) for d in (1, 2, 3)]
        assert len({id(g[2][0]) for g in guesses}) == 1  # one sorted array for the three
        ids, read = store.prefetcher.read_guesses(indices, guesses)
        assert ids.tolist() == [[[1, 2], [3, 4]]]
        for nxt, d, got, use, breadth in read:
            w, b = cal.maps[(module, store.layouts[nxt].module)]
            wide = max(breadth, len(use))
            alone = predict.ranked(predict.linear_scores(x.reshape(2, 128), mx.array(w), mx.array(b)), wide)
            assert got.shape == (2, wide) and got.tolist() == np.array(alone).tolist()


def test_equal_guesses_are_read_best_rank_first_when_time_is_short(calibrated):
    """Guesses of one use (no measured use per rank) compete for the reads
    that fit in time by rank: the best ranked are hinted, each expert at its
    best rank over a call's rows, cached and hinted ones left out."""
    with quarter_store(calibrated("qwen3_moe")) as (store, source):
        rec = store.layouts[1].record_bytes
        store.prefetcher.disk_rate, store.prefetcher.layer_s = 4 * rec, 1.0  # four records a layer call
        store.stack(1).assign([40], set())  # cached: not read
        # expert 9 at ranks 4 and 0, 40 cached; of rank 2, 22 and 32 tie (the lower id goes)
        store.prefetcher.prefetch([(1, 1, mx.array([[40, 21, 22, 23, 9], [9, 31, 32, 33, 34]]), None, 5)])
        assert sorted(store.prefetcher._hinted[1]) == [9, 21, 22, 31]
