"""infer.runtime.gate: prediction runs where decode passes measure faster with it.

The gate on a scripted clock (which arm wins, the margin, prefills cut out
of the timing, the next probe), then on the tiny-trained model: prediction
made slow is turned off, and greedy ids stay mlx-lm's either way."""

import time

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from infer.runtime import gate
from infer.runtime.gate import PredictionGate


def drive(g, seconds, passes, t=0.0):
    """Run ``passes`` passes; ``seconds(on)`` is a pass's length with prediction on/off."""
    arms = []
    for _ in range(passes):
        g.start_pass(t)
        arms.append(g.on)
        t += seconds(g.on)
    return arms, t


PROBE = gate.WARMUP + 2 * gate.PAIRS * gate.WINDOW + 1  # passes until the first decision is in force


def test_off_wins_when_passes_are_faster_without_prediction():
    g = PredictionGate()
    arms, _ = drive(g, lambda on: 0.010 if on else 0.008, PROBE + 10)
    assert arms[: gate.WARMUP] == [True] * gate.WARMUP
    probe = arms[gate.WARMUP : gate.WARMUP + 2 * gate.PAIRS * gate.WINDOW]
    assert probe.count(False) == gate.PAIRS * gate.WINDOW  # half the probe's passes without
    assert arms[-10:] == [False] * 10
    assert g.probes == [{"on_s": pytest.approx(0.010), "off_s": pytest.approx(0.008),
                         "off_over_on": pytest.approx(0.8), "pairs": [pytest.approx(0.8)] * gate.PAIRS,
                         "on": False}]
    assert g.stats()["passes_off"] == arms.count(False)


@pytest.mark.parametrize("off_s", [0.010, 0.0099, 0.012])
def test_on_stays_unless_off_is_faster_by_the_margin(off_s):
    g = PredictionGate()
    arms, _ = drive(g, lambda on: 0.010 if on else off_s, PROBE + 10)
    assert arms[-10:] == [True] * 10 and g.probes[-1]["on"]


