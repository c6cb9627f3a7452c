"""`infer routing`: routing statistics of an MoE model folder over a text
(``--trace FILE``: a recorded trace replayed instead, ``infer.tools.replay``).

The text is fed causally with a KV cache, in chunks; the model runs
unchanged. Per MoE layer: the routed experts of each token (recorded where
the expert module is called), and the guesses of each predictor for the next
layers. From those: experts used, load imbalance, next-token reuse, LRU and
Belady hit rates against cache size (each token one request of its k
experts, per-layer caches as the session's layer stacks), and each
predictor's recall and precision per depth.

Predictors are functions in ``PREDICTORS``: ``(capture, target) -> scores``
(or ids) for the target layer from what the source layer saw; add one there
and every report has it. ``moe_input`` is what prefetch does today
(``Prefetcher.predict``): layer L+d's router applied to layer L's MoE-block
input. ``pre_attention`` applies layer L+d's router, after its own
post-attention norm, to the residual stream entering layer L (depth 0 is
then a guess of layer L's own experts before its attention has run).

``temporal`` guesses the experts layer L+d used for the previous token.
With a calibration (``--calibrate TEXT`` fits one first, ``--calibration
FILE`` reads one; a prep folder's own ``predict.npz`` is used when present,
see ``infer.runtime.predict``) two more: ``linear``, the fitted map from layer L's
MoE-block input to layer L+d's router logits, and ``combined``, per layer
and depth the predictor and breadth the calibration chose (it may guess
more than k experts: recall rises, precision falls).

A prep folder can be given too: its experts are read from the blobs in this
process, and the figures are the same as for the source folder.
"""

import argparse
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import mlx.core as mx
import numpy as np

from shared.paths import check_out

from infer.runtime import predict
from infer.args import write_atomic
from infer.runtime.taps import MoELayer, RoutingError, expert_paths, install  # noqa: F401
from infer.tools import replay
from infer.tools.belady import LRU, belady_layer
from infer.tools.replay import DEFAULT_BUDGETS

DEPTHS = (1, 2, 3)
CACHE_FRACTIONS = (0.03125, 0.0625, 0.125, 0.25, 0.375, 0.5, 0.75)
SUMMARY_FRACTIONS = ("0.125", "0.25", "0.5")
DEFAULT_TOKENS = 2048
CHUNK = 256


class ModelLoadError(RoutingError):
    pass


def _moe_input(src: MoELayer, dst: MoELayer, cal):
    return dst.router(src.x)


def _pre_attention(src: MoELayer, dst: MoELayer, cal):
    if src.residual is None or dst.norm is None:
        return None
    return dst.router(dst.norm(src.residual))


def _temporal(src: MoELayer, dst: MoELayer, cal):
    return (mx.array(predict.previous(dst.ids)),)


def _linear(src: MoELayer, dst: MoELayer, cal):
    wb = cal.maps.get((src.module, dst.module)) if cal else None
    return None if wb is None else predict.linear_scores(src.x, mx.array(wb[0]), mx.array(wb[1]))


def _combined(src: MoELayer, dst: MoELayer, cal):
    choice = cal.choice.get((src.module, dst.index - src.index)) if cal else None
    if choice is None:
        return None
    name, breadth = choice
    scores = PREDICTORS[{"router": "moe_input"}.get(name, name)][0](src, dst, cal)
    return scores if isinstance(scores, tuple) else (predict.ranked(scores, breadth),)


# name -> (predictor, depths it is scored at); a predictor returns scores
# (top k is its guess), a tuple whose first item is its guess, or None
PREDICTORS: Dict[str, tuple] = {
    "moe_input": (_moe_input, DEPTHS),
    "pre_attention": (_pre_attention, (0,) + DEPTHS),
    "temporal": (_temporal, DEPTHS),
    "linear": (_linear, DEPTHS),
    "combined": (_combined, DEPTHS),
}
DEFAULT_PREDICTOR = "moe_input"


def top_k_ids(scores, k: int) -> mx.array:
    """The k experts a router's output picks (as Prefetcher.predict does)."""
    if isinstance(scores, tuple):  # routers that select, e.g. DeepSeek's
        return scores[0]
    return mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]


# --- statistics ---------------------------------------------------------------------------------


