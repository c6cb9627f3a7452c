"""`infer prep`: convert an mlx-lm MoE model folder into a prep folder.

The expert modules are found by building mlx-lm's model class from the config
(no weights) and looking for SwitchGLU / SwitchMLP instances; their stacked
tensors become one blob file per MoE layer, laid out by ``shared.blob``.
Everything else is copied byte for byte. The conversion works on raw
safetensors bytes one record at a time, so memory stays flat.
"""

import json
import os
import re
import resource
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

from shared.blob import MANIFEST_NAME, NUMPY_DTYPES, LayerLayout, Manifest, ManifestError, plan_layer, record_checksum, verify_record

from infer.prep import safetensors as st

TENSOR_ORDER = ("weight", "scales", "biases", "bias")
# Quantizations the streaming side knows how to run (mode -> allowed bits).
SUPPORTED = {"affine": (4, 8), "mxfp4": (4,)}
PARTIAL_MANIFEST = "manifest.partial.json"
SHARD_BYTES = 4 << 30


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


def peak_rss_mb() -> float:
    # VmHWM belongs to this address space; ru_maxrss survives exec on Linux and
    # may report the high-water mark of the process that forked us.
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / (1 << 20) if sys.platform == "darwin" else r / 1024


REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def load_config(src: Path) -> dict:
    if not src.is_dir():
        if not src.exists() and REPO_ID.match(str(src)):
            local = str(src).split("/")[-1]
            raise Refusal(
                f"{src} is not a folder here; download the Hugging Face repo first: "
                f"hf download {src} --local-dir {local} (or: huggingface-cli download {src} "
                f"--local-dir {local}), then: infer prep --model {local} --out {local}-prep"
            )
        raise Refusal(f"{src} is not a model folder (not a directory)")
    path = src / "config.json"
    if not path.is_file():
        raise Refusal(f"{src} is not a model folder (no config.json)")
    if (src / MANIFEST_NAME).is_file():
        raise Refusal(f"{src} is a prep folder already: infer run takes it as it is")
    try:
        config = json.loads(path.read_text())
    except ValueError as e:
        raise Refusal(f"{path} is not valid JSON ({e})") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise Refusal(f"{path} has no model_type")
    if not list(src.glob("model*.safetensors")):
        raise Refusal(f"{src} is not a model folder (no model*.safetensors)")
    return config


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


def _layer_index(path: str) -> Optional[int]:
    """The block index in a module path: its last numeric component
    (``model.layers.3.mlp.switch_mlp``, ``transformer.h.3.moe.mlp``)."""
    nums = [int(t) for t in path.split(".") if t.isdigit()]
    return nums[-1] if nums else None


def layer_numbers(paths) -> Dict[str, int]:
    """Blob number of each expert module: its block index, or its rank in
    path order when block indices are missing or shared."""
    idx = [_layer_index(p) for p in paths]
    if None in idx or len(set(idx)) != len(idx):
        return {p: i for i, p in enumerate(paths)}
    return dict(zip(paths, idx))


def infer_quant(path: str, in_dims: int, tensors: Dict[str, st.TensorInfo], qconfig) -> Optional[dict]:
    """{"mode", "bits", "group_size"} of a projection, the way mlx-lm's loader decides it."""
    if f"{path}.scales" not in tensors:
        return None
    override = qconfig.get(path) if isinstance(qconfig, dict) else None
    if isinstance(override, dict):
        q = {"mode": override.get("mode", "affine"), "bits": override["bits"], "group_size": override["group_size"]}
    else:
        scales, weight = tensors[f"{path}.scales"], tensors[f"{path}.weight"]
        group_size = in_dims // scales.shape[-1]
        bits = weight.shape[-1] * 32 // in_dims
        if scales.dtype != "uint8":
            mode = "affine"
        else:
            mode = {(4, 16): "nvfp4", (4, 32): "mxfp4", (8, 32): "mxfp8"}.get((bits, group_size))
            if mode is None:
                raise Refusal(f"{path}: cannot infer the quantization mode ({bits} bits, group size {group_size})")
        q = {"mode": mode, "bits": bits, "group_size": group_size}
    if q["mode"] not in SUPPORTED or q["bits"] not in SUPPORTED[q["mode"]]:
        raise Refusal(
            f"{path}: unsupported quantization {q['mode']} {q['bits']}-bit "
            f"(supported: affine 4/8-bit, mxfp4)"
        )
    return q


