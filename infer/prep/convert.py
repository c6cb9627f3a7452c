"""`infer prep` of a folder as Hugging Face publishes it (bf16 / fp16 safetensors).

The conversion is mlx-lm's own, run lazily: ``mx.load`` maps the published
tensors without reading them, the mlx-lm model class renames and stacks them
(its ``sanitize``), they are cast as ``mlx_lm.convert --dtype`` casts and
quantized by ``mlx_lm.utils.quantize_model`` with the model's own predicate.
Nothing is computed until a tensor is written: each expert projection (all
experts of one layer, stacked) and each resident tensor is evaluated, written
and let go in turn. The peak memory is therefore set by the largest tensor,
not by the model: about 100 MB plus 3x the largest stacked expert projection
in the source dtype (or 1.5x the largest other tensor). Measured: 370 MB for
the small preset's 4.9 GB bf16 folder (0.1 GB projections). Estimated:
~1.3 GB for Qwen3-30B-A3B (0.4 GB projections, a 0.6 GB embedding), ~3.3 GB
for Qwen3-Next-80B-A3B (1.1 GB projections).
"""

import contextlib
import io
from dataclasses import dataclass
from pathlib import Path

from shared.blob import ManifestError, plan_layer

from infer.prep import safetensors as st

QUANT_MODES = ("affine", "mxfp4")
CONVERSION_DTYPES = ("float16", "bfloat16", "float32")  # mlx_lm.convert's


@dataclass
class Quantization:
    """`infer prep`'s quantization of a Hugging Face folder (None: keep floats)."""

    bits: int = 4
    group_size: int = 64
    mode: str = "affine"


def is_published_layout(src: Path, config: dict, tensors: dict) -> bool:
    """Whether ``src`` holds the tensors as published (per-expert, HF names)
    rather than as mlx-lm saves them (stacked under the expert module)."""
    from infer.prep.model import build_model, expert_modules

    mods = expert_modules(build_model(config))
    if not mods:
        return False
    _, path, projs = mods[0]
    return not any(f"{path}.{name}.weight" in tensors for name, _ in projs)


def convert(src: Path, config: dict, quant, dtype=None):
    """(expert layers, resident tensors, the converted config): mlx-lm's
    conversion of ``src``, planned but not computed."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map, tree_map_with_path
    from mlx_lm.utils import quantize_model

    from infer.prep.model import SUPPORTED, ExpertLayer, Refusal, build_model, expert_modules

    weights = {}
    for f in sorted(src.glob("model*.safetensors")):
        try:
            weights.update(mx.load(str(f)))
        except (RuntimeError, ValueError) as e:
            raise Refusal(f"{f}: {e}") from None
    model = build_model(config)
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise Refusal(f"{src}: the weights do not fit mlx-lm's {config['model_type']} model "
                      f"({str(e).splitlines()[0]})") from None
    del weights  # the stacked tensors must not outlive their write

    # as mlx_lm.convert: the folder's dtype unless told, routing biases kept
    dtype = dtype or config.get("torch_dtype") or (config.get("text_config") or {}).get("dtype")
    if dtype in CONVERSION_DTYPES:
        target = getattr(mx, dtype)
        keep = getattr(model, "cast_predicate", lambda _: True)
        model.update(tree_map_with_path(
            lambda k, v: v.astype(target) if keep(k) and mx.issubdtype(v.dtype, mx.floating) else v,
            model.parameters()))
    if quant is not None:
        with contextlib.redirect_stdout(io.StringIO()):  # its "[INFO] Quantized model with ..."
            model, config = quantize_model(model, config, quant.group_size, quant.bits, mode=quant.mode)

    mods = expert_modules(model)
    params = dict(tree_flatten(model.parameters()))
    # the model lets go of its arrays: each is held once, here, until written
    model.update(tree_map(lambda _: mx.array([]), model.parameters()))

    layers, used = [], set()
    for layer, path, projs in mods:
        specs, names, quantization = [], [], {}
        for proj, m in projs:
            if hasattr(m, "bits"):
                q = {"mode": m.mode, "bits": m.bits, "group_size": m.group_size}
                if q["mode"] not in SUPPORTED or q["bits"] not in SUPPORTED[q["mode"]]:
                    raise Refusal(f"{path}.{proj}: unsupported quantization {q['mode']} {q['bits']}-bit "
                                  f"(supported: affine 4/8-bit, mxfp4)")
                quantization[proj] = q
            for t in ("weight", "scales", "biases", "bias"):
                name = f"{path}.{proj}.{t}"
                if name in params:
                    a = params[name]
                    dt = str(a.dtype).rsplit(".", 1)[-1]
                    specs.append((proj, t, dt, list(a.shape[1:]), a.itemsize, a.shape[0]))
                    names.append(name)
        try:
            layout = plan_layer(layer, path, specs, quantization)
        except ManifestError as e:
            raise Refusal(str(e)) from None
        layers.append(ExpertLayer(layout, load=_loader(params, names, projs, path)))
        used.update(names)
    resident = [st.ArrayTensor(name, a) for name, a in params.items() if name not in used]
    return layers, resident, config


def _loader(params, names, projs, path):
    def load():
        """The layer's tensors, computed projection by projection; each is
        taken out of ``params`` so it goes once written."""
        import mlx.core as mx
        import numpy as np

        out = []
        for proj, _ in projs:
            mine = [n for n in names if n.startswith(f"{path}.{proj}.")]
            arrays = [params.pop(n) for n in mine]
            mx.eval(arrays)
            for a in arrays:
                if a.dtype == mx.bfloat16:
                    a = a.view(mx.uint16)
                out.append(np.ascontiguousarray(np.asarray(a)))
            del arrays
            mx.clear_cache()
        return out

    return load