@dataclass
class Counts:
    hit: int = 0  # true positives
    predicted: int = 0
    actual: int = 0

    def add(self, guess: np.ndarray, actual: np.ndarray):
        for g, a in zip(guess, actual):
            g, a = set(g.tolist()), set(a.tolist())
            self.hit += len(g & a)
            self.predicted += len(g)
            self.actual += len(a)

    def scores(self) -> dict:
        return {"recall": self.hit / max(self.actual, 1), "precision": self.hit / max(self.predicted, 1)}


def _predict(layers: List[MoELayer], counts, pending, cal=None):
    """Score this chunk's guesses of every predictor at every depth."""
    for src in layers:
        for name, (fn, depths) in PREDICTORS.items():
            for d in depths:
                if src.index + d >= len(layers):
                    continue
                dst = layers[src.index + d]
                scores = fn(src, dst, cal)
                if scores is None:
                    continue
                k = dst.top_k or int(dst.ids[-1].shape[-1])
                pending.append(((name, d, src.index), top_k_ids(scores, k), dst))
    mx.eval([p[1] for p in pending])
    for (name, d, i), guess, dst in pending:
        counts.setdefault((name, d), {}).setdefault(i, Counts()).add(np.array(guess), np.array(dst.ids[-1]))
    pending.clear()


def route(model, tokens: List[int], experts: Optional[Dict[str, int]] = None, chunk: int = CHUNK,
          layers: Optional[List[MoELayer]] = None, cal=None):
    """Feed ``tokens`` and collect (layers, counts): the routed ids of every
    MoE layer and the predictors' (name, depth) -> {source layer: Counts}.
    ``layers``: already installed (``install``); ``cal``: an
    ``infer.runtime.predict.Calibration`` for the predictors that need one."""
    from mlx_lm.models.cache import make_prompt_cache

    layers = install(model, experts) if layers is None else layers
    if not layers:
        raise RoutingError("the model has no MoE layers")
    for layer in layers:
        layer.ids = []
    cache = make_prompt_cache(model)
    counts, pending = {}, []
    for i in range(0, len(tokens), chunk):
        for layer in layers:
            layer.x = layer.residual = None
        mx.eval(model(mx.array([tokens[i : i + chunk]]), cache=cache))
        for layer in layers:
            layer.ids[-1] = np.array(layer.ids[-1])
        _predict(layers, counts, pending, cal)
    for layer in layers:
        layer.x = layer.residual = None
    return layers, counts


def reuse(ids: np.ndarray) -> float:
    """Mean share of a token's experts that the previous token also used."""
    if len(ids) < 2:
        return 0.0
    k = ids.shape[1]
    return float(np.mean([len(set(a.tolist()) & set(b.tolist())) / k for a, b in zip(ids[:-1], ids[1:])]))


def hit_rates(ids: np.ndarray, num_experts: int, fractions=CACHE_FRACTIONS):
    """({fraction: LRU hit rate}, {fraction: Belady hit rate}), one request per token."""
    requests = [frozenset(r.tolist()) for r in ids]
    total = sum(len(r) for r in requests)
    lru, opt = {}, {}
    for f in fractions:
        cap = max(1, round(f * num_experts))
        policy = LRU(cap)
        misses = sum(policy.request(r) for r in requests)
        lru[f] = 1 - misses / max(total, 1)
        opt[f] = 1 - belady_layer(requests, cap) / max(total, 1)
    return lru, opt


def layer_stats(layer: MoELayer, counts) -> dict:
    ids = layer.routed()
    E = layer.num_experts
    load = np.bincount(ids.reshape(-1), minlength=E)
    mean = ids.size / E
    lru, opt = hit_rates(ids, E)
    look = {}
    for (name, d), per_src in sorted(counts.items()):
        if layer.index in per_src:
            look.setdefault(name, {})[str(d)] = per_src[layer.index].scores()
    return {
        "layer": layer.index,
        "module": layer.module,
        "num_experts": E,
        "top_k": int(ids.shape[1]),
        "tokens": int(len(ids)),
        "experts_used": int((load > 0).sum()),
        "max_load_ratio": float(load.max() / mean) if mean else 0.0,
        "next_token_reuse": reuse(ids),
        "lru_hit": {_key(f): v for f, v in lru.items()},
        "belady_hit": {_key(f): v for f, v in opt.items()},
        "lookahead": look,  # predictor -> depth -> scores of this layer's guesses
    }


def _key(f: float) -> str:
    return f"{f:g}"