def plan_expert_layer(layer, module, projections, tensors, qconfig, target="model") -> ExpertLayer:
    """``projections``: [(name, in_dims)] in record order."""
    specs, sources, quant = [], [], {}
    for proj, in_dims in projections:
        ppath = f"{module}.{proj}"
        if f"{ppath}.weight" not in tensors:
            raise Refusal(f"expert tensor {ppath}.weight is missing from the weights")
        q = infer_quant(ppath, in_dims, tensors, qconfig)
        if q is not None:
            quant[proj] = q
        for t in TENSOR_ORDER:
            info = tensors.get(f"{ppath}.{t}")
            if info is None:
                continue
            if info.dtype not in NUMPY_DTYPES:
                raise Refusal(f"{info.name}: unsupported dtype {info.dtype}")
            if len(info.shape) < 2:
                raise Refusal(f"{info.name}: shape {list(info.shape)} has no expert axis")
            specs.append((proj, t, info.dtype, list(info.shape[1:]), info.itemsize, info.shape[0]))
            sources.append(info)
    try:
        layout = plan_layer(layer, module, specs, quant)
    except ManifestError as e:
        raise Refusal(str(e)) from None
    return ExpertLayer(layout, sources, target)


def plan(src: Path, config: dict):
    """(expert layers, resident tensors, mtp resident tensors); raises Refusal."""
    tensors = read_tensors(src)
    model = build_model(config)
    mods = expert_modules(model)
    if not mods:
        raise Refusal(f"{src} has no MoE layers (no SwitchGLU / SwitchMLP modules in its {config['model_type']} model)")
    qconfig = config.get("quantization", config.get("quantization_config")) or {}
    layers = []
    for layer, path, projs in mods:
        projections = [(name, m.input_dims if hasattr(m, "input_dims") else m.weight.shape[-1]) for name, m in projs]
        layers.append(plan_expert_layer(layer, path, projections, tensors, qconfig))
    used = {s.name for l in layers for s in l.sources}
    resident = [t for t in tensors.values() if t.name not in used]
    resident.sort(key=lambda t: (str(t.file), t.start))

    # Qwen3-Next's MTP head: HF names, experts stacked like the main model's.
    mtp_resident = []
    mtp_file = src / "mtp.safetensors"
    if mtp_file.is_file():
        try:
            mtensors = st.read_header(mtp_file)[0]
        except (OSError, st.SafetensorsError) as e:
            raise Refusal(str(e)) from None
        proj_dims = [(name, m.weight.shape[-1]) for name, m in mods[0][2]]
        n_layers = max(config.get("num_hidden_layers", 0), max(l.layout.layer for l in layers) + 1)
        prefixes = sorted(
            {m.group(1) for k in mtensors if (m := re.match(r"^(mtp\.layers\.\d+\.[\w.]*?switch_mlp)\.", k))},
            key=_layer_index,
        )
        for prefix in prefixes:
            layers.append(
                plan_expert_layer(n_layers + _layer_index(prefix), prefix, proj_dims, mtensors, qconfig, "mtp")
            )
        used |= {s.name for l in layers for s in l.sources}
        mtp_resident = sorted((t for t in mtensors.values() if t.name not in used), key=lambda t: t.start)
    return layers, resident, mtp_resident


