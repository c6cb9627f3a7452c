"""Split a session's memory budget between resident weights and the expert cache."""

import glob
import json
import os
from dataclasses import dataclass
from pathlib import Path

from shared.units import format_size

# Python, MLX, NumPy and ZeroMQ loaded, before any weights (measured on Linux).
RUNTIME_OVERHEAD = 160 << 20


@dataclass
class MemoryPlan:
    budget: int
    resident_bytes: int
    working_bytes: int
    overhead_bytes: int
    cache_bytes: int

    @property
    def minimum(self) -> int:
        return self.resident_bytes + self.working_bytes + self.overhead_bytes


def resident_bytes(model_dir) -> int:
    files = glob.glob(str(Path(model_dir) / "model*.safetensors"))
    return sum(os.path.getsize(f) for f in files)


def plan_memory(budget, model_dir, manifest) -> MemoryPlan:
    """The cache size that keeps the session within ``budget``, or ValueError
    naming the minimum budget."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    top_k = config.get("num_experts_per_tok") or config.get("moe_topk") or 8
    # a decode step holds its layer's experts twice: cached and stacked
    working = 2 * top_k * max(l.record_bytes for l in manifest.layers)
    resident = resident_bytes(model_dir)
    plan = MemoryPlan(budget, resident, working, RUNTIME_OVERHEAD, 0)
    if budget < plan.minimum:
        raise ValueError(
            f"memory budget {format_size(budget)} is below the minimum "
            f"{format_size(plan.minimum)} (resident weights {format_size(resident)} "
            f"+ working set {format_size(working)} + runtime {format_size(RUNTIME_OVERHEAD)})"
        )
    plan.cache_bytes = budget - plan.minimum
    return plan