@pytest.mark.parametrize("drift", [1.01, 0.99])
def test_a_drifting_machine_does_not_turn_prediction_off(drift):
    """Passes 1% slower (faster) every window whichever the arm: off's
    windows come after on's in one pair, before them in the next, and the
    margin covers what the median of an odd number of pairs leaves."""
    g = PredictionGate()
    t = 0.0
    for i in range(PROBE + 10):
        g.start_pass(t)
        t += 0.010 * drift ** (i // gate.WINDOW)
    assert g.on and sorted(g.probes[-1]["pairs"])[0] < 1 < sorted(g.probes[-1]["pairs"])[-1]


def test_next_probe_after_the_hold_can_turn_prediction_back_on():
    g = PredictionGate()
    _, t = drive(g, lambda on: 0.010 if on else 0.005, PROBE)
    assert not g.on
    arms, _ = drive(g, lambda on: 0.005 if on else 0.010, gate.HOLD + 2 * gate.PAIRS * gate.WINDOW + 5, t)
    # the deciding pass (the last of the first drive) was the hold's first
    assert arms[: gate.HOLD - 1] == [False] * (gate.HOLD - 1) and arms[gate.HOLD - 1]
    assert g.on and len(g.probes) == 2


def test_the_winners_run_doubles_while_probes_agree():
    """Off wins every probe: the passes between probes go 384, 768, 1536, ..."""
    g = PredictionGate()
    decided, t = [], 0.0
    for i in range(12000):  # the passes at which a probe decides
        n = len(g.probes)
        g.start_pass(t)
        t += 0.010 if g.on else 0.005
        if len(g.probes) > n:
            decided.append(i)
    probe = 2 * gate.PAIRS * gate.WINDOW
    holds = [b - a - probe for a, b in zip(decided, decided[1:])]
    assert holds[:5] == [gate.HOLD, 2 * gate.HOLD, 4 * gate.HOLD, gate.MAX_HOLD, gate.MAX_HOLD]
    assert all(not p["on"] for p in g.probes)


def test_prefills_cut_out_of_the_timing():
    """A prefill in every pass of the probe: nothing timed, prediction stays on."""
    g = PredictionGate()
    t = 0.0
    for i in range(PROBE + 10):
        g.start_pass(t)
        if i >= gate.WARMUP:
            g.discard()
        t += 0.010 if g.on else 0.001
    assert g.on and g.probes == [{"on_s": None, "off_s": None, "off_over_on": None, "pairs": [], "on": True}]


def test_a_window_cut_by_prefills_leaves_the_other_pairs_paired():
    """The probe's first window (on) untimed: its pair is dropped, and the
    next two pairs (off-on, on-off) still compare neighbours and decide."""
    g = PredictionGate()
    t = 0.0
    for i in range(PROBE + 10):
        g.start_pass(t)
        if gate.WARMUP <= i < gate.WARMUP + gate.WINDOW:
            g.discard()
        t += 0.010 if g.on else 0.008
    assert not g.on and g.probes[0]["pairs"] == [pytest.approx(0.8)] * (gate.PAIRS - 1)


def test_only_one_token_passes_are_timed():
    """Verify passes (several tokens) are other work: probes of them alone
    decide nothing, prediction stays on, and the hold does not grow, not
    even at the first measured probe after them (alike, but untested)."""
    g = PredictionGate()
    decided, t = [], 0.0
    probe = 2 * gate.PAIRS * gate.WINDOW
    for i in range(gate.WARMUP + 3 * (gate.HOLD + probe) + 2 * gate.HOLD):
        n = len(g.probes)
        g.start_pass(t, timed=i > gate.WARMUP + 2 * probe + gate.HOLD)  # from after the 2nd probe
        t += 0.005 if g.on else 0.010  # one-token passes: faster with prediction
        if len(g.probes) > n:
            decided.append(i)
    untimed = [p for p in g.probes if not p["pairs"]]
    assert g.on and all(p["on"] for p in g.probes) and len(untimed) == 2 and len(g.probes) == 4
    assert g.probes[2]["off_over_on"] == pytest.approx(2.0)
    assert [b - a - probe for a, b in zip(decided, decided[1:])] == [gate.HOLD] * 3


@pytest.mark.parametrize("mode", ["on", "off"])
def test_fixed_modes_never_switch(mode):
    g = PredictionGate(mode)
    arms, _ = drive(g, lambda on: 0.010 if on == (mode == "on") else 0.001, PROBE + 10)
    assert set(arms) == {mode == "on"} and g.probes == []
    with pytest.raises(ValueError):
        PredictionGate("sometimes")


def test_slow_prediction_is_turned_off_and_ids_stay_mlx_lms(trained_model, trained_prep):
    """Guesses made 20 ms slower a call: the gate's probe finds the passes
    faster without them and stops predicting; greedy ids equal mlx-lm's."""
    import mlx_lm
    from iod.inproc import InprocSource

    from infer.runtime.loader import load_streaming

    folder = trained_model("qwen3_moe")
    model, tok = mlx_lm.load(str(folder))
    ids = tok.encode((folder / "heldout.txt").read_text())[:24]
    n = PROBE + 16
    ref = [t for t, _ in generate_step(mx.array(ids), model, max_tokens=n)]
    prep = trained_prep("qwen3_moe")
    source = InprocSource(prep)
    try:
        streamed, _, store = load_streaming(prep, source, cache_bytes=int(source.manifest.expert_bytes * 0.25))
        store.prefetcher.depth = 3
        predict, called = store.prefetcher.predict, []

        def slow(layer, x):
            called.append(store.prefetcher.gate.on)
            time.sleep(0.02)
            return predict(layer, x)

        store.prefetcher.predict = slow
        assert [t for t, _ in generate_step(mx.array(ids), streamed, max_tokens=n)] == ref
        stats = store.prefetcher.gate.stats()
        assert not stats["on"] and stats["probes"][0]["off_over_on"] < 1 - gate.MARGIN
        assert stats["passes_off"] >= gate.PAIRS * gate.WINDOW + 15
        assert all(called)  # no guesses while off
        assert len(called) < n * 4  # four MoE layers a pass
    finally:
        source.close()
