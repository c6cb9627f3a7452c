"""The router's probabilities added to the session cache's eviction score,
replayed against Belady on recorded router logits.

    scripts/bench/bench_router_score.py --model PREP [--stretches 4] [--span 288] [--logits L.npz]

Records every MoE layer's router logits over teacher-forced stretches of
``heldout.txt`` (the resident model, one forward a stretch), then replays
each layer's calls: a stretch's first 32 tokens as one prefill call, then
one call a token, each routed to its top-k logits. The kept rule (decayed
frequency, best-ranked admission: ``infer.tools.belady.FreqDecayRank``) runs
against the same rule whose score also gains beta × each expert's router
probability at every call, so an expert the router nearly chose counts a
little. docs/benchmarks.md, "The router's probabilities in the score", has
the measured table.

``--foresight 1,2,4,8`` also replays the kept rule told the next N calls
of each layer (an oracle no online rule has): how far ahead a rule would
have to see to come near Belady.
"""

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from infer.tools.belady import FreqDecayRank, belady_layer  # noqa: E402

PROMPT_TOKENS = 32
FRACTIONS = (0.10, 0.25, 0.50)
VARIANTS = [(hl, beta) for hl in (16, 32) for beta in (0, 1, 2, 4, 8)]


class RouterScore(FreqDecayRank):
    """FreqDecayRank whose score also gains ``beta`` × the router's
    probability of every expert at each call (set ``probs`` before
    ``request``)."""

    def __init__(self, capacity, half_life, beta):
        super().__init__(capacity, half_life)
        self.beta = beta
        self.probs = None

    def _count(self, req):
        missing = super()._count(req)
        if self.beta:
            for e, p in enumerate(self.probs):
                if p > 0:
                    self.score[e] = (self._now(e) + self.beta * float(p), self.t)
        return missing


class Foresight(FreqDecayRank):
    """The kept rule told the experts of its layer's next calls (set
    ``soon``: expert -> 1 / calls until its next use): an expert used
    within them outranks every other, the sooner the higher."""

    def __init__(self, capacity, half_life):
        super().__init__(capacity, half_life)
        self.soon = {}

    def _rank(self, e):
        return super()._rank(e) + 1e6 * self.soon.get(e, 0.0)


