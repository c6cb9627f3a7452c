"""Split a session's memory budget: resident weights, working set, runtime,
the private daemon (when the session starts one), and the expert cache.

``--mem-budget`` bounds everything the session costs: the inference
process (runtime, resident weights, KV cache and activations, the expert
stacks, the records of one call being copied in) and, when no shared daemon
runs, the private daemon it starts (its runtime and its arena). A private
daemon's arena is only a staging area — records land there and are copied
into the session's stacks — so it is sized to one layer's worst call plus
the prefetches in flight, never as a second cache. The expert cache gets
what is left. A shared daemon's arena belongs to the user's daemon, not to
any session, so it is not part of a session's budget.
"""

import glob
import json
import os
from dataclasses import dataclass
from pathlib import Path

from shared.units import format_size

# Python, MLX, NumPy and ZeroMQ loaded, before any weights (measured on Linux).
RUNTIME_OVERHEAD = 160 << 20
# A daemon's own memory besides its arena: Python, ZeroMQ, NumPy, reader threads.
DAEMON_OVERHEAD = 64 << 20
# KV cache and activations of a short session (float32, small models), and
# the allocator's slack; long contexts need a larger budget.
ACTIVATIONS = 64 << 20


@dataclass
class MemoryPlan:
    budget: int
    resident_bytes: int
    working_bytes: int
    overhead_bytes: int
    cache_bytes: int
    arena_bytes: int = 0  # the private daemon's arena (0: shared daemon)
    daemon_bytes: int = 0  # the private daemon's runtime

    @property
    def minimum(self) -> int:
        return (self.resident_bytes + self.working_bytes + self.overhead_bytes
                + self.arena_bytes + self.daemon_bytes)

    def describe(self) -> str:
        parts = [f"resident weights {format_size(self.resident_bytes)}",
                 f"working set {format_size(self.working_bytes)}",
                 f"runtime {format_size(self.overhead_bytes)}"]
        if self.arena_bytes:
            parts.append(f"private iod arena {format_size(self.arena_bytes)} "
                         f"+ runtime {format_size(self.daemon_bytes)}")
        return " + ".join(parts)


def resident_bytes(model_dir) -> int:
    files = glob.glob(str(Path(model_dir) / "model*.safetensors"))
    return sum(os.path.getsize(f) for f in files)


def top_k(model_dir) -> int:
    """Experts each token is routed to (the model's top-k)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config = {**config.get("text_config", {}), **config}
    return int(config.get("num_experts_per_tok") or config.get("moe_topk") or 8)


def staging_arena_bytes(manifest, depth=2, top_k=8) -> int:
    """A private daemon's arena: one layer's worst call (every expert of the
    layer, as in a long prefill) plus the prefetches of ``depth`` layers."""
    most = max(l.num_experts for l in manifest.layers)
    slots = most + (depth + 1) * top_k
    return slots * manifest.max_stride + (1 << 20)  # + header and slot table


def working_bytes(manifest, top_k=8) -> int:
    """A call's transient expert copies: the fetched records as MLX arrays and,
    when a call needs more experts than the stack holds, a temporary compact
    stack of them all (the worst case is one layer's every expert), plus the
    KV cache and activations."""
    worst = max(l.num_experts * l.record_bytes for l in manifest.layers)
    return 2 * worst + ACTIVATIONS


def plan_memory(budget, model_dir, manifest, private_daemon=True, depth=2) -> MemoryPlan:
    """The cache size that keeps the session within ``budget``, or ValueError
    naming the minimum budget. With ``private_daemon`` the budget also holds
    the daemon the session starts and its staging arena."""
    k = top_k(model_dir)
    plan = MemoryPlan(budget, resident_bytes(model_dir), working_bytes(manifest, k),
                      RUNTIME_OVERHEAD, 0)
    if private_daemon:
        plan.arena_bytes = staging_arena_bytes(manifest, depth, k)
        plan.daemon_bytes = DAEMON_OVERHEAD
    if budget < plan.minimum:
        raise ValueError(
            f"memory budget {format_size(budget)} is below the minimum "
            f"{format_size(plan.minimum)} ({plan.describe()})"
        )
    # whole experts only, per layer: what does not make a position is left free
    plan.cache_bytes = budget - plan.minimum
    return plan


def shared_daemon_running() -> bool:
    """Whether the user's shared daemon (the default socket) is up, so that
    ``iod="auto"`` will attach to it rather than start a private one."""
    from shared.launch import lock_holder
    from shared import paths

    sock = paths.socket_path()
    try:
        return sock.exists() and lock_holder(paths.lock_path(sock.parent)) != 0
    except OSError:
        return False
