"""Taps on a model's MoE layers: each expert module and its decoder layer's
input norm wrapped so that a forward records the routed ids and the
inputs a predictor would see (calibration, `infer routing`, training's
evaluation). A session never installs them."""

import re
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np


class RoutingError(ValueError):
    pass


@dataclass
class MoELayer:
    """One MoE layer of a model: its expert module and what predicts for it."""

    index: int  # among the MoE layers, in call order
    module: str  # expert module path
    num_experts: int
    top_k: int
    router: Callable  # the block's router: x -> logits (or (ids, scores))
    norm: Optional[Callable]  # the decoder layer's post-attention norm
    ids: List[np.ndarray] = field(default_factory=list)  # routed ids per chunk, [n, k]
    x: Optional[mx.array] = None  # this chunk's MoE-block input, [n, H]
    residual: Optional[mx.array] = None  # this chunk's decoder-layer input, [n, H]

    def routed(self) -> np.ndarray:
        return np.concatenate(self.ids) if self.ids else np.zeros((0, self.top_k), np.int64)


class _ExpertTap(nn.Module):
    """Wraps an expert module: records its input and routed ids, then runs it."""

    def __init__(self, inner, layer: MoELayer):
        super().__init__()
        self.inner = inner
        self._layer = layer

    def __call__(self, x, indices):
        self._layer.x = x.reshape(-1, x.shape[-1])
        self._layer.ids.append(indices.reshape(-1, indices.shape[-1]))
        return self.inner(x, indices)


class _ResidualTap(nn.Module):
    """Wraps a decoder layer's input norm: records the residual stream it reads."""

    def __init__(self, inner, layer: MoELayer):
        super().__init__()
        self.inner = inner
        self._layer = layer

    def __call__(self, x):
        self._layer.residual = x.reshape(-1, x.shape[-1])
        return self.inner(x)


def _num_experts(module) -> int:
    for v in module.children().values():
        if hasattr(v, "num_experts"):
            return v.num_experts
        w = getattr(v, "weight", None) if isinstance(v, nn.Module) else None
        if w is not None and w.ndim == 3:
            return w.shape[0]
    raise RoutingError("an expert module without expert projections")


def module_at(model, path):
    """The submodule at a dotted ``path`` (list items by index)."""
    obj = model
    for p in path.split("."):
        obj = obj[int(p)] if isinstance(obj, list) else obj[p]
    return obj


def _order(path: str):
    m = re.search(r"layers\.(\d+)\.", path)
    return (int(m.group(1)) if m else 0, path)


def expert_paths(model) -> List[str]:
    """Paths of mlx-lm's expert modules (SwitchGLU / SwitchMLP), in layer order."""
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

    paths = [p for p, m in model.named_modules() if isinstance(m, (SwitchGLU, SwitchMLP))]
    return sorted(paths, key=_order)


def install(model, experts: Optional[Dict[str, int]] = None) -> List[MoELayer]:
    """Wrap every expert module (or the ``experts`` paths -> number of
    experts, for a prep folder's streaming modules) and its layer's input norm."""
    paths = sorted(experts, key=_order) if experts else expert_paths(model)
    layers = []
    for i, path in enumerate(paths):
        block_path, _, name = path.rpartition(".")
        block = module_at(model, block_path)
        inner = block[name]
        router = block.get("gate") if "gate" in block else block.get("router")
        k = getattr(block, "top_k", None) or getattr(block, "num_experts_per_tok", None)
        if router is None:
            raise RoutingError(f"no router (gate/router) beside {path}")
        decoder = module_at(model, block_path.rpartition(".")[0])
        norm = decoder.get("post_attention_layernorm") if isinstance(decoder, nn.Module) else None
        n = experts[path] if experts else _num_experts(inner)
        layer = MoELayer(i, path, n, int(k) if k else 0, router, norm)
        block[name] = _ExpertTap(inner, layer)
        if isinstance(decoder, nn.Module) and "input_layernorm" in decoder:
            decoder["input_layernorm"] = _ResidualTap(decoder["input_layernorm"], layer)
        layers.append(layer)
    return layers