def record(model_dir, stretches, span):
    """{"s{stretch}_l{layer}": logits [span, experts]} of every MoE layer's
    router over ``stretches`` stretches of heldout.txt."""
    import mlx.core as mx
    import mlx.nn as nn

    from infer.tools.resident import load_resident
    from infer.runtime.loader import cast_model

    model, tok = load_resident(model_dir)[:2]
    cast_model(model, mx.float32)
    seen = {}

    class Recorder(nn.Module):
        def __init__(self, gate, layer):
            super().__init__()
            self.gate, self.layer = gate, layer

        def __call__(self, x):
            y = self.gate(x)
            seen[self.layer] = y
            return y

    for i, layer in enumerate(model.layers):
        mlp = getattr(layer, "mlp", None)
        if hasattr(mlp, "gate") and hasattr(mlp, "switch_mlp"):
            mlp.gate = Recorder(mlp.gate, i)
    if not any(isinstance(getattr(getattr(l, "mlp", None), "gate", None), Recorder)
               for l in model.layers):
        sys.exit("bench_router_score: no layer with a router (mlp.gate) and mlp.switch_mlp")
    ids = tok.encode((Path(model_dir) / "heldout.txt").read_text(), add_special_tokens=False)
    out = {}
    for s in range(stretches):
        start = (s * len(ids) // stretches) % max(len(ids) - span, 1)
        seen.clear()
        model(mx.array(ids[start:start + span])[None])
        for i, y in seen.items():
            out[f"s{s}_l{i}"] = np.array(y[0].astype(mx.float32))
    return out


def calls(logits, top_k):
    """[(experts, probabilities)] of one layer over one stretch: the prompt
    as one call, then one call a token."""
    z = np.exp(logits - logits.max(-1, keepdims=True))
    p = z / z.sum(-1, keepdims=True)
    top = np.argsort(-logits, -1, kind="stable")[:, :top_k]
    out = [(frozenset(top[:PROMPT_TOKENS].ravel().tolist()), p[:PROMPT_TOKENS].sum(0))]
    return out + [(frozenset(top[t].tolist()), p[t]) for t in range(PROMPT_TOKENS, len(p))]


def replay(logits, top_k, capacity, half_life, beta):
    """Misses of RouterScore summed over every recorded (stretch, layer)."""
    misses = 0
    for key in sorted(logits):
        policy = RouterScore(capacity, half_life, beta)
        for req, probs in calls(logits[key], top_k):
            policy.probs = probs
            misses += policy.request(req)
    return misses


def foresight(logits, top_k, capacity, ahead, half_life=16.0):
    """Misses of Foresight seeing ``ahead`` calls, summed like ``replay``."""
    misses = 0
    for key in sorted(logits):
        reqs = [r for r, _ in calls(logits[key], top_k)]
        policy = Foresight(capacity, half_life)
        for t, req in enumerate(reqs):
            policy.soon = {}
            for j in range(min(ahead, len(reqs) - t - 1), 0, -1):  # the soonest use wins
                policy.soon.update(dict.fromkeys(reqs[t + j], 1.0 / j))
            misses += policy.request(req)
    return misses


def table(logits, top_k, variants=VARIANTS, fractions=FRACTIONS):
    """{fraction: {"capacity", "belady", (half_life, beta): misses}}."""
    experts = next(iter(logits.values())).shape[-1]
    rows = {}
    for frac in fractions:
        cap = int(experts * frac)
        row = {"capacity": cap,
               "belady": sum(belady_layer([r for r, _ in calls(logits[k], top_k)], cap)
                             for k in sorted(logits))}
        for hl, beta in variants:
            row[(hl, beta)] = replay(logits, top_k, cap, hl, beta)
        rows[frac] = row
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="prep folder (with heldout.txt)")
    p.add_argument("--stretches", type=int, default=4)
    p.add_argument("--span", type=int, default=288, help="tokens a stretch (the first 32 a prompt)")
    p.add_argument("--logits", type=Path, help="reuse (or save) the recorded logits here (.npz)")
    p.add_argument("--foresight", default="", help="also the kept rule told the next N calls, "
                   "for each N of this comma-separated list")
    args = p.parse_args(argv)
    if args.span <= PROMPT_TOKENS:
        p.error(f"--span must be more than {PROMPT_TOKENS}")
    try:
        ahead = [int(n) for n in args.foresight.split(",") if n]
    except ValueError:
        p.error(f"--foresight: a comma-separated list of call counts, not {args.foresight!r}")

    import json
    top_k = json.loads((Path(args.model) / "config.json").read_text())["num_experts_per_tok"]
    if args.logits and args.logits.exists():
        logits = dict(np.load(args.logits))
    else:
        logits = record(args.model, args.stretches, args.span)
        if args.logits:  # whole or not at all
            part = args.logits.with_name(args.logits.name + ".part")
            with open(part, "wb") as f:
                np.savez(f, **logits)
            part.replace(args.logits)
    rows = table(logits, top_k)
    print("| cache | experts/layer | Belady | " + " | ".join(
        f"hl {hl}, β {beta}" for hl, beta in VARIANTS) + " |")
    print("|" + "---|" * (3 + len(VARIANTS)))
    for frac, row in rows.items():
        cells = [f"{row[v]} ({row[v] / max(row['belady'], 1):.3f}×)" for v in VARIANTS]
        print(f"| {frac:.0%} | {row['capacity']} | {row['belady']} | " + " | ".join(cells) + " |")

    if ahead:
        print("\n| cache | Belady | " + " | ".join(f"told {n} calls ahead" for n in ahead) + " |")
        print("|" + "---|" * (2 + len(ahead)))
        for frac, row in rows.items():
            cells = []
            for n in ahead:
                m = foresight(logits, top_k, row["capacity"], n)
                cells.append(f"{m} ({m / max(row['belady'], 1):.3f}×)")
            print(f"| {frac:.0%} | {row['belady']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
