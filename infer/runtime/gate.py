"""Whether a session's expert prediction pays for its host time.

Prediction (the next layers' guesses, the prefetch plan, the hint messages)
costs host time on every streamed layer call and saves stall only where its
reads land in time. Which wins depends on the machine, the model and the
budget (docs/benchmarks.md: on the lent H200 it lost, on this project's CPU
it won), so it is measured, not modelled: decode passes run in windows with
prediction on and off, in the order on-off, off-on, on-off (drift
cancels), and the arm whose passes are faster runs until the next probe.
Only one-token passes are timed (a verify pass or a prompt chunk is other
work). Prediction stays on unless off is faster by ``MARGIN`` in the median
of the pairs. The winner's run doubles while probes agree. Output is the
same either way.
"""

import statistics

WARMUP = 16  # passes with prediction on before the first probe (precision scored, cache warm)
WINDOW = 8  # passes per window; the first of each is not timed (the other arm's reads land)
PAIRS = 3  # on/off window pairs per probe
HOLD = 384  # passes the winner runs before the next probe; doubled while probes agree,
MAX_HOLD = 3072  # up to this (a probe's losing windows then cost <1% of the passes)
MARGIN = 0.02  # off must be this much faster


class PredictionGate:
    """Decides, pass by pass, whether streamed calls predict.

    ``mode`` is "auto" (measured), "on" or "off". The store calls
    ``start_pass(now, timed)`` at each decode-sized pass's first streamed
    layer (``timed``: a one-token pass) and ``discard()`` at a larger call
    (a prefill: the pass it is in is not timed).
    """

    def __init__(self, mode="auto"):
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"prediction gate mode must be auto, on or off, not {mode!r}")
        self.mode = mode
        self.on = mode != "off"
        self.passes = {True: 0, False: 0}  # passes run with prediction on / off
        self.probes = []  # per probe: see stats()
        self._schedule = []  # arms of the probe's windows still to run
        self._times = []  # this window's timed pass seconds
        self._windows = []  # (arm, median seconds a pass or None) of this probe
        self._left = WARMUP  # passes before the next probe
        self._hold = HOLD  # the winner's run after this probe
        self._start = None  # the current pass's start time, None if it is not timed
        self._in_window = 0  # passes of the current window so far

    def start_pass(self, now, timed=True):
        """A decode pass starts at ``now`` (seconds): the previous one ends."""
        if self._start is not None and self._schedule and self._in_window > 1:
            self._times.append(now - self._start)
        self._start = now if timed else None
        if self.mode != "auto":
            self.passes[self.on] += 1
            return
        if self._schedule:
            if self._in_window == WINDOW:
                self._close_window()
        elif self._left > 0:
            self._left -= 1
        else:  # a probe: on-off, off-on, on-off, ...
            self._schedule = [arm for i in range(PAIRS) for arm in ((True, False), (False, True))[i % 2]]
            self._windows = []
            self._open_window()
        if self._schedule:
            self._in_window += 1
        self.passes[self.on] += 1

    def discard(self):
        """A call larger than a decode pass: the pass it is in is not timed."""
        self._start = None

    def _open_window(self):
        self.on = self._schedule[0]
        self._times = []
        self._in_window = 0

    def _close_window(self):
        arm = self._schedule.pop(0)
        self._windows.append((arm, statistics.median(self._times) if self._times else None))
        if self._schedule:
            self._open_window()
            return
        self._decide()

    def _decide(self):
        ratios = []  # off's seconds a pass over on's, per pair of windows both timed
        w = self._windows
        for a, b in zip(w[::2], w[1::2]):
            if a[1] is not None and b[1] is not None:
                on_s, off_s = (a[1], b[1]) if a[0] else (b[1], a[1])
                ratios.append(off_s / on_s)
        # no pair timed (prefills, verify passes): prediction stays on, untested
        ratio = statistics.median(ratios) if ratios else None
        on = ratio is None or ratio > 1 - MARGIN
        last = self.probes[-1] if self.probes else None
        agree = ratio is not None and last is not None and last["off_over_on"] is not None \
            and last["on"] == on  # two measured verdicts alike
        self._hold = min(2 * self._hold, MAX_HOLD) if agree else HOLD
        self.on = on
        ons = [s for arm, s in w if arm and s is not None]
        offs = [s for arm, s in w if not arm and s is not None]
        self.probes.append({"on_s": statistics.median(ons) if ons else None,
                            "off_s": statistics.median(offs) if offs else None,
                            "off_over_on": ratio, "pairs": ratios, "on": self.on})
        self._left = self._hold - 1  # this pass is the winner's first

    def stats(self):
        """For `infer bench` and `infer run --json`: the mode, passes per arm and each probe's figures
        (the median pass of each arm's windows; per pair of windows off's
        over on's, and their median, which decides)."""
        return {"mode": self.mode, "on": self.on, "passes_on": self.passes[True],
                "passes_off": self.passes[False], "probes": list(self.probes)}
