"""`infer routing --trace FILE`: a recorded routing trace (``infer.tools.trace``)
replayed through the session cache, beside other policies, and the
predictors that need no hidden state scored on it.

The cache is the session's: one stack per MoE layer, capacities from the
runtime's own split of the budget (``infer.runtime.budget.split_cache``:
even, no calibration), every call of a layer one request of the experts it
needs (a prompt's tokens in mlx-lm's prefill calls). A budget is a fraction
of all experts of all layers (records of equal size; with ``--model``, of
its records' bytes, split as ``infer bench --budget`` splits them), and
every session starts from a cold cache. Policies (``--policies`` also takes
``infer.tools.belady``'s other rules):

- ``runtime``: ``infer.runtime.placement.Placement`` driven as
  ``ExpertStore.gather`` drives it (tick, touch the hits, assign the misses);
- ``lru``, ``lfu``: ``infer.tools.belady``'s (LFU counts every use since the
  start; ties to the least recent);
- ``belady``: the offline optimum with bypass, decode misses only
  (``belady_requests``): a bound on every policy here;
- ``oracle1``: the runtime's rule told the experts its layer's next call
  uses (``belady.ToldNext``), what a perfect next-token predictor could give
  the eviction rule.

Figures are decode only: ``hit`` is 1 - decode misses / decode expert
uses, ``mb_per_token`` the decode misses' records (MB, 10^6 bytes) over the
decode tokens. The record size: ``--record-mb``, else ``--model``'s manifest
(mean record bytes), else ``KNOWN_SHAPES`` by the trace's (MoE layers,
experts), else the size the trace file gives (its own engine's format), else
unknown.

Predictors of a decode token's experts at a layer, from the session's
routing so far, at the breadth the prefetcher reads (``k``: the runtime's
``temporal`` guess is the layer's last one-token call, k experts) and ``2k``:
``previous`` (most recent first: the previous token's, then older),
``decayed`` (decayed use count, the cache's half-life), ``cooc_time``
(sum over the layer's previous-token experts f of P(e | f) one token
later), ``cooc_layer`` (sum over the previous MoE call's experts f, the
layer before in the same token or the last layer of the previous token,
of P(e | f) there); the co-occurrence counts are learned online from the
session's tokens, prompt included where the trace has them per token, and
ties go to ``decayed``.
"""

import json
import math
import sys
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List

import numpy as np

from infer.runtime.budget import split_cache
from infer.runtime.placement import HALF_LIFE, Placement
from infer.tools import belady
from infer.tools.belady import LFU, LRU, ToldNext, belady_requests
from infer.tools.trace import Trace, TraceError

POLICIES = ("runtime", "lru", "lfu", "belady", "oracle1")
PREDICTORS = ("previous", "decayed", "cooc_time", "cooc_layer")
DEFAULT_BUDGETS = "0.1,0.25,0.4"


def _mlx4(hidden, inter):
    """One expert's gate, up and down projections at 4-bit affine, group 64
    (bf16 scales and biases: 4.5 bits a weight), as ``infer prep`` stores them."""
    return 3 * hidden * inter * 9 // 16


def _mxfp4(hidden, inter):
    """gpt-oss's own mxfp4 (4 bits, a uint8 scale per 32: 4.25 bits a weight)
    and its bf16 projection biases."""
    return 3 * hidden * inter * 17 // 32 + 3 * inter * 2


# (MoE layers, experts a layer) -> (model, record bytes)
KNOWN_SHAPES = {
    (48, 128): ("Qwen3-30B-A3B, 4-bit", _mlx4(2048, 768)),
    (48, 512): ("Qwen3-Next-80B-A3B, 4-bit", _mlx4(2048, 512)),
    (94, 128): ("Qwen3-235B-A22B, 4-bit", _mlx4(4096, 1536)),
    (32, 8): ("Mixtral-8x7B, 4-bit", _mlx4(4096, 14336)),
    (56, 8): ("Mixtral-8x22B, 4-bit", _mlx4(6144, 16384)),
    (36, 128): ("gpt-oss-120b, mxfp4", _mxfp4(2880, 2880)),
    (24, 32): ("gpt-oss-20b, mxfp4", _mxfp4(2880, 2880)),
}


