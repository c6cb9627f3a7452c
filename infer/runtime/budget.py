"""Split a session's memory budget: runtime, resident weights, KV cache and
activations, the prefill's working set, the private daemon (when the
session starts one), and the expert cache.

``--mem-budget B`` means the whole process tree — the inference process,
the private daemon it starts, the daemon's arena, MLX's buffers and the page
cache it causes — fits in a memory cgroup of B bytes (``scripts/bench/bench_cgroup.py``
and ``tests/test_budget.py`` run it in one). Every part is planned at the
size it really takes, not as stored on disk:

- the resident weights and the expert stacks at the compute dtype
  (``--dtype float32`` doubles a bfloat16 folder's scales and norms);
- the runtime as a memory cgroup charges it (anonymous memory, plus a
  reserve for the library pages in use), measured;
- the KV cache for the session's context and the activations of one
  prefill step;
- the prefill's working set: a prefill call that needs more experts than a
  layer's stack holds runs on a temporary compact stack, so the plan bounds
  the experts one call can need by choosing mlx-lm's ``prefill_step_size``
  (a step of s tokens needs at most s × top-k experts);
- a private daemon's arena, a staging area only (records land there and
  are copied into the stacks), sized to one decode call's records plus the
  prefetches in flight; a larger call comes in waves.

The expert cache gets what is left. A shared daemon's arena belongs to the
user's daemon, not to one session, and is left out.
"""

import glob
import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from shared.blob import open_inside
from shared.units import format_size

# The inference process's own memory as a memory cgroup charges it, without
# weights, stacks or KV cache: Python, MLX, NumPy, ZeroMQ, mlx-lm and the
# tokenizer code loaded, glibc's and MLX's allocator slack during a run
# (measured in a memory cgroup: 62-76 MiB anonymous on Linux x86 with the
# allocator settings of ``limit_process``), plus a reserve for the library
# pages it keeps using (reclaimable, but charged to the cgroup that reads
# them first).
RUNTIME_OVERHEAD = 96 << 20
# A daemon's own memory besides its arena (measured: 23 MiB anonymous) and
# its library pages.
DAEMON_OVERHEAD = 32 << 20
# Activations of one decode step and the small buffers MLX keeps for reuse.
ACTIVATIONS = 16 << 20
# MLX's cache of freed buffers beyond half the working set (MLX's default:
# 32 MiB on a Linux CPU, its memory limit elsewhere).
MLX_CACHE_LIMIT = 8 << 20
# Context assumed for the KV cache when the caller does not say (serve).
DEFAULT_CONTEXT = 4096
# mlx-lm's default, kept when the stacks hold every expert.
PREFILL_STEP = 2048
# Share of the budget a prefill's compact stack may take (beyond its floor
# of one token's experts).
WORKING_SHARE = 0.10

_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U32": 4,
             "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_FLOATS = {"F64", "F32", "F16", "BF16"}
_DTYPE_SIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
_MLX_ITEMSIZE = {"uint32": 4, "uint16": 2, "uint8": 1, "int8": 1, "int32": 4,
                 "float32": 4, "float16": 2, "bfloat16": 2}


