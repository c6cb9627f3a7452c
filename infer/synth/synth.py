"""`infer synth`: random-weight MoE models in exact mlx-lm format.

The model is mlx-lm's own class built from a config we write; its parameter
tree says which tensors exist. Weights are drawn per tensor (per expert for
expert tensors) from keys derived from the seed and the tensor's name, so the
same seed gives the same bytes, and they are written shard by shard so a big
model never sits in memory whole.
"""

import json
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import xxhash
from mlx.utils import tree_flatten

from infer.synth import presets as synth_presets

from infer.synth import tokenizer as synth_tokenizer
from infer.synth.presets import ARCHS, PRESETS

QUANTS = {
    "affine4": {"group_size": 64, "bits": 4, "mode": "affine"},
    "affine8": {"group_size": 64, "bits": 8, "mode": "affine"},
    "mxfp4": {"group_size": 32, "bits": 4, "mode": "mxfp4"},
}
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
SHARD_BYTES = 512 << 20

# Routing calibration (see `infer routing` and docs/format.md).
# Every token embedding shares a mean direction m (mean_ratio times the size of
# its own part); queries and keys read m, so through RoPE attention favours
# recent tokens (qk_gain sets how sharply); values, routers and experts ignore
# m. The router thus sees the token plus its recent context: consecutive tokens
# share some experts, and over a text the context wanders through all of them.
@dataclass(frozen=True)
class Calibration:
    embed_std: float = 0.01
    mean_ratio: float = 2.0  # 0 turns the structure off: plain random weights
    qk_gain: float = 2.4  # softmax attention (q_norm weight, or q/k scale)
    qk_noise: float = 1.0  # token-dependent part of q and k
    mla_gain: float = 1.75  # DeepSeek MLA's rotary query
    linear_q_gain: float = 1.0  # Qwen3-Next linear attention's query
    a_range: tuple = (0.003, 0.4)  # Qwen3-Next decay rates
    router_gain: float = 1.0
    weight_gain: float = 1.0
    router_ortho: bool = True
    depth_decay: float = 0.4  # attention output of layer l scaled by (l + 1) ** -depth_decay


# Measured with `infer routing` on the tiny preset (small where given).
CALIBRATION = {
    "qwen3_moe": {"qk_gain": 2.2},
    ("qwen3_moe", "small"): {"qk_gain": 2.4},
    # measured on a 4-layer proxy (64-wide experts, 512 tokens): 0.9 -> 65%, 1.2 -> 46%
    ("qwen3_moe", "qwen3-30b-a3b"): {"qk_gain": 1.05},
    "qwen3_next": {},
    "mixtral": {"qk_gain": 1.2},
    "gpt_oss": {"qk_gain": 0.95},
    "deepseek_v3": {"mla_gain": 1.6},
}
CAL_OVERRIDE = {}  # for calibration sweeps
QUERY_NAMES = ("q_proj",)  # their token-dependent part scales with qk_gain too
ROW_CHUNK = 8192  # rows per key for big 2-D tensors (fixed: it shapes the bytes)
# matrices whose structure spans all rows (drawn whole)
ROW_STRUCTURED = ("q_proj", "k_proj", "in_proj_qkvz", "q_b_proj", "kv_a_proj_with_mqa", "gate", "router")


def calibration(arch: str, preset: str) -> Calibration:
    d = {**CALIBRATION.get(arch, {}), **CALIBRATION.get((arch, preset), {}), **CAL_OVERRIDE}
    return Calibration(**d)