def summarize(layers: List[MoELayer], counts) -> dict:
    """The report: ``summary`` (pooled over layers) and per-layer ``layers``."""
    per = [layer_stats(layer, counts) for layer in layers]
    predictors = {}
    for (name, d), per_src in sorted(counts.items()):
        total = Counts()
        for c in per_src.values():
            total.hit, total.predicted, total.actual = total.hit + c.hit, total.predicted + c.predicted, total.actual + c.actual
        predictors.setdefault(name, {})[str(d)] = total.scores()
    default = predictors.get(DEFAULT_PREDICTOR, {})
    mean = lambda key, f: float(np.mean([p[key][f] for p in per]))
    summary = {
        "tokens": per[0]["tokens"],
        "moe_layers": len(per),
        "num_experts": per[0]["num_experts"],
        "top_k": per[0]["top_k"],
        "lookahead_recall": {str(d): default[str(d)]["recall"] for d in DEPTHS if str(d) in default},
        "lookahead_precision": {str(d): default[str(d)]["precision"] for d in DEPTHS if str(d) in default},
        "next_token_reuse": float(np.mean([p["next_token_reuse"] for p in per])),
        "max_load_ratio": max(p["max_load_ratio"] for p in per),
        "experts_used": float(np.mean([p["experts_used"] / p["num_experts"] for p in per])),
        "lru_hit": {f: mean("lru_hit", f) for f in SUMMARY_FRACTIONS},
        "belady_hit": {f: mean("belady_hit", f) for f in SUMMARY_FRACTIONS},
        "curve": {
            "fractions": list(CACHE_FRACTIONS),
            "lru": [mean("lru_hit", _key(f)) for f in CACHE_FRACTIONS],
            "belady": [mean("belady_hit", _key(f)) for f in CACHE_FRACTIONS],
        },
        "predictors": predictors,
    }
    return {"summary": summary, "layers": per}


# --- the command --------------------------------------------------------------------------------


def load(folder: Path):
    """(model, tokenizer, experts): an mlx-lm folder, or a prep folder whose
    experts are read from its blobs (``experts``: module -> number of experts)."""
    import mlx_lm

    if (folder / "manifest.json").is_file():
        from iod.inproc import InprocSource

        from infer.runtime.loader import load_streaming

        model, tokenizer, store = load_streaming(folder, InprocSource(folder))
        experts = {l.module: l.num_experts for l in store.manifest.layers if not l.module.startswith("mtp.")}
        return model, tokenizer, experts
    model, tokenizer = mlx_lm.load(str(folder))
    return model, tokenizer, None


def default_text() -> Path:
    from infer.data import CORPUS

    return CORPUS


def report(folder, text_path=None, n_tokens=DEFAULT_TOKENS, calibrate=None, calibration=None) -> dict:
    """The routing report of a model folder over the first ``n_tokens`` of a
    text. ``calibrate``: a text to fit a calibration on first; else
    ``calibration``: a calibration file; else a prep folder's own, if any."""
    folder = Path(folder)
    text_path = Path(text_path) if text_path else default_text()
    # a calibration file is read before the model: a bad one fails at once
    cal = None if calibrate is not None else load_calibration(calibration or folder)
    try:
        model, tokenizer, experts = load(folder)
    except Exception as e:  # mlx-lm raises many kinds on folders it cannot load
        raise ModelLoadError(f"cannot load {folder} ({type(e).__name__}: {e})") from None
    data = text_path.read_bytes()
    tokens = tokenizer.encode(data.decode("utf-8"))[:n_tokens]
    if len(tokens) < 2:
        raise RoutingError(f"{text_path} gives fewer than 2 tokens")
    layers = install(model, experts)
    if not layers:
        raise RoutingError("the model has no MoE layers")
    if calibrate is not None:
        cal_data = Path(calibrate).read_bytes()
        cal_tokens = tokenizer.encode(cal_data.decode("utf-8"))[:predict.DEFAULT_TOKENS]
        if len(cal_tokens) < 8:
            raise RoutingError(f"--calibrate {calibrate} gives fewer than 8 tokens")
        from infer.prep.calibrate import fit

        cal = fit(model, layers, cal_tokens)
        cal.text.update({"path": str(calibrate), "sha256": hashlib.sha256(cal_data).hexdigest()})
    layers, counts = route(model, tokens, layers=layers, cal=cal)
    out = summarize(layers, counts)
    out["model"] = str(folder)
    out["text"] = {"path": str(text_path), "sha256": hashlib.sha256(data).hexdigest(), "tokens": len(tokens)}
    if cal is not None:
        out["calibration"] = {**cal.text, "choice": {f"{s} d{d}": list(c) for (s, d), c in cal.choice.items()}}
    return out