def parse_budgets(text: str) -> List[str]:
    """The budgets as written, each a fraction in (0, 1]."""
    out = []
    for b in (s.strip() for s in text.split(",")):
        try:
            f = Fraction(b)
        except (ValueError, ZeroDivisionError):
            raise TraceError(f"--budgets: {b!r} is not a number") from None
        if not 0 < f <= 1:
            raise TraceError(f"--budgets: {b} is not in (0, 1]")
        if b not in out:
            out.append(b)
    return out


def capacities(trace: Trace, budget: str) -> Dict[int, int]:
    """{layer: positions}: the runtime's split of ``budget`` of all experts;
    with a model's layouts (``check_model``) in bytes, as ``infer bench
    --budget`` gives the store (records of their stride, split over records
    of their size), else in records."""
    if trace.layouts:
        layouts = [SimpleNamespace(layer=l, num_experts=x.num_experts, record_bytes=x.record_bytes)
                   for l, x in trace.layouts.items()]
        total = sum(x.stride * x.num_experts for x in trace.layouts.values())
        return split_cache(layouts, int(total * float(Fraction(budget))))
    layouts = [SimpleNamespace(layer=l, num_experts=trace.num_experts, record_bytes=1) for l in trace.layers]
    return split_cache(layouts, int(Fraction(budget) * trace.num_experts * len(layouts)))


def record_size(trace: Trace, record_mb=None, manifest=None, model=None):
    """(MB a record, what says so): see the module's docstring."""
    if record_mb is not None:
        return record_mb, "--record-mb"
    if manifest is not None:
        sizes = [l.record_bytes for l in manifest.layers if not l.module.startswith("mtp.")]
        return sum(sizes) / len(sizes) / 1e6, f"manifest of {model} (mean record bytes)"
    known = KNOWN_SHAPES.get((len(trace.layers), trace.num_experts))
    if known is not None:
        return known[1] / 1e6, f"{known[0]} shape ({len(trace.layers)} MoE layers x {trace.num_experts} experts)"
    if trace.record_bytes:
        return trace.record_bytes / 1e6, "the trace's expert_bytes (its engine's format)"
    return None, "unknown (give --record-mb)"


# --- the cache -----------------------------------------------------------------------------------


def _runtime(requests, counted, num_experts, cap):
    """Misses per request of the runtime's rule, driven as ExpertStore.gather does."""
    p = Placement(num_experts, cap)
    out = []
    for req in requests:
        p.tick()
        wanted = sorted(req)
        missing = [e for e in wanted if e not in p]
        for e in wanted:
            if e in p:
                p.touch(e)
        if missing:
            p.assign(missing, set(wanted))
        out.append(len(missing))
    return out


def _online(make):
    def run(requests, counted, num_experts, cap):
        p = make(cap)
        return [p.request(r) for r in requests]
    return run


def _belady(requests, counted, num_experts, cap):
    return belady_requests(requests, cap, counted)


def _oracle1(requests, counted, num_experts, cap):
    p = ToldNext(cap, HALF_LIFE)
    out = []
    for i, r in enumerate(requests):
        p.soon = requests[i + 1] if i + 1 < len(requests) else frozenset()
        out.append(p.request(r))
    return out


DRIVERS = {"runtime": _runtime, "lru": _online(LRU), "lfu": _online(LFU), "belady": _belady,
           "oracle1": _oracle1}


def policy_names() -> List[str]:
    """What ``--policies`` takes: ``POLICIES`` and ``infer.tools.belady``'s other rules."""
    return list(POLICIES) + [p for p in belady.POLICIES if p not in POLICIES]