class Progress:
    def __init__(self, total: int, enabled: bool):
        self.total = max(total, 1)
        self.done = 0
        self.t0 = time.time()
        self.enabled = enabled
        self.last = 0.0

    def add(self, n: int, label: str = "", force=False):
        self.done += n
        now = time.time()
        if not self.enabled or (now - self.last < 0.2 and not force):
            return
        self.last = now
        frac = min(self.done / self.total, 1.0)
        bar = "#" * int(frac * 30)
        rate = self.done / max(now - self.t0, 1e-6) / 1e6
        sys.stderr.write(
            f"\rprep [{bar:<30}] {frac * 100:5.1f}%  {self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB  "
            f"{rate:6.0f} MB/s  {label:<12}"
        )
        sys.stderr.flush()

    def end(self):
        if self.enabled:
            self.add(0, "done", force=True)
            sys.stderr.write("\n")


def write_blob(dst: Path, el: ExpertLayer, progress: Progress, batch_bytes: int = 8 << 20) -> None:
    """Write one layer's blob as ``*.tmp`` then rename; fills in the checksums."""
    layout = el.layout
    final = dst / layout.file
    tmp = final.with_name(final.name + ".tmp")
    fds = {}
    checksums = []
    per_batch = max(1, batch_bytes // layout.stride)
    arrays = el.load() if el.load is not None else None
    try:
        for s in el.sources:
            if s.file not in fds:
                fds[s.file] = os.open(s.file, os.O_RDONLY)
        with open(tmp, "wb") as out:
            for e0 in range(0, layout.num_experts, per_batch):
                n = min(per_batch, layout.num_experts - e0)
                buf = bytearray(n * layout.stride)
                for i in range(n):
                    e = e0 + i
                    base = i * layout.stride
                    for i, seg in enumerate(layout.segments):
                        if arrays is not None:
                            data = memoryview(arrays[i][e]).cast("B")
                        else:
                            src = el.sources[i]
                            data = st.read_bytes(src, fds[src.file], e * seg.nbytes, seg.nbytes)
                        buf[base + seg.offset : base + seg.offset + seg.nbytes] = data
                    rec = memoryview(buf)[base : base + layout.record_bytes]
                    checksums.append(f"{record_checksum(layout.layer, e, rec):016x}")
                out.write(buf)
                progress.add(n * layout.record_bytes, f"layer {layout.layer}")
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        for fd in fds.values():
            os.close(fd)
    layout.checksums = checksums


def blob_verifies(dst: Path, layout: LayerLayout) -> bool:
    path = dst / layout.file
    if len(layout.checksums) != layout.num_experts or not path.is_file():
        return False
    if path.stat().st_size < layout.num_experts * layout.stride:
        return False
    with open(path, "rb") as f:
        for e in range(layout.num_experts):
            if not verify_record(layout, e, os.pread(f.fileno(), layout.record_bytes, e * layout.stride)):
                return False
    return True


def previous_layouts(dst: Path) -> Dict[int, LayerLayout]:
    """Layouts with checksums from an earlier (possibly interrupted) run into ``dst``."""
    for name in (MANIFEST_NAME, PARTIAL_MANIFEST):
        try:
            m = Manifest.from_dict(json.loads((dst / name).read_text()))
            return {l.layer: l for l in m.layers}
        except (OSError, ValueError, ManifestError):
            continue
    return {}


def same_layout(a: LayerLayout, b: LayerLayout) -> bool:
    keys = ("layer", "module", "file", "num_experts", "record_bytes", "stride", "segments", "quantization")
    return all(getattr(a, k) == getattr(b, k) for k in keys)


def copy_resident(dst: Path, tensors, stem: str, progress: Progress, shard_bytes: int) -> List[str]:
    if not tensors:
        return []
    shards = st.shard(tensors, shard_bytes)
    names = st.shard_names(len(shards)) if stem == "model" else [f"{stem}.safetensors"] * len(shards)
    if stem != "model" and len(shards) > 1:
        shards, names = [tensors], [f"{stem}.safetensors"]
    for shard, name in zip(shards, names):
        tmp = dst / (name + ".tmp")
        try:
            st.write_file(tmp, shard, {"format": "mlx"}, on_bytes=lambda n: progress.add(n, name[:12]))
            os.replace(tmp, dst / name)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.nbytes for t in tensors)},
            "weight_map": {t.name: n for shard, n in zip(shards, names) for t in shard},
        }
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        names = [*names, "model.safetensors.index.json"]
    return names