def load_calibration(path: Path):
    """``predict.Calibration.load``, its failures on a file that is not one a RoutingError."""
    try:
        return predict.Calibration.load(path)
    except predict.CalibrationError as e:
        raise RoutingError(str(e)) from None


def format_report(rep: dict) -> str:
    s = rep["summary"]
    fr = SUMMARY_FRACTIONS
    lines = [f"{'layer':>5} {'used':>9} {'max/mean':>8} {'reuse':>6}  "
             f"{'LRU ' + ' '.join(fr):>22}  {'Belady ' + ' '.join(fr):>25}  recall@1..3"]
    for p in rep["layers"]:
        look = p["lookahead"].get(DEFAULT_PREDICTOR, {})
        rec = " ".join(f"{look[str(d)]['recall']:.2f}" if str(d) in look else "   -" for d in DEPTHS)
        lru = " ".join(f"{p['lru_hit'][f]:.3f}" for f in fr)
        opt = " ".join(f"{p['belady_hit'][f]:.3f}" for f in fr)
        lines.append(
            f"{p['layer']:>5} {p['experts_used']:>4}/{p['num_experts']:<4} {p['max_load_ratio']:>8.2f} "
            f"{p['next_token_reuse']:>6.2f}  {lru:>22}  {opt:>25}  {rec}"
        )
    lines.append(
        f"{s['moe_layers']} MoE layers, {s['tokens']} tokens, {s['num_experts']} experts top-{s['top_k']}: "
        f"next-token reuse {s['next_token_reuse']:.3f}, max load {s['max_load_ratio']:.2f}x mean, "
        f"experts used {s['experts_used'] * 100:.1f}%"
    )
    lines.append("cache of a layer's experts " + "  ".join(
        f"{f}: LRU {s['lru_hit'][f]:.3f} Belady {s['belady_hit'][f]:.3f}" for f in fr))
    for name, by_depth in s["predictors"].items():
        lines.append(f"{name:>14}: " + "  ".join(
            f"d{d} recall {v['recall']:.3f} precision {v['precision']:.3f}" for d, v in by_depth.items()))
    return "\n".join(lines)


