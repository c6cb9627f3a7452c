"""Routing statistics of a model over a fixed text (`infer synth --routing-report`).

Per MoE layer: how many distinct experts the text uses, how many experts
consecutive tokens share, and the hit rate of an LRU cache holding 1/8 of the
layer's experts. The expert modules are wrapped to record the router's choice;
the model itself runs unchanged.
"""

import sys
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

import mlx.core as mx
import mlx.nn as nn
import numpy as np


@dataclass
class LayerStats:
    path: str
    num_experts: int
    top_k: int
    tokens: int
    distinct: int
    overlap: float  # mean |S_t ∩ S_{t-1}|
    lru_capacity: int
    lru_hit: float


class _Recorder(nn.Module):
    def __init__(self, inner, sink: List[np.ndarray]):
        super().__init__()
        self.inner = inner
        self._sink = sink

    def __call__(self, x, indices):
        self._sink.append(np.array(indices).reshape(-1, indices.shape[-1]))
        return self.inner(x, indices)


def install_recorders(model, paths=None) -> Dict[str, List[np.ndarray]]:
    """Wrap the expert modules (SwitchGLU/SwitchMLP, or the given ``paths``)."""
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

    mods = dict(model.named_modules())
    if paths is None:
        paths = [p for p, m in mods.items() if isinstance(m, (SwitchGLU, SwitchMLP))]
    sinks = {}
    for path in paths:
        parent_path, _, name = path.rpartition(".")
        sinks[path] = []
        setattr(mods[parent_path], name, _Recorder(mods[path], sinks[path]))
    return sinks


def num_experts_of(module) -> int:
    for v in module.children().values():
        if hasattr(v, "num_experts"):
            return v.num_experts
    raise ValueError("expert module without projections")


def lru_hit_rate(sets: np.ndarray, capacity: int) -> float:
    cache: "OrderedDict[int, None]" = OrderedDict()
    hits = total = 0
    for row in sets:
        for e in row.tolist():
            total += 1
            if e in cache:
                hits += 1
                cache.move_to_end(e)
            else:
                cache[e] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return hits / max(total, 1)


def layer_stats(path: str, num_experts: int, sets: np.ndarray) -> LayerStats:
    k = sets.shape[1]
    overlaps = [len(set(a.tolist()) & set(b.tolist())) for a, b in zip(sets[:-1], sets[1:])]
    cap = max(1, num_experts // 8)
    return LayerStats(
        path, num_experts, k, len(sets), len(np.unique(sets)),
        float(np.mean(overlaps)) if overlaps else 0.0, cap, lru_hit_rate(sets, cap),
    )


def fixed_tokens(tokenizer, n: int) -> List[int]:
    from .synth_tokenizer import corpus_text

    ids = tokenizer.encode(corpus_text())
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def route(model, tokens: List[int], chunk: int = 256, experts: Dict[str, int] = None) -> List[LayerStats]:
    """Feed ``tokens`` (causally, with a KV cache) and collect per-layer stats.
    ``experts``: module path -> number of experts, for models whose expert
    modules are not mlx-lm's (a prep folder's streaming ones)."""
    from mlx_lm.models.cache import make_prompt_cache

    modules = {p: m for p, m in model.named_modules()}
    sinks = install_recorders(model, list(experts) if experts else None)
    cache = make_prompt_cache(model)
    for i in range(0, len(tokens), chunk):
        mx.eval(model(mx.array([tokens[i : i + chunk]]), cache=cache))
    out = []
    for path, sink in sorted(sinks.items(), key=lambda ps: _order(ps[0])):
        n = experts[path] if experts else num_experts_of(modules[path])
        out.append(layer_stats(path, n, np.concatenate(sink)))
    return out


def _order(path: str):
    import re

    m = re.search(r"layers\.(\d+)\.", path)
    return (path.startswith("mtp."), int(m.group(1)) if m else 0, path)


def format_report(stats: List[LayerStats]) -> str:
    lines = []
    for s in stats:
        lines.append(
            f"{s.path:40s} experts used {s.distinct:4d}/{s.num_experts:<4d} "
            f"overlap {s.overlap:5.2f}/{s.top_k:<3d} LRU({s.lru_capacity}) hit {s.lru_hit * 100:5.1f}%"
        )
    if stats:
        n = len(stats)
        lines.append(
            f"{'mean over ' + str(n) + ' layers':40s} experts used "
            f"{sum(s.distinct / s.num_experts for s in stats) / n * 100:5.1f}%    "
            f"overlap {sum(s.overlap / s.top_k for s in stats) / n * 100:5.1f}%    "
            f"LRU(1/8) hit {sum(s.lru_hit for s in stats) / n * 100:5.1f}%  "
            f"({stats[0].tokens} tokens)"
        )
    return "\n".join(lines)


def report_main(folder: Path, n_tokens: int) -> int:
    import mlx_lm

    if not (folder / "config.json").is_file():
        print(f"infer synth: {folder} is not a model folder", file=sys.stderr)
        return 2
    experts = None
    try:
        if (folder / "manifest.json").is_file():
            # a prep folder: experts read from its blobs, in this process
            from .loader import load_streaming
            from iod.inproc import InprocSource

            model, tokenizer, store = load_streaming(folder, InprocSource(folder))
            experts = {l.module: l.num_experts for l in store.manifest.layers if not l.module.startswith("mtp.")}
        else:
            model, tokenizer = mlx_lm.load(str(folder))
    except Exception as e:  # mlx-lm raises many kinds
        print(f"infer synth: cannot load {folder} ({e})", file=sys.stderr)
        return 2
    stats = route(model, fixed_tokens(tokenizer, n_tokens), experts=experts)
    if not stats:
        print(f"infer synth: {folder} has no MoE layers", file=sys.stderr)
        return 2
    print(format_report(stats))
    return 0
