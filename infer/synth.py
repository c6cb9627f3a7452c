"""`infer synth`: random-weight MoE models in exact mlx-lm format.

The model is mlx-lm's own class built from a config we write; its parameter
tree says which tensors exist. Weights are drawn per tensor (per expert for
expert tensors) from keys derived from the seed and the tensor's name, so the
same seed gives the same bytes, and they are written shard by shard so a big
model never sits in memory whole.
"""

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import xxhash
from mlx.utils import tree_flatten

from . import synth_presets, synth_tokenizer
from .synth_presets import ARCHS, PRESETS

QUANTS = {
    "affine4": {"group_size": 64, "bits": 4, "mode": "affine"},
    "affine8": {"group_size": 64, "bits": 8, "mode": "affine"},
    "mxfp4": {"group_size": 32, "bits": 4, "mode": "mxfp4"},
}
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16}
SHARD_BYTES = 1 << 30

# Routing calibration (see `infer synth --routing-report`): the embedding's
# scale sets how much of each token survives in the residual stream against
# the layer outputs, the router's scale how sharp its choice is.
EMBED_STD = 1.0
ROUTER_GAIN = 1.0
WEIGHT_GAIN = 1.0


def fail(msg: str) -> int:
    print(f"infer synth: {msg}", file=sys.stderr)
    return 2


def model_classes(config):
    from mlx_lm.utils import _get_classes

    return _get_classes(config)


def build_model(config):
    model_class, args_class = model_classes(config)
    return model_class(args_class.from_dict(config)), args_class.from_dict(config)


def is_expert_module(m) -> bool:
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

    return isinstance(m, (SwitchGLU, SwitchMLP))


def router_paths(model) -> set:
    """Paths of the routers: the ``gate``/``router`` siblings of expert modules."""
    mods = dict(model.named_modules())
    out = set()
    for path, m in mods.items():
        if is_expert_module(m):
            parent = path.rsplit(".", 1)[0]
            for name in ("gate", "router"):
                if f"{parent}.{name}" in mods:
                    out.add(f"{parent}.{name}")
    return out


def quant_plan(model, quant: dict) -> dict:
    """path -> quantization params, as mlx-lm's quantize_model would choose."""
    predicate = getattr(model, "quant_predicate", None)
    plan = {}
    for path, m in model.named_modules():
        if not hasattr(m, "to_quantized") or not hasattr(m, "weight"):
            continue
        if m.weight.shape[-1] % quant["group_size"] != 0:
            continue
        p = predicate(path, m) if predicate else True
        if p is False:
            continue
        params = dict(quant) if p is True else {"mode": "affine", **p}
        if params["mode"] == "affine" and m.weight.shape[-1] % params["group_size"] != 0:
            continue
        plan[path] = params
    return plan


def _key(seed: int, name: str, index: int = 0):
    return mx.random.key(xxhash.xxh64_intdigest(f"{seed}:{name}:{index}".encode()) >> 33)