def parse_policies(text: str) -> List[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    known = policy_names()
    for p in names:
        if p not in known:
            raise TraceError(f"--policies: {p!r} is none of {','.join(known)}")
    if not names:
        raise TraceError("--policies: none named")
    return list(dict.fromkeys(names))


def driver(name):
    return DRIVERS[name] if name in DRIVERS else _online(belady.POLICIES[name])


def layer_requests(trace: Trace):
    """[(layer, requests, counted)] of every session: each layer's calls in order."""
    out = []
    for session in trace.sessions:
        for layer in trace.layers:
            calls = [c for c in session if layer in c.wanted]
            if calls:
                out.append((layer, [c.wanted[layer] for c in calls], [c.decode for c in calls]))
    return out


def count_misses(trace: Trace, drive, capacity: Dict[int, int], seqs=None):
    """(decode misses, all misses) of a policy's driver with ``capacity`` per layer."""
    decode = total = 0
    for layer, reqs, counted in seqs or layer_requests(trace):
        per = drive(reqs, counted, trace.num_experts, capacity[layer])
        decode += sum(m for m, c in zip(per, counted) if c)
        total += sum(per)
    return decode, total


def replay(trace: Trace, budgets, record_mb=None, drivers=None) -> dict:
    """{policy: {budget: {"hit", "mb_per_token", "misses"}}}, decode only;
    ``drivers``: {name: driver} (default ``POLICIES``')."""
    drivers = drivers or {p: DRIVERS[p] for p in POLICIES}
    seqs = layer_requests(trace)
    uses = sum(len(r) for _, reqs, counted in seqs for r, c in zip(reqs, counted) if c)
    tokens = trace.decode_tokens
    out = {name: {} for name in drivers}
    for budget in budgets:
        cap = capacities(trace, budget)
        for name, drive in drivers.items():
            misses = count_misses(trace, drive, cap, seqs)[0]
            out[name][budget] = {
                "hit": 1 - misses / uses,
                "mb_per_token": misses * record_mb / tokens if record_mb is not None else None,
                "misses": misses,
            }
    return out


# --- the predictors ------------------------------------------------------------------------------


class _Layer:
    """What a layer's routing so far says about its next token."""

    def __init__(self, n):
        self.decay = 0.5 ** (1.0 / HALF_LIFE)
        self.score = np.zeros(n)  # decayed use count
        self.stamp = np.full(n, -1.0)  # recency: higher is more recent
        self.time = np.zeros((n, n))  # [f, e]: f at the previous token, e at this one
        self.time_n = np.zeros(n)
        self.cross = np.zeros((n, n))  # [f, e]: f at the previous MoE call, e here
        self.cross_n = np.zeros(n)
        self.prev = None  # this layer's experts at its previous token
        self.rows = 0

    def ranked(self, name, source):
        """Experts best first (those the layer has used, and those co-occurrence names)."""
        if name == "previous":
            key = [self.stamp]
        else:
            key = [self.score, self.stamp]
            if name == "cooc_time" and self.prev is not None:
                key.insert(0, self._vote(self.time, self.time_n, self.prev))
            elif name == "cooc_layer" and source is not None:
                key.insert(0, self._vote(self.cross, self.cross_n, source))
        known = (self.stamp >= 0) | (key[0] > 0)
        order = np.lexsort([-k for k in reversed(key)])
        return [int(e) for e in order if known[e]]

    @staticmethod
    def _vote(counts, n, source):
        src = list(source)
        return (counts[src] / np.maximum(n[src], 1)[:, None]).sum(0)

    def update(self, row, source):
        k = len(row)
        self.score *= self.decay
        for slot, e in enumerate(row):
            self.score[e] += 1.0
            self.stamp[e] = self.rows * (k + 1) + (k - slot)  # router order within a token
        self.rows += 1
        if self.prev is not None:
            self.time[np.ix_(list(self.prev), list(row))] += 1
            self.time_n[list(self.prev)] += 1
        if source is not None:
            self.cross[np.ix_(list(source), list(row))] += 1
            self.cross_n[list(source)] += 1
        self.prev = tuple(row)


def score_predictors(trace: Trace) -> dict:
    """{predictor: {"k"|"2k": {"breadth", "recall", "precision"}}} over the decode tokens."""
    k = trace.top_k
    breadths = {"k": k, "2k": 2 * k}
    hit = {(p, b): 0 for p in PREDICTORS for b in breadths}
    guessed = dict.fromkeys(hit, 0)
    actual = 0
    for session in trace.sessions:
        state = {l: _Layer(trace.num_experts) for l in trace.layers}
        last = None  # the previous MoE call's experts, in execution order
        for call in session:
            for tok in call.tokens:
                for layer in sorted(tok):
                    row, st = tok[layer], state[layer]
                    if call.decode:
                        want = set(row)
                        actual += len(want)
                        for p in PREDICTORS:
                            order = st.ranked(p, last)
                            for b, n in breadths.items():
                                g = order[:n]
                                hit[(p, b)] += len(want.intersection(g))
                                guessed[(p, b)] += len(g)
                    st.update(row, last)
                    last = row
            if not call.tokens:
                last = None  # a prompt not recorded per token
    out = {}
    for p in PREDICTORS:
        out[p] = {b: {"breadth": n, "recall": hit[(p, b)] / max(actual, 1),
                      "precision": hit[(p, b)] / guessed[(p, b)] if guessed[(p, b)] else 0.0}
                  for b, n in breadths.items()}
    return out


# --- the report ----------------------------------------------------------------------------------


def report(trace: Trace, budgets, record_mb=None, record_source=None, policies=POLICIES) -> dict:
    policies = replay(trace, budgets, record_mb, {p: driver(p) for p in policies})
    return {
        "trace": {"path": trace.path, "format": trace.format, "sha256": trace.sha256, "model": trace.model,
                  "sessions": len(trace.sessions), "moe_layers": len(trace.layers),
                  "num_experts": trace.num_experts, "top_k": trace.top_k,
                  "prefill_calls": trace.prefill_calls, "prefill_tokens": trace.prefill_tokens,
                  "decode_tokens": trace.decode_tokens},
        "record": {"mb": record_mb, "source": record_source},
        "budgets": {b: {"experts_per_layer": sorted(set(capacities(trace, b).values()))} for b in budgets},
        "policies": policies,
        "predictors": score_predictors(trace),
    }


def format_report(rep: dict) -> str:
    t, r = rep["trace"], rep["record"]
    if not t["prefill_calls"]:
        prompt = "no prefill"
    else:
        prompt = (f"{t['prefill_tokens']} prefill tokens" if t["prefill_tokens"] is not None else "a prompt") \
            + f" in {t['prefill_calls']} call(s)"
    lines = [
        f"{Path(t['path']).name} ({t['format']}): {t['sessions']} session(s), {t['moe_layers']} MoE layers x "
        f"{t['num_experts']} experts, top-{t['top_k']}; {prompt}, {t['decode_tokens']} decode tokens",
        f"record {r['mb']:.3f} MB: {r['source']}" if r["mb"] is not None else f"record size {r['source']}",
        "decode hit rate / MB read per token",
    ]
    pol = rep["policies"]
    ratio = "runtime" in pol and "belady" in pol
    lines.append(f"{'budget':>7} {'experts/layer':>13}  " + "  ".join(f"{p:>14}" for p in pol)
                 + ("  runtime/belady" if ratio else ""))
    for b, info in rep["budgets"].items():
        cells = [f"{pol[p][b]['hit']:.3f} {_mb(pol[p][b]['mb_per_token']):>8}" for p in pol]
        caps = "/".join(str(c) for c in info["experts_per_layer"])
        line = f"{b:>7} {caps:>13}  " + "  ".join(f"{c:>14}" for c in cells)
        if ratio:
            bel = pol["belady"][b]["hit"]
            line += f"  {pol['runtime'][b]['hit'] / bel if bel else math.nan:>14.3f}"
        lines.append(line)
    lines.append("predictors, decode (recall / precision at breadth k and 2k)")
    for p, by in rep["predictors"].items():
        lines.append(f"{p:>11}: " + "  ".join(
            f"{b}={v['breadth']} {v['recall']:.3f} / {v['precision']:.3f}" for b, v in by.items()))
    return "\n".join(lines)


def _mb(v) -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}" if v >= 1 else f"{v:.3g}"