WEIGHT_SUFFIXES = (".safetensors", ".blob", ".tmp", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")


def copy_side_files(src: Path, dst: Path, skip=()) -> List[str]:
    """config.json (unchanged), tokenizer and chat-template files, and other small metadata."""
    copied = []
    for p in sorted(src.iterdir()):
        if not p.is_file() or p.suffix in WEIGHT_SUFFIXES or p.name in (
            MANIFEST_NAME,
            PARTIAL_MANIFEST,
            "model.safetensors.index.json",
            *skip,
        ):
            continue
        shutil.copyfile(p, dst / (p.name + ".tmp"))
        os.replace(dst / (p.name + ".tmp"), dst / p.name)
        copied.append(p.name)
    return copied


def remove_stale(dst: Path, written) -> None:
    """Remove from ``dst`` what this prep did not write: an earlier prep's
    blobs, weights, tokenizer files and calibration (another model's, or
    fitted on other weights). So --resume ends with the folder --force
    would give, only faster."""
    for p in dst.iterdir():
        if p.name in written:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def sweep_staging(dst: Path) -> None:
    """Remove the staging and old folders of ``--force`` runs into ``dst``
    whose process is gone (killed before it could clean up)."""
    for p in dst.parent.glob(f".{dst.name}.*-*"):
        kind, _, pid = p.name[len(dst.name) + 2:].rpartition("-")
        if kind not in ("prep", "old") or not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # its prep is still running
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except PermissionError:
            continue  # another user's process


def check_dst(src: Path, dst: Path, force: bool, resume: bool) -> None:
    s, d = src.resolve(), dst.resolve()
    if d == s or s in d.parents or d in s.parents:
        raise Refusal(f"--out {dst} overlaps the source folder {src}")
    if dst.exists() and not dst.is_dir():
        raise Refusal(f"{dst} exists and is not a directory")
    if dst.is_dir() and any(dst.iterdir()) and not (force or resume):
        raise Refusal(f"{dst} exists and is not empty (use --force to replace it or --resume to continue)")


def read_tensors(src: Path) -> Dict[str, st.TensorInfo]:
    tensors: Dict[str, st.TensorInfo] = {}
    try:
        for f in sorted(src.glob("model*.safetensors")):
            tensors.update(st.read_header(f)[0])
    except (OSError, st.SafetensorsError) as e:
        raise Refusal(str(e)) from None
    return tensors


def prep(src: Path, dst: Path, force=False, resume=False, progress=True, shard_bytes=SHARD_BYTES,
         quant=None, dtype=None) -> Manifest:
    """Convert ``src`` into ``dst``; raises Refusal before writing anything if it cannot.

    ``src`` is an mlx-lm folder (its tensors are copied byte for byte) or a
    folder as Hugging Face publishes it, which mlx-lm's code converts first:
    ``quant`` (a ``prep_convert.Quantization``, default 4-bit affine) and
    ``dtype`` apply to those only."""
    from infer.prep import convert as prep_convert

    config = load_config(src)
    check_dst(src, dst, force, resume)
    if dst.is_dir() and any(dst.iterdir()) and force and not resume:
        # the folder being replaced stays whole until its replacement is
        sweep_staging(dst)
        staging = dst.parent / f".{dst.name}.prep-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            m = prep(src, staging, progress=progress, shard_bytes=shard_bytes, quant=quant, dtype=dtype)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        old = dst.parent / f".{dst.name}.old-{os.getpid()}"
        os.replace(dst, old)
        os.replace(staging, dst)
        shutil.rmtree(old)
        return m
    converted = None
    if prep_convert.is_published_layout(src, config, read_tensors(src)):
        quant = prep_convert.Quantization() if quant is None else quant
        layers, resident, converted = prep_convert.convert(src, config, quant or None, dtype)
        mtp_resident = []
    else:
        if quant is not None or dtype is not None:
            raise Refusal(f"{src} is already converted by mlx-lm; its dtype and quantization are kept "
                          "(--q-bits, --q-group-size, --q-mode, --no-quantize and --dtype apply to "
                          "folders as Hugging Face publishes them)")
        layers, resident, mtp_resident = plan(src, config)

    previous = previous_layouts(dst) if resume and dst.is_dir() else {}
    dst.mkdir(parents=True, exist_ok=True)
    (dst / MANIFEST_NAME).unlink(missing_ok=True)  # the folder is not valid until the end

    manifest = Manifest(model_type=config["model_type"], layers=[l.layout for l in layers])
    total = sum(l.layout.record_bytes * l.layout.num_experts for l in layers)
    total += sum(t.nbytes for t in resident) + sum(t.nbytes for t in mtp_resident)
    bar = Progress(total, progress)
    skipped = 0
    done: List[LayerLayout] = []
    for el in layers:
        old = previous.get(el.layout.layer)
        if old is not None and same_layout(old, el.layout) and blob_verifies(dst, old):
            el.layout.checksums = old.checksums
            skipped += 1
            bar.add(el.layout.record_bytes * el.layout.num_experts, f"layer {el.layout.layer} ok")
        else:
            write_blob(dst, el, bar)
        done.append(el.layout)
        # progress record for --resume; manifest.json itself comes last
        partial = dst / PARTIAL_MANIFEST
        (dst / (PARTIAL_MANIFEST + ".tmp")).write_text(Manifest(model_type=manifest.model_type, layers=done).to_json())
        os.replace(dst / (PARTIAL_MANIFEST + ".tmp"), partial)

    written = {l.file for l in manifest.layers} | {MANIFEST_NAME, PARTIAL_MANIFEST}
    written.update(copy_resident(dst, resident, "model", bar, shard_bytes))
    if mtp_resident:
        written.update(copy_resident(dst, mtp_resident, "mtp", bar, shard_bytes))
    if converted is not None:
        from mlx_lm.utils import save_config

        written.update(copy_side_files(src, dst, skip=("config.json",)))
        save_config(converted, dst / "config.json")
        written.add("config.json")
    else:
        written.update(copy_side_files(src, dst))
    bar.end()
    remove_stale(dst, written)
    manifest.save(dst)
    (dst / PARTIAL_MANIFEST).unlink(missing_ok=True)
    manifest.skipped = skipped  # for the summary line
    return manifest


def build_parser():
    from infer.args import Parser, add_version

    p = Parser(prog="infer prep", description="convert an MoE model folder (mlx-lm's, or as Hugging Face "
               "publishes it) into a prep folder: resident weights, one expert blob per MoE layer")
    p.add_argument("--model", required=True, type=Path,
                   help="model folder: mlx-lm / mlx-community, or a Hugging Face download (bf16/fp16)")
    p.add_argument("--out", required=True, type=Path, help="prep folder to write")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.add_argument("--resume", action="store_true",
                   help="keep layers of --out whose records already verify; what an earlier prep "
                        "left that this one does not write (its --calibrate files too) is removed")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--calibrate", type=Path, metavar="TEXT", default=None,
                   help="fit the expert predictors on this text (its first 4,096 tokens) and store "
                        "them beside the manifest (predict.npz; see infer.runtime.predict)")
    g = p.add_argument_group("Hugging Face folders (converted with mlx-lm's code; mlx_lm.convert's names)")
    g.add_argument("-q", "--quantize", action="store_true", help="quantize (the default; see --no-quantize)")
    g.add_argument("--no-quantize", action="store_true", help="keep the weights in floating point")
    g.add_argument("--q-bits", type=int, choices=(4, 8), default=None, help="bits per weight (default: 4)")
    g.add_argument("--q-group-size", type=int, choices=(32, 64, 128), default=None,
                   help="group size (default: 64, mxfp4: 32)")
    g.add_argument("--q-mode", choices=("affine", "mxfp4"), default=None, help="quantization mode (default: affine)")
    g.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), default=None,
                   help="dtype of the floating weights (default: the config's torch_dtype)")
    add_version(p)
    return p