class Generator:
    """Draws each tensor of a module tree; yields (name, array) one at a time."""

    def __init__(self, seed: int, dtype, quant_plan: dict, routers: set, expert_chunk_bytes=64 << 20):
        self.seed = seed
        self.dtype = dtype
        self.plan = quant_plan
        self.routers = routers
        self.chunk_bytes = expert_chunk_bytes

    def std(self, module_path: str, shape) -> float:
        if module_path.endswith("embed_tokens"):
            return EMBED_STD
        gain = ROUTER_GAIN if module_path in self.routers else WEIGHT_GAIN
        return gain / shape[-1] ** 0.5

    def normal(self, name: str, shape, std: float):
        """Per-slice keys along axis 0 for 3-D tensors, so memory stays bounded
        by a chunk and the values do not depend on the chunking."""
        per = max(1, self.chunk_bytes // (4 * shape[1] * shape[2]))
        for e0 in range(0, shape[0], per):
            rows = [
                mx.random.normal(tuple(shape[1:]), key=_key(self.seed, name, e))
                for e in range(e0, min(shape[0], e0 + per))
            ]
            yield (mx.stack(rows) * std).astype(self.dtype)

    def tensors(self, module: nn.Module, prefix: str = ""):
        mods = dict(module.named_modules())
        for name, init in tree_flatten(module.parameters()):
            path, _, leaf = name.rpartition(".")
            full = f"{prefix}{name}"
            mpath = f"{prefix}{path}"
            m = mods.get(path)
            drawn = leaf == "weight" and init.ndim >= 2 and not isinstance(m, nn.Conv1d)
            if drawn:
                std = self.std(mpath, init.shape)
                q = self.plan.get(mpath)
                if init.ndim >= 3:
                    chunks = list(self._chunks(full, init.shape, std, q))
                    parts = list(zip(*chunks))
                    outs = [mx.concatenate(p, axis=0) for p in parts]
                else:
                    w = mx.random.normal(init.shape, key=_key(self.seed, full)) * std
                    w = w.astype(self.dtype)
                    outs = list(self._quantize(w, q)) if q else [w]
                names = [full] if not q else [f"{mpath}.weight", f"{mpath}.scales", f"{mpath}.biases"][: len(outs)]
                for n, a in zip(names, outs):
                    mx.eval(a)
                    yield n, a
            elif leaf == "bias" and init.ndim >= 1 and "norm" not in path:
                # Small random biases (gpt-oss's attention and per-expert ones).
                a = (mx.random.normal(init.shape, key=_key(self.seed, full)) * 0.02).astype(self.dtype)
                mx.eval(a)
                yield full, a
            else:
                # Norms, conv kernels, SSM constants, sinks: mlx-lm's own init,
                # drawn from the global key seeded before the model was built.
                a = init.astype(self.dtype) if mx.issubdtype(init.dtype, mx.floating) else init
                mx.eval(a)
                yield full, a

    def _chunks(self, name, shape, std, q):
        for w in self.normal(name, shape, std):
            out = tuple(self._quantize(w, q)) if q else (w,)
            mx.eval(out)
            yield out

    def _quantize(self, w, q):
        outs = mx.quantize(w, q["group_size"], q["bits"], mode=q["mode"])
        wq, scales, *biases = outs
        if q["mode"] == "affine":
            scales = scales.astype(self.dtype)
            biases = [b.astype(self.dtype) for b in biases]
        return (wq, scales, *biases)


class ShardWriter:
    """Collects evaluated tensors and writes a shard whenever it holds ``max_bytes``."""

    def __init__(self, folder: Path, stem: str = "model", max_bytes: int = SHARD_BYTES):
        self.folder = folder
        self.stem = stem
        self.max_bytes = max_bytes
        self.pending = {}
        self.size = 0
        self.files = []  # (temporary path, names)
        self.total = 0

    def add(self, name, a):
        if self.pending and self.size + a.nbytes > self.max_bytes:
            self.flush()
        self.pending[name] = a
        self.size += a.nbytes
        self.total += a.nbytes

    def flush(self):
        if not self.pending:
            return
        path = self.folder / f".{self.stem}-part{len(self.files):05d}.safetensors"
        mx.save_safetensors(str(path), self.pending, metadata={"format": "mlx"})
        self.files.append((path, list(self.pending)))
        self.pending = {}
        self.size = 0

    def finish(self, single_name=None):
        self.flush()
        n = len(self.files)
        if n == 1:
            os.replace(self.files[0][0], self.folder / (single_name or f"{self.stem}.safetensors"))
            return
        weight_map = {}
        for i, (path, names) in enumerate(self.files):
            final = f"{self.stem}-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(path, self.folder / final)
            weight_map.update({k: final for k in names})
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / f"{self.stem}.safetensors.index.json").write_text(json.dumps(index, indent=2))


def mtp_module(config, args):
    """Qwen3-Next's multi-token-prediction head, named as in the HF checkpoint."""
    from mlx_lm.models import qwen3_next

    class MTP(nn.Module):
        def __init__(self):
            super().__init__()
            h = args.hidden_size
            self.fc = nn.Linear(2 * h, h, bias=False)
            self.norm = nn.RMSNorm(h, eps=args.rms_norm_eps)
            self.pre_fc_norm_embedding = nn.RMSNorm(h, eps=args.rms_norm_eps)
            self.pre_fc_norm_hidden = nn.RMSNorm(h, eps=args.rms_norm_eps)
            # A full-attention decoder layer with a sparse MoE block.
            full = args.full_attention_interval - 1
            self.layers = [
                qwen3_next.Qwen3NextDecoderLayer(args, full)
                for _ in range(config.get("mtp_num_hidden_layers", 1))
            ]

    root = nn.Module()
    root.mtp = MTP()
    return root