def plot(rep: dict, path: Path, format=None):
    """Decode hit rate and MB read per token against the budget, a line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = list(rep["budgets"])
    xs = [float(Fraction(b)) for b in budgets]
    with_mb = rep["record"]["mb"] is not None
    fig, axes = plt.subplots(1, 2 if with_mb else 1, figsize=(10 if with_mb else 5.5, 4), dpi=120, squeeze=False)
    styles = {"runtime": "o-", "lru": "v-", "lfu": "^-", "belady": "s--", "oracle1": "d:"}
    for p, v in rep["policies"].items():
        axes[0][0].plot(xs, [v[b]["hit"] for b in budgets], styles.get(p, "x-."), label=p)
        if with_mb:
            axes[0][1].plot(xs, [v[b]["mb_per_token"] for b in budgets], styles.get(p, "x-."), label=p)
    axes[0][0].set_ylabel("decode hit rate")
    axes[0][0].set_ylim(0, 1)
    if with_mb:
        axes[0][1].set_ylabel("decode MB read per token")
        axes[0][1].set_ylim(bottom=0)
    for ax in axes[0]:
        ax.set_xlabel("cache (share of all experts)")
        ax.set_xticks(xs, budgets)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    t = rep["trace"]
    fig.suptitle(f"{Path(t['path']).name}: {t['decode_tokens']} decode tokens, {t['moe_layers']} layers x "
                 f"{t['num_experts']} experts, top-{t['top_k']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, format=format)
    plt.close(fig)


def to_json(rep: dict) -> str:
    return json.dumps(rep, indent=1) + "\n"


def check_model(trace: Trace, manifest) -> None:
    """TraceError unless the manifest's layers fit the trace's; the trace's
    layers then take the model's layouts, in order."""
    layers = [l for l in manifest.layers if not l.module.startswith("mtp.")]
    experts = {l.num_experts for l in layers}
    if len(layers) != len(trace.layers) or len(experts) != 1 or max(experts) < trace.num_experts:
        raise TraceError(f"the model has {len(layers)} MoE layers x {sorted(experts)} experts, the trace "
                         f"{len(trace.layers)} x {trace.num_experts}")
    trace.num_experts = max(experts)
    trace.layouts = dict(zip(trace.layers, sorted(layers, key=lambda l: l.layer)))


