"""Latency samples for ``iod status``: a bounded ring per hop, percentiles on demand."""

from collections import deque

import numpy as np


class Latency:
    def __init__(self, keep: int = 20000):
        self.samples = deque(maxlen=keep)  # ns
        self.count = 0

    def add(self, ns: int) -> None:
        if ns >= 0:
            self.samples.append(ns)
            self.count += 1

    def summary(self) -> dict:
        """p50/p90/p99/max in microseconds over the kept samples, and the total count."""
        if not self.samples:
            return {"n": self.count, "p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}
        a = np.fromiter(self.samples, dtype=np.int64) / 1e3
        p50, p90, p99 = np.percentile(a, [50, 90, 99])
        return {"n": self.count, "p50": round(float(p50), 1), "p90": round(float(p90), 1),
                "p99": round(float(p99), 1), "max": round(float(a.max()), 1)}
