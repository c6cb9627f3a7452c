"""mlx-lm's model as a prep folder sees it: built lazily from a config
(never evaluated), its expert modules found by type, and their layer numbers.
Shared by the conversion of Hugging Face folders (``convert``) and the copy
of mlx-lm folders (``prep``)."""

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

from shared.blob import LayerLayout

from infer.prep import safetensors as st

# Quantizations the streaming side knows how to run (mode -> allowed bits).
SUPPORTED = {"affine": (4, 8), "mxfp4": (4,)}


class Refusal(Exception):
    """A reason not to convert; reported as one line, exit code 2."""


@dataclass
class ExpertLayer:
    layout: LayerLayout
    # per segment, the source tensor it is sliced from
    sources: List[st.TensorInfo] = field(default_factory=list)
    target: str = "model"  # "model" or "mtp": which resident file its module belongs to
    # or, for a converted folder: returns per segment a C-contiguous numpy
    # array [experts, ...] of its raw bytes (computed when the layer is written)
    load: Optional[Callable[[], list]] = None


def build_model(config: dict):
    """mlx-lm's model for ``config``; parameters are lazy and never evaluated."""
    from mlx_lm.utils import _get_classes

    try:
        model_class, args_class = _get_classes(config)
    except ValueError:
        raise Refusal(f"model type {config['model_type']!r} is not supported by mlx-lm") from None
    try:
        return model_class(args_class.from_dict(config))
    except Exception as e:
        raise Refusal(f"cannot build a {config['model_type']} model from config.json ({e})") from None


def expert_modules(model):
    """[(layer, path, [(projection, unquantized SwitchLinear)])] for every
    expert module (SwitchGLU / SwitchMLP), whatever its path is named."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU, SwitchLinear, SwitchMLP

    found = []
    for path, m in model.named_modules():
        if isinstance(m, (SwitchGLU, SwitchMLP)):
            projs = [(k, v) for k, v in m.items() if isinstance(v, (SwitchLinear, QuantizedSwitchLinear))]
            found.append((path, projs))
    found.sort(key=lambda pm: _natural(pm[0]))
    numbers = layer_numbers([p for p, _ in found])
    return [(numbers[p], p, projs) for p, projs in found]


def _natural(path: str):
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in path.split(".")]


def layer_index(path: str) -> Optional[int]:
    """The block index in a module path: its last numeric component
    (``model.layers.3.mlp.switch_mlp``, ``transformer.h.3.moe.mlp``)."""
    nums = [int(t) for t in path.split(".") if t.isdigit()]
    return nums[-1] if nums else None


def layer_numbers(paths) -> Dict[str, int]:
    """Blob number of each expert module: its block index, or its rank in
    path order when block indices are missing or shared."""
    idx = [layer_index(p) for p in paths]
    if None in idx or len(set(idx)) != len(idx):
        return {p: i for i, p in enumerate(paths)}
    return dict(zip(paths, idx))