def main_trace(a, fail, write_atomic) -> int:
    """``infer routing --trace``: ``a`` as routing.main parsed it."""
    from infer.tools import trace as traces

    manifest = None
    try:
        budgets = parse_budgets(a.budgets)
        policies = parse_policies(a.policies or ",".join(POLICIES))
        if a.record_mb is not None and not (a.record_mb > 0 and math.isfinite(a.record_mb)):
            raise TraceError(f"--record-mb {a.record_mb} must be a positive size")
        t = traces.read(a.trace)
        if a.model is not None:
            from shared.blob import Manifest, ManifestError

            if not (a.model / "manifest.json").is_file():
                raise TraceError(f"--model {a.model}: not a prep folder (no manifest.json)")
            try:
                manifest = Manifest.load(a.model)
            except (ManifestError, ValueError, OSError) as e:
                raise TraceError(f"--model {a.model}: {e}") from None
            check_model(t, manifest)
    except TraceError as e:
        return fail(str(e))
    mb, source = record_size(t, a.record_mb, manifest, a.model)
    rep = report(t, budgets, mb, source, policies)
    print(format_report(rep))
    try:
        if a.json:
            write_atomic(a.json, lambda tmp: tmp.write_text(to_json(rep)))
        if a.plot:
            write_atomic(a.plot, lambda tmp: plot(rep, tmp, a.plot.suffix[1:].lower() or "png"))
    except OSError as e:
        print(f"infer routing: cannot write the report ({e})", file=sys.stderr)
        return 1
    return 0