def plot(rep: dict, path: Path, format=None):
    """Hit rate against cache size (share of a layer's experts): LRU and Belady.
    ``format``: the file's (default: from ``path``'s suffix)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = rep["summary"]
    c = s["curve"]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    ax.plot(c["fractions"], c["lru"], "o-", label="LRU")
    ax.plot(c["fractions"], c["belady"], "s--", label="Belady (optimal)")
    for p in rep["layers"]:
        ax.plot(c["fractions"], [p["lru_hit"][_key(f)] for f in c["fractions"]], "-", color="C0", alpha=0.15, lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(c["fractions"], [_fraction_label(f) for f in c["fractions"]])
    ax.set_xlabel("cache size (share of each layer's experts)")
    ax.set_ylabel("hit rate (one request per token)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(f"{Path(rep['model']).name}: {s['tokens']} tokens, {s['num_experts']} experts top-{s['top_k']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, format=format)
    plt.close(fig)


def _fraction_label(f: float) -> str:
    from fractions import Fraction

    q = Fraction(f).limit_denominator(64)
    return str(q.numerator) if q.denominator == 1 else f"{q.numerator}/{q.denominator}"


def fail(msg: str) -> int:
    print(f"infer routing: {msg}", file=sys.stderr)
    return 2


def main(argv) -> int:
    ap = argparse.ArgumentParser(prog="infer routing", description="routing statistics of an MoE model over a "
                                 "text, or a recorded routing trace replayed through the session cache")
    ap.add_argument("--model", type=Path, help="mlx-lm model folder or prep folder (with --trace: a prep "
                    "folder, whose manifest gives the record size)")
    ap.add_argument("--trace", type=Path, metavar="FILE",
                    help="replay this routing trace (route_trace v1 CSV, Mixtral JSONL or an "
                         "ExpertStore.routing_trace JSON; see infer.tools.replay) instead of routing a text")
    ap.add_argument("--budgets", metavar="F,F,...",
                    help=f"with --trace: cache sizes, fractions of all experts (default {DEFAULT_BUDGETS})")
    ap.add_argument("--policies", metavar="P,P,...",
                    help=f"with --trace: the policies replayed (default {','.join(replay.POLICIES)}; also "
                         "infer.tools.belady's rules, e.g. decay32+order)")
    ap.add_argument("--record-mb", type=float, metavar="MB",
                    help="with --trace: one expert record's size (default: --model's manifest, else the "
                         "model's known shape, else the trace's own)")
    ap.add_argument("--text", type=Path, help="UTF-8 text to route (default: the packaged infer/data/corpus.txt)")
    ap.add_argument("--tokens", type=int, help=f"route the first N tokens of the text (default {DEFAULT_TOKENS})")
    ap.add_argument("--calibrate", type=Path, metavar="TEXT",
                    help="fit the predictors' calibration on this text first (see infer.runtime.predict)")
    ap.add_argument("--calibration", type=Path, metavar="FILE",
                    help="a calibration file (predict.npz; default: the prep folder's own, if any)")
    ap.add_argument("--json", type=Path, metavar="PATH", help="write the full report as JSON")
    ap.add_argument("--plot", type=Path, metavar="PNG", help="plot the hit rates against cache size")
    a = ap.parse_args(argv)
    if a.trace is not None:
        for flag, v in (("--text", a.text), ("--tokens", a.tokens), ("--calibrate", a.calibrate),
                        ("--calibration", a.calibration)):
            if v is not None:
                return fail(f"{flag} routes a text: not with --trace")
        a.budgets = DEFAULT_BUDGETS if a.budgets is None else a.budgets
    else:
        for flag, v in (("--budgets", a.budgets), ("--policies", a.policies), ("--record-mb", a.record_mb)):
            if v is not None:
                return fail(f"{flag} goes with --trace")
    a.tokens = DEFAULT_TOKENS if a.tokens is None else a.tokens
    if a.trace is None and a.model is None:
        return fail("--model DIR or --trace FILE is required")
    if a.trace is not None and not a.trace.is_file():
        return fail(f"--trace {a.trace} is not a file")
    if a.trace is None and not (a.model / "config.json").is_file():
        return fail(f"{a.model} is not a model folder (no config.json)")
    if a.text is not None and not a.text.is_file():
        return fail(f"--text {a.text} is not a file")
    if a.tokens < 2:
        return fail("--tokens must be at least 2")
    if a.calibrate is not None and not a.calibrate.is_file():
        return fail(f"--calibrate {a.calibrate} is not a file")
    if a.calibration is not None and not a.calibration.is_file():
        return fail(f"--calibration {a.calibration} is not a file")
    for path, flag in ((a.json, "--json"), (a.plot, "--plot")):
        why = path and check_out(path, flag)
        if why:
            return fail(why)
    if a.plot and a.plot.suffix:
        from matplotlib.backend_bases import FigureCanvasBase

        if a.plot.suffix[1:].lower() not in FigureCanvasBase.get_supported_filetypes():
            return fail(f"--plot {a.plot}: matplotlib cannot write {a.plot.suffix} files")
    if a.trace is not None:
        return replay.main_trace(a, fail, write_atomic)
    from shared.source import SourceError

    try:
        rep = report(a.model, a.text, a.tokens, a.calibrate, a.calibration)
    except (RoutingError, UnicodeDecodeError, ModelLoadError) as e:
        return fail(str(e))
    except SourceError as e:  # found while routing: corrupt records, not a usage error
        print(f"infer routing: reading the experts of {a.model}: {e}", file=sys.stderr)
        return 1
    print(format_report(rep))
    if rep["summary"]["tokens"] < a.tokens:
        print(f"infer routing: the text gives only {rep['summary']['tokens']} tokens", file=sys.stderr)
    try:
        if a.json:
            write_atomic(a.json, lambda tmp: tmp.write_text(json.dumps(rep, indent=1) + "\n"))
        if a.plot:
            # the format from the real name's suffix, not the temporary one's
            write_atomic(a.plot, lambda tmp: plot(rep, tmp, a.plot.suffix[1:].lower() or "png"))
    except OSError as e:  # checked above; the disk may still fill or go away
        print(f"infer routing: cannot write the report ({e})", file=sys.stderr)
        return 1
    return 0