def synthesize(arch, preset, out: Path, quant="affine4", dtype="float32", layers=None, seed=0,
               shard_bytes=None, log=None) -> dict:
    """Build the model into ``out`` (which must exist and be empty); returns config."""
    config = synth_presets.make_config(arch, preset, layers)
    q = QUANTS[quant]
    config["quantization"] = dict(q)
    config["torch_dtype"] = dtype
    config["eos_token_id"] = 2
    config["bos_token_id"] = None
    dt = DTYPES[dtype]
    shard_bytes = shard_bytes or SHARD_BYTES

    mx.random.seed(seed)
    model, args = build_model(config)
    plan = quant_plan(model, q)
    for path, p in plan.items():
        if p != q:
            config["quantization"][path] = p
    gen = Generator(seed, dt, plan, router_paths(model))
    writer = ShardWriter(out, "model", shard_bytes)
    n_layers = len(getattr(model, "layers", [])) or config["num_hidden_layers"]
    done = set()
    t0 = time.time()
    for name, a in gen.tensors(model):
        writer.add(name, a)
        if log and name.startswith("model.layers."):
            i = int(name.split(".")[2])
            if i not in done:
                done.add(i)
                log(f"\rsynth: layer {i + 1}/{n_layers}  {writer.total / 1e6:.0f} MB  {time.time() - t0:.0f}s")
    writer.finish()
    del model

    if config["model_type"] == "qwen3_next" and config.get("mtp_num_hidden_layers", 0) > 0:
        mx.random.seed(seed + 1)
        mtp = mtp_module(config, args)
        mplan = quant_plan(mtp, q)
        # the main model's quant_predicate applies to the MTP head's paths too
        from mlx_lm.models.qwen3_next import Model as NextModel

        pred = NextModel.quant_predicate.fget(None)
        for path in list(mplan):
            p = pred(path, None)
            if isinstance(p, dict):
                mplan[path] = {"mode": "affine", **p}
                config["quantization"][path] = mplan[path]
        mgen = Generator(seed + 1, dt, mplan, router_paths(mtp))
        mwriter = ShardWriter(out, "mtp", 1 << 62)  # always one mtp.safetensors
        for name, a in mgen.tensors(mtp):
            mwriter.add(name, a)
        mwriter.finish()
    if log:
        log("\n")

    vocab = synth_tokenizer.save(out, min(config["vocab_size"], 32768))
    (out / "config.json").write_text(json.dumps(dict(sorted(config.items())), indent=4) + "\n")
    return {"config": config, "tokenizer_vocab": vocab}


def folder_bytes(folder: Path):
    files = [p for p in folder.iterdir() if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def parse(argv):
    ap = argparse.ArgumentParser(prog="infer synth", description="build a random-weight MoE model in mlx-lm format")
    ap.add_argument("--arch", help=f"one of {', '.join(ARCHS)}")
    ap.add_argument("--preset", default="tiny", help=f"one of {', '.join(PRESETS)}")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--quant", default=None, help="affine4 | affine8 | mxfp4 (gpt_oss: mxfp4 only)")
    ap.add_argument("--dtype", default="float32", help="float32 | bfloat16")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="replace a non-empty --out")
    ap.add_argument("--routing-report", type=Path, metavar="DIR", help="print routing statistics of a synth model")
    ap.add_argument("--tokens", type=int, default=1024, help="routing report: tokens of text to route")
    return ap.parse_args(argv)


def main(argv) -> int:
    a = parse(argv)
    if a.routing_report is not None:
        from .synth_routing import report_main

        return report_main(a.routing_report, a.tokens)
    if a.preset not in PRESETS:
        return fail(f"unknown preset {a.preset!r} (choose from {', '.join(PRESETS)})")
    if a.arch is None:
        if a.preset not in synth_presets.REAL:
            return fail(f"--arch is required for preset {a.preset} (choose from {', '.join(ARCHS)})")
        a.arch = synth_presets.REAL[a.preset]["model_type"]
    if a.arch not in ARCHS:
        return fail(f"unknown arch {a.arch!r} (choose from {', '.join(ARCHS)})")
    if a.quant is None:
        a.quant = "mxfp4" if a.arch == "gpt_oss" else "affine4"
    if a.quant not in QUANTS:
        return fail(f"unknown quantization {a.quant!r} (choose from {', '.join(QUANTS)})")
    if a.arch == "gpt_oss" and a.quant != "mxfp4":
        return fail("gpt_oss is built with --quant mxfp4 only")
    if a.dtype not in DTYPES:
        return fail(f"unknown dtype {a.dtype!r} (choose from {', '.join(DTYPES)})")
    if a.layers is not None and a.layers < 1:
        return fail("--layers must be at least 1")
    if a.out is None:
        return fail("--out DIR is required")
    try:
        synth_presets.make_config(a.arch, a.preset, a.layers)
    except ValueError as e:
        return fail(str(e))
    out = a.out
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not a.force:
        return fail(f"{out} exists and is not empty (use --force to replace it)")

    # Build beside the destination and rename at the end: a failed run leaves nothing.
    tmp = out.parent / f".{out.name}.synth-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        info = synthesize(
            a.arch, a.preset, tmp, a.quant, a.dtype, a.layers, a.seed,
            log=lambda s: (sys.stderr.write(s), sys.stderr.flush()),
        )
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    n, size = folder_bytes(out)
    c = info["config"]
    print(
        f"wrote {out}: {c['model_type']} {a.preset}, {c['num_hidden_layers']} layers, "
        f"{a.quant} {a.dtype}, seed {a.seed}, {n} files, {size / 1e6:.1f} MB "
        f"(tokenizer vocab {info['tokenizer_vocab']})"
    )
    return 0