@dataclass
class MemoryPlan:
    budget: int
    resident_bytes: int  # resident weights at the compute dtype
    working_bytes: int  # the prefill's compact stack, at most
    overhead_bytes: int  # the inference process's runtime
    cache_bytes: int  # the expert cache, in record bytes as stored (ExpertStore's unit)
    arena_bytes: int = 0  # the private daemon's arena (0: shared daemon)
    daemon_bytes: int = 0  # the private daemon's runtime
    kv_bytes: int = 0  # KV cache for the planned context
    activation_bytes: int = 0  # one prefill step's activations
    mlx_cache_bytes: int = MLX_CACHE_LIMIT  # freed buffers MLX keeps for reuse
    stack_bytes: int = 0  # what the cache costs at the compute dtype
    prefill_step: int = PREFILL_STEP  # tokens per prefill call (mlx-lm's prefill_step_size)
    capacity: dict = field(default_factory=dict)  # layer -> experts its stack holds
    floor: int = 0  # the smallest budget this model, context and dtype accept

    @property
    def minimum(self) -> int:
        return (self.resident_bytes + self.working_bytes + self.overhead_bytes + self.kv_bytes
                + self.activation_bytes + self.mlx_cache_bytes + self.arena_bytes
                + self.daemon_bytes)

    def describe(self) -> str:
        parts = [f"resident weights {format_size(self.resident_bytes)}",
                 f"working set {format_size(self.working_bytes)}",
                 f"KV cache and activations {format_size(self.kv_bytes + self.activation_bytes)}",
                 f"MLX buffer cache {format_size(self.mlx_cache_bytes)}",
                 f"runtime {format_size(self.overhead_bytes)}"]
        if self.arena_bytes:
            parts.append(f"private iod arena {format_size(self.arena_bytes)} "
                         f"+ runtime {format_size(self.daemon_bytes)}")
        return " + ".join(parts)