def quant_from_args(a):
    """The --q-* / --no-quantize choice: None when nothing was said."""
    from infer.prep.convert import Quantization

    said = a.quantize or a.no_quantize or any(v is not None for v in (a.q_bits, a.q_group_size, a.q_mode))
    if not said:
        return None
    if a.no_quantize:
        if a.quantize or any(v is not None for v in (a.q_bits, a.q_group_size, a.q_mode)):
            raise Refusal("--no-quantize with a quantization option")
        return False
    mode = a.q_mode or "affine"
    if mode == "mxfp4" and (a.q_bits or 4) != 4 or mode == "mxfp4" and (a.q_group_size or 32) != 32:
        raise Refusal("mxfp4 is 4 bits in groups of 32")
    return Quantization(a.q_bits or 4, a.q_group_size or (32 if mode == "mxfp4" else 64), mode)


def main(argv) -> int:
    a = build_parser().parse_args(argv)
    if a.calibrate is not None:  # checked before the prep, which takes minutes
        why = None
        try:
            if not a.calibrate.read_bytes().decode("utf-8").strip():
                why = "is empty"
        except IsADirectoryError:
            why = "is not a file"
        except OSError as e:
            why = f"cannot be read ({e.strerror})" if a.calibrate.exists() else "is not a file"
        except UnicodeDecodeError:
            why = "is not UTF-8 text"
        if why:
            print(f"infer prep: --calibrate {a.calibrate} {why}", file=sys.stderr)
            return 2
    t0 = time.time()
    try:
        m = prep(a.model, a.out, a.force, a.resume, progress=not a.no_progress,
                 quant=quant_from_args(a), dtype=a.dtype)
    except Refusal as e:
        print(f"infer prep: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        more = "; --resume continues from the layers written" \
            if (a.out / PARTIAL_MANIFEST).exists() else ""
        print(f"\ninfer prep: interrupted{more}", file=sys.stderr)
        return 130
    experts = sum(l.stride * l.num_experts for l in m.layers)
    resident = sum(p.stat().st_size for p in a.out.glob("*.safetensors"))
    print(
        f"wrote {a.out}: {len(m.layers)} MoE layers ({m.skipped} kept by --resume), "
        f"{sum(l.num_experts for l in m.layers)} expert records, experts {experts / 1e6:.1f} MB, "
        f"resident {resident / 1e6:.1f} MB, {time.time() - t0:.1f}s"
    )
    if a.calibrate is not None:
        from infer.prep.calibrate import calibrate_folder, count_usage
        from infer.runtime.predict import CALIBRATION_NAME

        try:
            cal = calibrate_folder(a.out, a.calibrate)
        except (ValueError, UnicodeDecodeError) as e:
            print(f"infer prep: --calibrate: {e}", file=sys.stderr)
            return 2
        picked = sorted(set(name for name, _ in cal.choice.values()))
        print(f"wrote {a.out / CALIBRATION_NAME}: {len(cal.maps)} linear maps fitted on "
              f"{cal.text['fit_tokens']} of {cal.text['tokens']} tokens; combined predictor uses "
              f"{', '.join(picked) or 'nothing'}")
        from infer.runtime import coldstart

        count_usage(a.out, a.calibrate.read_text(encoding="utf-8", errors="replace"))
        print(f"wrote {a.out / coldstart.USAGE_NAME}: the experts the text uses most, loaded first")
    print(f"peak RSS {peak_rss_mb():.0f} MB")
    return 0