SEED_MAX = 2**32 - 1


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

    def __init__(self, seed: int, dtype, quant_plan: dict, routers: set, expert_chunk_bytes=16 << 20,
                 hidden=None, head_dim=None, config=None, cal: Calibration = Calibration()):
        self.cal = cal
        self.config = config
        self.hidden = hidden
        self.head_dim = head_dim
        self.mean_dir = None
        if hidden:
            m = mx.random.normal((hidden,), key=_key(seed, "__mean_direction__"))
            self.mean_dir = m / mx.linalg.norm(m)
        self.qk_normed = set()
        self.seed = seed
        self.dtype = dtype
        self.plan = quant_plan
        self.routers = routers
        self.chunk_bytes = expert_chunk_bytes

    def std(self, module_path: str, shape) -> float:
        if module_path.endswith("embed_tokens"):
            return self.cal.embed_std
        gain = self.cal.router_gain if module_path in self.routers else self.cal.weight_gain
        last = module_path.rpartition(".")[2]
        if last in QUERY_NAMES:
            gain *= self.cal.qk_gain
        if last in ("o_proj", "out_proj") and self.cal.depth_decay:
            # the context that attention adds piles up with depth; keep the
            # token's own part from drowning in deep models
            m = re.search(r"(?:^|\.)layers\.(\d+)\.", module_path)
            if m and not module_path.startswith("mtp."):
                gain *= (int(m.group(1)) + 1) ** -self.cal.depth_decay
        return gain / shape[-1] ** 0.5

    def normal(self, name: str, mpath: str, shape, std: float):
        """Per-slice keys along axis 0 for 3-D tensors, so memory stays bounded
        by a chunk and the values do not depend on the chunking."""
        per = max(1, self.chunk_bytes // (4 * shape[1] * shape[2]))
        for e0 in range(0, shape[0], per):
            rows = [
                mx.random.normal(tuple(shape[1:]), key=_key(self.seed, name, e))
                for e in range(e0, min(shape[0], e0 + per))
            ]
            yield self.structure(mpath, mx.stack(rows) * std).astype(self.dtype)

    def tensors(self, module: nn.Module, prefix: str = ""):
        mods = dict(module.named_modules())
        self.qk_normed = {f"{prefix}{p[: -len('.q_norm')]}" for p in mods if p.endswith(".q_norm")}
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
                    chunks = list(self._chunks(full, mpath, init.shape, std, q))
                    parts = list(zip(*chunks))
                    outs = [mx.concatenate(p, axis=0) for p in parts]
                elif init.shape[0] > ROW_CHUNK and mpath.rpartition(".")[2] not in ROW_STRUCTURED:
                    # big matrices (embeddings, lm_head) in row blocks, each
                    # with its own key: memory stays at one block
                    parts = []
                    for i, r0 in enumerate(range(0, init.shape[0], ROW_CHUNK)):
                        rows = min(ROW_CHUNK, init.shape[0] - r0)
                        w = mx.random.normal((rows, init.shape[1]), key=_key(self.seed, full, i)) * std
                        w = self.structure(mpath, w).astype(self.dtype)
                        out = tuple(self._quantize(w, q)) if q else (w,)
                        mx.eval(out)
                        parts.append(out)
                        mx.clear_cache()
                    outs = [mx.concatenate(p, axis=0) for p in zip(*parts)]
                else:
                    w = mx.random.normal(init.shape, key=_key(self.seed, full)) * std
                    w = self.structure(mpath, w).astype(self.dtype)
                    outs = list(self._quantize(w, q)) if q else [w]
                names = [full] if not q else [f"{mpath}.weight", f"{mpath}.scales", f"{mpath}.biases"][: len(outs)]
                for n, a in zip(names, outs):
                    mx.eval(a)
                    yield n, a
                del outs
                mx.clear_cache()
            elif leaf == "bias" and init.ndim >= 1 and "norm" not in path:
                # Small random biases (gpt-oss's attention and per-expert ones).
                a = (mx.random.normal(init.shape, key=_key(self.seed, full)) * 0.02).astype(self.dtype)
                mx.eval(a)
                yield full, a
            else:
                # Norms, conv kernels, SSM constants, sinks: mlx-lm's own init,
                # drawn from the global key seeded before the model was built.
                a = init.astype(self.dtype) if mx.issubdtype(init.dtype, mx.floating) else init
                if path.endswith("q_norm") and leaf == "weight":
                    a = a * self.cal.qk_gain  # qk-norm would undo a smaller q_proj
                if leaf == "A_log" and self.cal.mean_ratio:
                    u = mx.random.uniform(*self.cal.a_range, shape=init.shape, key=_key(self.seed, full))
                    a = mx.log(u).astype(a.dtype)
                mx.eval(a)
                yield full, a

    def structure(self, mpath: str, w):
        """Routing structure (see the module's calibration notes): every token
        embedding shares a mean direction m; queries and keys read (mostly) m,
        so through RoPE attention favours recent tokens; values and routers
        ignore m, so the router sees the tokens and their recent context."""
        m, hd = self.mean_dir, self.head_dim
        if m is None or self.cal.mean_ratio == 0:
            return w
        last = mpath.rpartition(".")[2]
        if last == "q_b_proj" and self.config:
            return self._mla_query(mpath, w)
        if w.shape[-1] != self.hidden:
            return w
        if mpath.endswith("embed_tokens"):
            return w + (self.cal.mean_ratio * self.cal.embed_std * self.hidden**0.5) * m
        if last == "in_proj_qkvz" and self.config:
            # Qwen3-Next linear attention: a constant query makes the output a
            # decaying sum of recent values, the way softmax attention is made
            # to favour recent tokens above.
            c = self.config
            nk, dn = c["linear_num_key_heads"], c["linear_key_head_dim"]
            group = w.shape[0] // nk
            zdim = (group - 2 * dn) // 2
            w = w - (w @ m)[..., None] * m
            # rows of one key-head group: q (dn), k (dn), v, z (zdim); the
            # output gate z is made constant too, or it would scramble the sum
            a = mx.random.normal((dn,), key=_key(self.seed, mpath + ".q_direction"))
            zero = mx.zeros
            const = mx.concatenate([a * self.cal.linear_q_gain, zero((dn + zdim,)), mx.ones((zdim,)) * (2.0 / self.hidden**0.5)])
            keep = mx.concatenate([mx.ones((dn,)) * self.cal.qk_noise, mx.ones((dn + zdim,)), zero((zdim,))])
            const, keep = mx.tile(const, (nk,)), mx.tile(keep, (nk,))
            return w * keep[:, None] + const[:, None] * m[None, :]
        if last == "q_a_proj":
            b = self._mla_b(mpath.rpartition(".")[0])
            return (w - (w @ m)[..., None] * m) * self.cal.qk_noise + b[:, None] * m[None, :]
        if last == "kv_a_proj_with_mqa" and self.config:
            # DeepSeek MLA: the shared rotary key reads m, the latent does not
            r = self.config["qk_rope_head_dim"]
            a = self._mla_a(mpath.rpartition(".")[0])
            w = w - (w @ m)[..., None] * m
            k = a[:, None] * m[None, :] / (0.9 * self.hidden**0.5)
            return mx.concatenate([w[:-r], k], axis=0)
        if last in ("q_proj", "k_proj") and hd and w.shape[0] % hd == 0:
            parent = mpath.rpartition(".")[0]
            a = mx.random.normal((hd,), key=_key(self.seed, parent + ".qk_direction"))
            a = mx.tile(a, (w.shape[0] // hd,))
            gain = self.cal.qk_gain
            if parent not in self.qk_normed:
                # without qk-norm, q and k scale with m.x, about sqrt(hidden)
                gain = self.cal.qk_gain / self.hidden**0.5
            return a[:, None] * m[None, :] * gain + w * self.cal.qk_noise
        # everything else that reads the residual stream ignores m
        w = w - (w @ m)[..., None] * m
        if mpath in self.routers and self.cal.router_ortho and w.shape[0] <= w.shape[1]:
            # equal, orthogonal router rows: no expert is favoured by construction
            q, _ = mx.linalg.qr(w.T.astype(mx.float32), stream=mx.cpu)
            w = q.T * (w.shape[1] ** 0.5) * (self.cal.router_gain / w.shape[1] ** 0.5)
            w = w - (w @ m)[..., None] * m
        return w

    def _mla_a(self, parent):
        return mx.random.normal((self.config["qk_rope_head_dim"],), key=_key(self.seed, parent + ".qk_direction"))

    def _mla_b(self, parent):
        return mx.random.normal((self.config["q_lora_rank"],), key=_key(self.seed, parent + ".q_a_direction"))

    def _mla_query(self, mpath, w):
        """q_b_proj: each head's rotary query is the shared key direction a,
        read from the (constant) normalized q_a output; the rest stays random."""
        c = self.config
        nope, r, heads = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["num_attention_heads"]
        parent = mpath.rpartition(".")[0]
        a, b = self._mla_a(parent), self._mla_b(parent)
        bn = b / mx.sqrt(mx.mean(b * b))  # what q_a_layernorm makes of it
        pe = a[:, None] * bn[None, :] / mx.sum(bn * bn) * self.cal.mla_gain
        w = w.reshape(heads, nope + r, -1)
        w = mx.concatenate([w[:, :nope] * self.cal.qk_noise, mx.broadcast_to(pe, (heads, r, w.shape[-1]))], axis=1)
        return w.reshape(heads * (nope + r), -1)

    def _chunks(self, name, mpath, shape, std, q):
        for w in self.normal(name, mpath, shape, std):
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
        mx.clear_cache()
        self.size = 0

    def finish(self, one_file=False):
        """Name the shards (``stem.safetensors`` if one, else numbered with an
        index); with ``one_file`` the parts are joined by copying raw bytes."""
        self.flush()
        n = len(self.files)
        if n == 1:
            os.replace(self.files[0][0], self.folder / f"{self.stem}.safetensors")
            return
        if one_file:
            from infer.prep.safetensors import read_header, write_file

            tensors = []
            for path, _ in self.files:
                tensors += sorted(read_header(path)[0].values(), key=lambda t: t.start)
            tmp = self.folder / f".{self.stem}.joined.safetensors"
            write_file(tmp, tensors, {"format": "mlx"})
            os.replace(tmp, self.folder / f"{self.stem}.safetensors")
            for path, _ in self.files:
                path.unlink()
            return
        weight_map = {}
        for i, (path, names) in enumerate(self.files):
            final = f"{self.stem}-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(path, self.folder / final)
            weight_map.update({k: final for k in names})
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / f"{self.stem}.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _head_dim(config):
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def mtp_module(config, args):
    """Qwen3-Next's multi-token-prediction head, named as in the HF checkpoint."""
    from infer.spec.mtp import MTPHead

    root = nn.Module()
    root.mtp = MTPHead(args, config.get("mtp_num_hidden_layers", 1))
    return root


# layout "hf": the tensors as Hugging Face publishes them (one per expert,
# the published names, unquantized), for the archs whose mlx-lm sanitize
# stacks per-expert tensors
HF_EXPERT_NAMES = {
    "qwen3_moe": {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"},
    "qwen3_next": {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"},
    "mixtral": {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"},
}
HF_ARCHS = tuple(HF_EXPERT_NAMES)
# Qwen3-Next's published norms hold weight - 1 (mlx-lm's sanitize adds 1)
_NEXT_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
               ".q_norm.weight", ".k_norm.weight")


def hf_tensors(arch, name, a):
    """The published tensor(s) that mlx-lm's sanitize turns into ``name``."""
    m = re.match(r"^(.*)\.switch_mlp\.(\w+)\.weight$", name)
    if m and a.ndim == 3:
        proj = HF_EXPERT_NAMES[arch][m.group(2)]
        for e in range(a.shape[0]):
            yield f"{m.group(1)}.experts.{e}.{proj}.weight", a[e]
        return
    if arch == "qwen3_next":
        if a.ndim == 1 and any(name.endswith(k) for k in _NEXT_NORMS):
            a = a - 1.0
        elif "conv1d.weight" in name and a.shape[-1] == 1:
            a = a.moveaxis(2, 1)
    yield name, a


def synthesize(arch, preset, out: Path, quant="affine4", dtype="float32", layers=None, seed=0,
               shard_bytes=None, log=None, layout="mlx") -> dict:
    """Build the model into ``out`` (which must exist and be empty); returns config.

    ``layout="hf"``: unquantized, with the published names (``quant`` unused)."""
    config = synth_presets.make_config(arch, preset, layers)
    hf = layout == "hf"
    q = None if hf else QUANTS[quant]
    if q is not None:
        config["quantization"] = dict(q)
    config["torch_dtype"] = dtype
    config["eos_token_id"] = 2
    config["bos_token_id"] = None
    dt = DTYPES[dtype]
    shard_bytes = shard_bytes or SHARD_BYTES

    cal = calibration(config["model_type"], preset)
    mx.random.seed(seed)
    model, args = build_model(config)
    plan = quant_plan(model, q) if q is not None else {}
    for path, p in plan.items():
        if p != q:
            config["quantization"][path] = p
    gen = Generator(seed, dt, plan, router_paths(model), hidden=config["hidden_size"], head_dim=_head_dim(config), config=config, cal=cal)
    writer = ShardWriter(out, "model", shard_bytes)
    n_layers = len(getattr(model, "layers", [])) or config["num_hidden_layers"]
    done = set()
    t0 = time.time()
    for name, a in gen.tensors(model):
        for name_out, a_out in (hf_tensors(arch, name, a) if hf else [(name, a)]):
            writer.add(name_out, a_out)
        if log and name.startswith("model.layers."):
            i = int(name.split(".")[2])
            if i not in done:
                done.add(i)
                log(f"\rsynth: layer {i + 1}/{n_layers}  {writer.total / 1e6:.0f} MB  {time.time() - t0:.0f}s")
    writer.finish()
    del model

    if config["model_type"] == "qwen3_next" and config.get("mtp_num_hidden_layers", 0) > 0 and not hf:
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
        mgen = Generator(seed + 1, dt, mplan, router_paths(mtp), hidden=config["hidden_size"], head_dim=_head_dim(config), config=config, cal=cal)
        mwriter = ShardWriter(out, "mtp", shard_bytes)
        for name, a in mgen.tensors(mtp):
            mwriter.add(name, a)
        mwriter.finish(one_file=True)  # always one mtp.safetensors
    if log:
        log("\n")

    vocab = synth_tokenizer.save(out, min(config["vocab_size"], 32768))
    (out / "config.json").write_text(json.dumps(dict(sorted(config.items())), indent=4) + "\n")
    return {"config": config, "tokenizer_vocab": vocab}


def folder_bytes(folder: Path):
    files = [p for p in folder.iterdir() if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def parse(argv):
    from infer.args import Parser

    ap = Parser(prog="infer synth", description="build a random-weight MoE model in mlx-lm format "
                "(or, with --layout hf, as Hugging Face publishes one)")
    ap.add_argument("--arch", help=f"one of {', '.join(ARCHS)}")
    ap.add_argument("--preset", default="tiny", help=f"one of {', '.join(PRESETS)}")
    ap.add_argument("--out", type=Path, help="folder to write")
    ap.add_argument("--layout", default="mlx", choices=("mlx", "hf"),
                    help=f"mlx: stacked and quantized as mlx-lm saves it; hf: one unquantized tensor "
                    f"per expert, the published names ({', '.join(HF_ARCHS)})")
    ap.add_argument("--quant", default=None, help="affine4 | affine8 | mxfp4 (gpt_oss: mxfp4 only; "
                    "default: affine4, gpt_oss mxfp4; not with --layout hf)")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: float32, hf: bfloat16)")
    ap.add_argument("--layers", type=int, help="number of layers (default: the preset's)")
    ap.add_argument("--seed", type=int, default=0, help="random seed of the weights")
    ap.add_argument("--force", action="store_true", help="replace a non-empty --out")
    return ap.parse_args(argv)


def main(argv) -> int:
    a = parse(argv)
    if a.preset not in PRESETS:
        return fail(f"unknown preset {a.preset!r} (choose from {', '.join(PRESETS)})")
    if a.arch is None:
        if a.preset not in synth_presets.REAL:
            return fail(f"--arch is required for preset {a.preset} (choose from {', '.join(ARCHS)})")
        a.arch = synth_presets.REAL[a.preset]["model_type"]
    if a.arch not in ARCHS:
        return fail(f"unknown arch {a.arch!r} (choose from {', '.join(ARCHS)})")
    if a.layout == "hf":
        if a.arch not in HF_ARCHS:
            return fail(f"--layout hf is made for {', '.join(HF_ARCHS)}, not {a.arch}")
        if a.quant is not None:
            return fail("--layout hf is unquantized, as published (infer prep quantizes it)")
        a.quant = "affine4"  # unused
    a.dtype = a.dtype or ("bfloat16" if a.layout == "hf" else "float32")
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
    if not 0 <= a.seed <= SEED_MAX:  # mx.random.seed takes no more
        return fail(f"--seed must be between 0 and {SEED_MAX} (got {a.seed})")
    if a.out is None:
        return fail("--out DIR is required")
    try:
        config = synth_presets.make_config(a.arch, a.preset, a.layers)
    except ValueError as e:
        return fail(str(e))
    interval = config.get("full_attention_interval")
    if a.arch == "qwen3_next" and config["num_hidden_layers"] < interval:
        # mlx-lm's Qwen3-Next needs at least one full-attention layer
        return fail(f"qwen3_next needs --layers >= {interval} (one full-attention layer every {interval})")
    out = a.out
    if out.exists() and not out.is_dir():  # --force replaces a folder, never a file (as infer prep)
        return fail(f"{out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not a.force:
        return fail(f"{out} exists and is not empty (use --force to replace it)")
    # the folders above it are made: the nearest that exists must be one, and writable
    above = next(p for p in out.absolute().parents if p.exists())
    if not above.is_dir():
        return fail(f"--out {out}: {above} is not a folder")
    if not os.access(above, os.W_OK | os.X_OK):
        return fail(f"--out {out}: cannot write in {above}")

    # Build beside the destination and rename at the end: a failed run leaves nothing.
    tmp = out.parent / f".{out.name}.synth-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    made = [p for p in out.absolute().parents if not p.exists()]  # deepest first, removed on failure
    tmp.mkdir(parents=True)
    try:
        info = synthesize(
            a.arch, a.preset, tmp, a.quant, a.dtype, a.layers, a.seed,
            log=lambda s: (sys.stderr.write(s), sys.stderr.flush()), layout=a.layout,
        )
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for p in made:
            try:
                p.rmdir()
            except OSError:
                break
        raise
    n, size = folder_bytes(out)
    c = info["config"]
    print(
        f"wrote {out}: {c['model_type']} {a.preset}, {c['num_hidden_layers']} layers, "
        f"{'Hugging Face layout' if a.layout == 'hf' else a.quant} {a.dtype}, seed {a.seed}, "
        f"{n} files, {size / 1e6:.1f} MB "
        f"(tokenizer vocab {info['tokenizer_vocab']})"
    )
    return 0