def model_config(model_dir) -> dict:
    """config.json, with a text_config's keys (VLM wrappers) under the top level's."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    text = config.get("text_config")
    return {**(text if isinstance(text, dict) else {}), **config}


def _safetensors_header(path) -> dict:
    # a regular file only: a FIFO in the folder must not hang the argument check
    path = Path(path)
    with os.fdopen(open_inside(path.parent, path.name), "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def resident_files(model_dir) -> list:
    return sorted(glob.glob(str(Path(model_dir) / "model*.safetensors")))


def resident_bytes(model_dir, dtype=None) -> int:
    """The resident weights' size in memory: as stored, or with every
    floating tensor at ``dtype`` (a name, e.g. "float32"), as ``--dtype``
    casts them (an upper bound: a model's cast predicate may keep a few)."""
    files = resident_files(model_dir)
    if dtype is None:
        return sum(os.path.getsize(f) for f in files)
    size = _DTYPE_SIZE[str(dtype).replace("mlx.core.", "")]
    total = 0
    for f in files:
        for t in _safetensors_header(f).values():
            n = 1
            for d in t["shape"]:
                n *= d
            total += n * (size if t["dtype"] in _FLOATS else _ITEMSIZE.get(t["dtype"], 4))
    return total


def stack_record_bytes(layout, dtype=None) -> int:
    """One expert's bytes in a layer stack: its segments, floats at ``dtype``."""
    size = _DTYPE_SIZE.get(str(dtype).replace("mlx.core.", "")) if dtype is not None else None
    total = 0
    for s in layout.segments:
        n = 1
        for d in s.shape:
            n *= d
        floating = s.dtype in _DTYPE_SIZE
        total += n * (size if size and floating else _MLX_ITEMSIZE[s.dtype])
    return total


def top_k(model_dir) -> int:
    """Experts each token is routed to (the model's top-k)."""
    config = model_config(model_dir)
    return int(config.get("num_experts_per_tok") or config.get("moe_topk") or 8)


def kv_bytes_per_token(model_dir, dtype=None) -> int:
    """KV cache bytes per token of context, all layers: 2 × KV heads × head
    dim per layer (full attention everywhere: an upper bound for models with
    linear-attention or sliding-window layers)."""
    c = model_config(model_dir)
    layers = int(c.get("num_hidden_layers", 1))
    hidden = int(c.get("hidden_size", 1024))
    heads = int(c.get("num_attention_heads", 1))
    kv_heads = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or hidden // max(heads, 1))
    if "kv_lora_rank" in c:  # MLA: mlx-lm caches full per-head keys and values
        head_dim = int(c.get("qk_nope_head_dim", head_dim)) + int(c.get("qk_rope_head_dim", 0))
        kv_heads = heads
    size = _DTYPE_SIZE.get(str(dtype).replace("mlx.core.", ""), 0) or \
        _DTYPE_SIZE.get(str(c.get("torch_dtype", "bfloat16")), 2)
    return layers * 2 * kv_heads * head_dim * size


def activation_bytes(model_dir, step, context, dtype=None) -> int:
    """One prefill step of ``step`` tokens at ``context``: the hidden states
    and MLP intermediates of a layer, the attention scores."""
    c = model_config(model_dir)
    hidden = int(c.get("hidden_size", 1024))
    heads = int(c.get("num_attention_heads", 1))
    inter = int(c.get("moe_intermediate_size") or c.get("intermediate_size") or 4 * hidden)
    dense = int(c.get("intermediate_size") or inter)
    k = top_k(model_dir)
    per_token = 32 * hidden + 3 * k * inter + 3 * dense + 2 * heads * context
    return ACTIVATIONS + step * per_token * 4


def staging_arena_bytes(manifest, depth=2, top_k=8, prefill=True) -> int:
    """A private daemon's arena: one decode call's records plus the
    prefetches of ``depth`` layers, and with ``prefill`` a whole layer's
    experts besides (a prefill's call in one wave). Without it a larger call
    is served in waves of the session's share (what ``plan_memory`` plans:
    waves cost round trips, not reads)."""
    slots = (depth + 1) * top_k
    if prefill:
        slots += max(l.num_experts for l in manifest.layers)
    return slots * manifest.max_stride + (1 << 20)  # + header and slot table


def _round_up(n, step):
    return -(-n // step) * step


def cached_layers(manifest, mtp_cache=False) -> list:
    """The layouts the expert cache is shared over: the model's own, and an
    MTP head's only while it drafts (a plain run never calls them; sharing
    with them gave a fifth of a 4-layer qwen3_next's cache to nothing)."""
    return [l for l in manifest.layers if mtp_cache or not l.module.startswith("mtp.")]


def cached_expert_bytes(manifest, mtp_cache=False) -> int:
    """The expert bytes of ``cached_layers``: what a cache fraction is of."""
    return sum(l.stride * l.num_experts for l in cached_layers(manifest, mtp_cache))


# what a streamed layer's call costs beyond its reads (the sync at its router
# and its host work), in missed records: ~0.9 ms a layer against ~0.4 ms a
# record read on the lent H200; on this 2-core CPU ~1.3 ms against ~0.5 ms
LAYER_COST_RECORDS = 1.0


def split_cache(layouts, cache_bytes, usage=None, top_k=8) -> dict:
    """{layer: positions} for the stacks of ``layouts`` out of ``cache_bytes``.

    Evenly, unless a calibration's expert counts (``usage``,
    ``infer.runtime.coldstart``) say that whole layers pay: a stack that holds its
    whole layer runs as the resident model does (no sync, no host work), so
    layers are made whole, those whose even share hits least first, while
    the cost (per token: ``LAYER_COST_RECORDS`` for each layer streamed,
    plus its expected misses, ``top_k`` times the calibration's routing mass
    outside its best-used experts) falls; the other layers share the rest
    evenly."""
    layouts = list(layouts)
    if not layouts:
        return {}
    share = cache_bytes // len(layouts)
    even = {l.layer: min(l.num_experts, share // l.record_bytes) for l in layouts}
    if not usage or any(l.layer not in usage for l in layouts):
        return even
    hit = {}  # layer -> routing mass of its c best-used experts, c = 0..E
    for l in layouts:
        counts = sorted(usage[l.layer].values(), reverse=True)[: l.num_experts]
        total = sum(counts) or 1
        mass = [0.0]
        for i in range(l.num_experts):
            mass.append(mass[-1] + (counts[i] if i < len(counts) else 0) / total)
        hit[l.layer] = mass

    def cost(caps):
        return sum(0.0 if caps[l.layer] >= l.num_experts else
                   LAYER_COST_RECORDS + top_k * (1.0 - hit[l.layer][caps[l.layer]]) for l in layouts)

    best, best_cost = even, cost(even)
    order = sorted(layouts, key=lambda l: hit[l.layer][even[l.layer]])
    for n in range(1, len(layouts)):
        whole, rest = order[:n], order[n:]
        left = cache_bytes - sum(l.num_experts * l.record_bytes for l in whole)
        if left < 0:
            break
        each = left // len(rest)
        caps = {l.layer: l.num_experts for l in whole}
        caps.update({l.layer: min(l.num_experts, each // l.record_bytes) for l in rest})
        c = cost(caps)
        if c < best_cost:
            best, best_cost = caps, c
    return best


def plan_memory(budget, model_dir, manifest, private_daemon=True, depth=2, dtype=None,
                context=None, mtp_cache=False) -> MemoryPlan:
    """The cache size that keeps the session within ``budget``, or ValueError
    naming the minimum budget. ``dtype``: the compute dtype's name (None:
    the folder's own); ``context``: tokens of prompt and generation (KV
    cache; default ``DEFAULT_CONTEXT``); with ``private_daemon`` the budget
    also holds the daemon the session starts and its staging arena;
    ``mtp_cache``: an MTP head drafts, and its layers share the cache."""
    k = top_k(model_dir)
    layouts = manifest.layers
    real = {l.layer: stack_record_bytes(l, dtype) for l in layouts}
    most = max(l.num_experts for l in layouts)
    worst = max(real.values())
    context = context or DEFAULT_CONTEXT
    kv = kv_bytes_per_token(model_dir, dtype) * _round_up(context, 256)  # mlx-lm grows it by 256
    plan = MemoryPlan(budget, resident_bytes(model_dir, dtype), 0, RUNTIME_OVERHEAD, 0,
                      kv_bytes=kv)
    if private_daemon:
        plan.arena_bytes = staging_arena_bytes(manifest, depth, k, prefill=False)
        plan.daemon_bytes = DAEMON_OVERHEAD

    def fixed(step, experts):
        """Plan a prefill of ``step`` tokens per call whose compact stack
        holds at most ``experts``: it and the records staged into it are the
        working set. Returns the budget this needs with one expert per stack."""
        plan.prefill_step = step
        plan.working_bytes = 2 * experts * worst
        # freed compact stacks are reused from MLX's cache, not reallocated
        plan.mlx_cache_bytes = MLX_CACHE_LIMIT + plan.working_bytes // 2
        plan.activation_bytes = activation_bytes(model_dir, min(step, context), context, dtype)
        return plan.minimum + sum(real.values())  # every stack has one position

    # the floor: one token per prefill call, a compact stack of its experts
    floor = fixed(1, min(most, k))
    plan.floor = floor
    if budget < floor:
        raise ValueError(f"memory budget {format_size(budget)} is below the minimum "
                         f"{format_size(floor)} ({plan.describe()})")
    # the stacks hold every expert: no call ever needs a compact stack
    if budget - fixed(PREFILL_STEP, 0) >= sum(l.num_experts * real[l.layer] for l in layouts) \
            - sum(real.values()):
        return _fill(plan, budget, manifest, real, mtp_cache)
    # more tokens per call, as the working share of the budget allows
    experts = min(most, max(k, int(WORKING_SHARE * budget) // (2 * worst)))
    if budget < fixed(max(1, experts // k), experts):
        fixed(1, min(most, k))
    _fill(plan, budget, manifest, real, mtp_cache)
    # a step whose experts fit in every stack needs no compact stack: its
    # reserve goes to the cache, and the step grows as far as the stacks allow
    cap = min(plan.capacity.values())
    if cap >= plan.prefill_step * k:
        step = plan.prefill_step
        if budget < fixed(max(step, min(cap // k, PREFILL_STEP)), 0):
            fixed(step, 0)
        _fill(plan, budget, manifest, real, mtp_cache)
    return plan


def minimum_budget(model_dir, manifest, private_daemon=True, depth=2, dtype=None,
                   context=None) -> int:
    """The smallest budget ``plan_memory`` accepts."""
    return plan_memory(1 << 50, model_dir, manifest, private_daemon, depth, dtype, context).floor


def _fill(plan, budget, manifest, real, mtp_cache=False):
    """The expert cache gets what is left: the same share for every cached
    layer (as ``ExpertStore`` splits it under a plan: no whole layers),
    whole experts at their real size, one position per stack at least (a
    stack always has one)."""
    layouts = cached_layers(manifest, mtp_cache)
    free = budget - plan.minimum - sum(real.values())
    share = max(0, free) // len(layouts)
    plan.capacity = {l.layer: min(l.num_experts, 1 + share // real[l.layer]) for l in layouts}
    plan.stack_bytes = sum(c * real[l] for l, c in plan.capacity.items())
    # ExpertStore's unit: record bytes as stored, split evenly, whole records
    # per layer; the largest share that gives no layer more than planned
    nominal = min((plan.capacity[l.layer] + 1) * l.record_bytes - 1 for l in layouts)
    plan.cache_bytes = nominal * len(layouts)
    return plan


def plan_session(budget, model_dir, manifest, iod, **kw):
    """``plan_memory`` for a session that connects with ``iod``, and the
    IodClient arguments it implies: with ``iod="auto"`` and no shared daemon
    up, the session starts a private one, whose staging arena is planned
    into the budget too. Returns (plan, client keyword arguments)."""
    private = iod == "auto" and not shared_daemon_running()
    plan = plan_memory(budget, model_dir, manifest, private, **kw)
    return plan, ({"arena": plan.arena_bytes} if private else {})


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


def context_tokens(prompt: str, max_tokens: int, system_prompt=None, max_kv_size=None) -> int:
    """An upper bound on a session's context before the prompt is tokenized:
    a byte-level tokenizer's token covers at least one byte, and a chat
    template adds a few dozen tokens."""
    n = len(prompt.encode("utf-8")) + len((system_prompt or "").encode("utf-8")) + 64 + max_tokens
    return min(n, max_kv_size) if max_kv_size else n


def limit_process(plan) -> None:
    """Make this process keep to the plan's allocator assumptions: MLX keeps
    at most ``plan.mlx_cache_bytes`` of freed buffers, and glibc returns large freed blocks to the system
    (mmap above 1 MiB; at most two malloc arenas, not eight per core, each
    of which keeps freed memory for itself: ~30 MiB less at the same load)."""
    import mlx.core as mx

    mx.set_cache_limit(plan.mlx_cache_bytes)
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD (fixed: no dynamic raise)
        libc.mallopt(-8, 2)  # M_ARENA_MAX
    except (OSError, AttributeError):
        pass  # not glibc


def release_page_cache(model_dir) -> None:
    """Drop the resident weights' pages from the page cache once they are
    loaded: a memory cgroup charges the page cache that reading them caused,
    and the weights are in the process's own memory now."""
    for f in resident_files(model_dir):
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except (OSError, AttributeError):
            pass
        finally:
            os.close(fd)


_FLOAT_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def folder_dtype(model_dir):
    """The floating dtype most of the resident weights' values are stored in
    (a name, e.g. "bfloat16"), or None where no resident file says."""
    counts = {}
    try:
        for f in resident_files(model_dir):
            for t in _safetensors_header(f).values():
                if t.get("dtype") in _FLOATS:
                    n = 1
                    for d in t["shape"]:
                        n *= d
                    counts[t["dtype"]] = counts.get(t["dtype"], 0) + n
    except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error):
        return None  # the folder's own check says what is wrong with it
    return _FLOAT_NAMES[max(counts, key=counts.get)] if counts else None


# --mem-budget auto: the share of the memory available a session plans to
# take; the rest absorbs other programs' growth and this plan's estimates
AUTO_SHARE = 0.8
AUTO_RESERVE = 256 << 20  # left over at least, on a small machine
_NO_LIMIT = 1 << 60  # a cgroup v1 "unlimited" is 2**63 rounded down to a page


def _first_int(path):
    """The first word of a file as bytes (cgroup v2's "max": no limit), or None."""
    try:
        word = Path(path).read_text().split()[0]
    except (OSError, IndexError):
        return None
    if word == "max":
        return _NO_LIMIT
    try:
        return int(word)
    except ValueError:
        return None


def _stat_value(path, key):
    """A ``key value`` line's value in a stat file (0 when absent)."""
    try:
        for line in Path(path).read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == key:
                return int(v)
    except (OSError, ValueError):
        pass
    return 0


def cgroup_room(cgroup="/proc/self/cgroup", root="/sys/fs/cgroup"):
    """(bytes the tightest memory cgroup limit over this process still
    leaves, that cgroup's folder), or None where no limit applies. v2 and
    v1, each cgroup up to the mount's root (a container sees its own cgroup
    there); the inactive file pages count as room, as the kernel reclaims
    them before it fails a charge."""
    try:
        lines = Path(cgroup).read_text().splitlines()
    except OSError:
        return None
    best = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and not controllers:
            bases = [Path(root), Path(root) / "unified"]
            limit, usage, stat, inactive = "memory.max", "memory.current", "memory.stat", "inactive_file"
        elif "memory" in controllers.split(","):
            bases = [Path(root) / "memory"]
            limit, usage, stat, inactive = ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                            "memory.stat", "total_inactive_file")
        else:
            continue
        for base in bases:
            folder = base / path.strip("/")
            if not folder.is_dir():
                folder = base
            while True:
                cap = _first_int(folder / limit)
                used = _first_int(folder / usage)
                if cap is not None and cap < _NO_LIMIT and used is not None:
                    room = max(0, cap - used + _stat_value(folder / stat, inactive))
                    if best is None or room < best[0]:
                        best = (room, str(folder))
                if folder == base or folder.parent == folder:
                    break
                folder = folder.parent
    return best


def _meminfo_available(meminfo):
    """MemAvailable (bytes) from a /proc/meminfo, or None."""
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _darwin_available():
    """macOS: pages free, inactive, speculative and purgeable (vm_stat), as
    the kernel gives them back without swapping."""
    import re
    import subprocess

    try:
        out = subprocess.run(["vm_stat"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"page size of (\d+) bytes", out)
    page = int(m.group(1)) if m else os.sysconf("SC_PAGE_SIZE")
    pages = 0
    for name in ("Pages free", "Pages inactive", "Pages speculative", "Pages purgeable"):
        m = re.search(rf"^{name}:\s+(\d+)", out, re.M)
        pages += int(m.group(1)) if m else 0
    return pages * page if pages else None


def available_memory(meminfo="/proc/meminfo", cgroup="/proc/self/cgroup", root="/sys/fs/cgroup",
                     platform=None):
    """(bytes a session may still take without the machine swapping or an
    OOM killer acting, where the figure comes from): Linux's MemAvailable,
    or less where a memory cgroup's limit leaves less; macOS's reclaimable
    pages. None where nothing says."""
    import sys

    if (platform or sys.platform) == "darwin":
        avail = _darwin_available()
        return (avail, "vm_stat: free, inactive, speculative and purgeable pages") if avail else None
    avail = _meminfo_available(meminfo)
    room = cgroup_room(cgroup, root)
    if room is not None and (avail is None or room[0] < avail):
        return room[0], f"the memory cgroup {room[1]}'s limit"
    return (avail, "MemAvailable") if avail is not None else None


def auto_budget(**where):
    """(the session's memory budget for ``--mem-budget auto``, in words how
    it was sized): ``AUTO_SHARE`` of the memory available, at least
    ``AUTO_RESERVE`` left over; ValueError where the memory available is
    unknown. ``where``: ``available_memory``'s files (tests)."""
    found = available_memory(**where)
    if found is None:
        raise ValueError("--mem-budget auto: this system does not say how much memory is available; "
                         "give a size, e.g. --mem-budget 8G")
    avail, source = found
    budget = max(0, min(int(avail * AUTO_SHARE), avail - AUTO_RESERVE))
    return budget, f"{AUTO_SHARE:.0%} of the {format_size(avail)} available by {source}"
