"""`infer prep`: convert an mlx-lm MoE model folder into a prep folder.

The expert modules are found by building mlx-lm's model class from the config
(no weights) and looking for SwitchGLU / SwitchMLP instances; their stacked
tensors become one blob file per MoE layer, laid out by ``shared.blob``.
Everything else is copied byte for byte. The conversion works on raw
safetensors bytes one record at a time, so memory stays flat.
"""

import errno
import fcntl
import json
import os
import re
import resource
import shutil
import signal
import stat
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import xxhash

from shared.blob import (MANIFEST_NAME, NUMPY_DTYPES, PARTIAL_MANIFEST_NAME, LayerLayout, Manifest, ManifestError,
                         open_inside, plan_layer, record_checksum, verify_record)
from shared.launch import lock_pid_file, read_pid

from infer.prep import safetensors as st
from infer.prep.model import (SUPPORTED, ExpertLayer, Refusal, build_model,  # noqa: F401
                              expert_modules, layer_index, layer_numbers)

TENSOR_ORDER = ("weight", "scales", "biases", "bias")
PARTIAL_MANIFEST = PARTIAL_MANIFEST_NAME
SHARD_BYTES = 4 << 30


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
    if not path.exists():
        raise Refusal(f"{src} is not a model folder (no config.json)")
    if (src / MANIFEST_NAME).is_file():
        raise Refusal(f"{src} is a prep folder already: infer run takes it as it is")
    try:
        with os.fdopen(st.open_regular(path), "rb") as f:
            config = json.loads(f.read(64 << 20))
    except st.SafetensorsError as e:
        raise Refusal(str(e)) from None
    except (ValueError, RecursionError) as e:
        raise Refusal(f"{path} is not valid JSON ({str(e).splitlines()[0] if str(e) else e})") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise Refusal(f"{path} has no model_type")
    if not list(src.glob("model*.safetensors")):
        raise Refusal(f"{src} is not a model folder (no model*.safetensors)")
    return config


# a decoder block's index in a tensor or parameter name: model.layers.3.*,
# transformer.h.3.*, backbone.blocks.3.*
BLOCK = re.compile(r"^(.*?(?:^|\.)(?:layers|h|blocks)\.)(\d+)\.")
LAYER_KEYS = ("num_hidden_layers", "num_layers", "n_layer")


def _blocks(names) -> Dict[str, set]:
    """{prefix: block indices} of ``names``."""
    out: Dict[str, set] = {}
    for n in names:
        m = BLOCK.match(n)
        if m:
            out.setdefault(m.group(1), set()).add(int(m.group(2)))
    return out


def _spans(ids) -> str:
    from infer.prep.verify import ranges

    return ranges(sorted(ids), limit=4)


def check_layer_count(src: Path, config: dict, tensors) -> None:
    """A config that names more layers than the weights have is refused
    before mlx-lm builds the model: building allocates per layer (a million
    layers took gigabytes)."""
    found = [i for ids in _blocks(tensors).values() for i in ids]
    for where, c in (("", config), ("text_config.", config.get("text_config"))):
        if not isinstance(c, dict):
            continue
        for key in LAYER_KEYS:
            n = c.get(key)
            if n is None:
                continue
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise Refusal(f"{src / 'config.json'}: {where}{key} is {n!r}, not a number of layers")
            if found and n > max(found) + 1:
                raise Refusal(f"{src / 'config.json'} names {n} layers ({where}{key}) but the weights "
                              f"have layers 0-{max(found)}: the config does not belong to these weights")


def check_model_layers(src: Path, model, tensors) -> None:
    """The weights hold exactly the layers of the model config.json builds
    (an mlx-lm folder: its weights are the model's parameters, by name)."""
    from mlx.utils import tree_flatten

    built = _blocks(name for name, _ in tree_flatten(model.parameters()))
    have = _blocks(tensors)
    for prefix, ids in built.items():
        extra, missing = have.get(prefix, set()) - ids, ids - have.get(prefix, set())
        if missing:
            raise Refusal(f"{src / 'config.json'} names layers {prefix}{_spans(missing)} that the weights "
                          f"do not have: the config does not belong to these weights")
        if extra:
            raise Refusal(f"the weights have layers {prefix}{_spans(extra)} that {src / 'config.json'} "
                          f"does not name: the config does not belong to these weights")


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


def plan_expert_layer(layer, module, projections, tensors, qconfig, target="model", experts=None) -> ExpertLayer:
    """``projections``: [(name, in_dims)] in record order; ``experts``: the
    expert count the model has (None: not checked)."""
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
            if experts is not None and info.shape[0] != experts:
                raise Refusal(f"{info.name} has {info.shape[0]} experts, the model config.json builds "
                              f"has {experts}: the config does not belong to these weights")
            specs.append((proj, t, info.dtype, list(info.shape[1:]), info.itemsize, info.shape[0]))
            sources.append(info)
    try:
        layout = plan_layer(layer, module, specs, quant)
    except ManifestError as e:
        raise Refusal(str(e)) from None
    return ExpertLayer(layout, sources, target)


def plan(src: Path, config: dict, tensors=None):
    """(expert layers, resident tensors, mtp resident tensors); raises Refusal."""
    tensors = read_tensors(src) if tensors is None else tensors
    check_layer_count(src, config, tensors)
    model = build_model(config)
    mods = expert_modules(model)
    if not mods:
        raise Refusal(f"{src} has no MoE layers (no SwitchGLU / SwitchMLP modules in its {config['model_type']} model)")
    check_model_layers(src, model, tensors)
    qconfig = config.get("quantization", config.get("quantization_config")) or {}
    layers = []
    for layer, path, projs in mods:
        projections = [(name, m.input_dims if hasattr(m, "input_dims") else m.weight.shape[-1]) for name, m in projs]
        experts = projs[0][1].weight.shape[0] if projs else None
        layers.append(plan_expert_layer(layer, path, projections, tensors, qconfig, experts=experts))
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
            key=layer_index,
        )
        for prefix in prefixes:
            layers.append(
                plan_expert_layer(n_layers + layer_index(prefix), prefix, proj_dims, mtensors, qconfig, "mtp")
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
                fds[s.file] = st.open_regular(s.file)
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
    if len(layout.checksums) != layout.num_experts:
        return False
    try:
        fd = open_inside(dst, layout.file)  # a regular file inside dst, else rewritten
    except (OSError, ManifestError):
        return False
    try:
        if os.fstat(fd).st_size < layout.num_experts * layout.stride:
            return False
        for e in range(layout.num_experts):
            if not verify_record(layout, e, os.pread(fd, layout.record_bytes, e * layout.stride)):
                return False
    finally:
        os.close(fd)
    return True


def previous_layouts(dst: Path, source: dict):
    """(layouts with checksums from an earlier, possibly interrupted, run
    into ``dst`` that may be kept, why none may be or None): records made
    from another source, or from one not recorded, are never kept."""
    for name in (MANIFEST_NAME, PARTIAL_MANIFEST):
        try:
            m = Manifest.load(dst, name)
        except (OSError, ManifestError):
            continue
        if m.source is None:
            return {}, "its manifest does not say what its records were made from (an older prep)"
        if m.source["fingerprint"] != source["fingerprint"]:
            other = "another source" if m.source["path"] != source["path"] else \
                f"{m.source['path']} as it was before it changed"
            return {}, f"its records were made from {other}"
        return {l.layer: l for l in m.layers}, None
    return {}, None


SAMPLES, SAMPLE_BYTES, HEAD_BYTES = 16, 4096, 1 << 20


def source_fingerprint(src: Path, options: dict) -> str:
    """What --resume compares to keep a record: each source file's name,
    size and modification time, its first MiB (the safetensors header) and
    16 samples of 4 KiB spread over it, and the conversion's options. A
    folder of another checkpoint, or the same path rewritten, differs."""
    h = xxhash.xxh3_128()
    h.update(json.dumps(options, sort_keys=True).encode())
    files = sorted(src.glob("model*.safetensors")) + [src / n for n in ("mtp.safetensors", "config.json")]
    for f in files:
        if not f.exists():
            continue
        try:
            fd = st.open_regular(f)
        except st.SafetensorsError as e:
            raise Refusal(str(e)) from None
        try:
            info = os.fstat(fd)
            h.update(f"{f.name}\0{info.st_size}\0{info.st_mtime_ns}\0".encode())
            h.update(os.pread(fd, HEAD_BYTES, 0))
            for i in range(SAMPLES):
                h.update(os.pread(fd, SAMPLE_BYTES, info.st_size * i // SAMPLES))
        finally:
            os.close(fd)
    return h.hexdigest()


def same_layout(a: LayerLayout, b: LayerLayout) -> bool:
    keys = ("layer", "module", "file", "num_experts", "record_bytes", "stride", "segments", "quantization")
    return all(getattr(a, k) == getattr(b, k) for k in keys)


def file_record(path: Path) -> dict:
    """{"file", "bytes", "checksum"} of a file this prep wrote, for the manifest."""
    h = xxhash.xxh3_64()
    n = 0
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
            n += len(chunk)
    return {"file": path.name, "bytes": n, "checksum": h.hexdigest()}


def copy_resident(dst: Path, tensors, stem: str, progress: Progress, shard_bytes: int) -> List[dict]:
    """Write the resident tensors; returns each file's manifest record."""
    if not tensors:
        return []
    shards = st.shard(tensors, shard_bytes)
    names = st.shard_names(len(shards)) if stem == "model" else [f"{stem}.safetensors"] * len(shards)
    if stem != "model" and len(shards) > 1:
        shards, names = [tensors], [f"{stem}.safetensors"]
    records = []
    for shard, name in zip(shards, names):
        tmp = dst / (name + ".tmp")
        try:
            sums = st.write_file(tmp, shard, {"format": "mlx"}, on_bytes=lambda n: progress.add(n, name[:12]))
            os.replace(tmp, dst / name)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        records.append({"file": name, **sums})
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.nbytes for t in tensors)},
            "weight_map": {t.name: n for shard, n in zip(shards, names) for t in shard},
        }
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        records.append(file_record(dst / "model.safetensors.index.json"))
    return records


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
        tmp = dst / (p.name + ".tmp")
        try:
            shutil.copyfile(p, tmp)
            os.replace(tmp, dst / p.name)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
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


def check_dst(src: Path, dst: Path) -> None:
    s, d = src.resolve(), dst.resolve()
    if d == s or s in d.parents or d in s.parents:
        raise Refusal(f"--out {dst} overlaps the source folder {src}")
    if dst.exists() and not dst.is_dir():
        raise Refusal(f"{dst} exists and is not a directory")


def check_dst_empty(dst: Path, force: bool, resume: bool) -> None:
    if dst.is_dir() and any(dst.iterdir()) and not (force or resume):
        raise Refusal(f"{dst} exists and is not empty (use --force to replace it or --resume to continue)")


class OutLock:
    """One prep at a time into a folder: an flock on ``.DST.prep-lock`` beside
    it (beside, not inside: --force replaces the folder, and the lock must
    outlive that). The file holds the holder's pid and goes with the lock.
    Folders above DST that it makes are removed again if DST is not made."""

    def __init__(self, dst: Path):
        self.dst = Path(os.path.abspath(dst))  # "out/." and "out" are one folder
        self.path = self.dst.parent / f".{self.dst.name}.prep-lock"
        self.fd = None
        self.made: List[Path] = []

    def __enter__(self):
        self.key = os.path.abspath(self.path)
        if self.key in _HELD:  # this process holds it already (main, then prep)
            self.fd = None
            return self
        self.made = [p for p in self.dst.absolute().parents if not p.exists()]
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._lock_file()
        except BaseException:
            self._remove_made()
            raise
        return self

    def _lock_file(self):
        def opener():
            try:
                return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            except OSError as e:
                if e.errno in (errno.EACCES, errno.EROFS, errno.EPERM) and self.dst.is_dir():
                    raise _NoLockFile from None  # a folder whose parent we may not write in
                if e.errno == errno.ELOOP:
                    raise Refusal(f"{self.path} is a symbolic link, not infer prep's lock file") from None
                # where --out cannot be made either: the user's path, not the lock's
                raise OSError(e.errno, e.strerror, str(self.dst)) from None

        try:
            self.fd = lock_pid_file(self.path, opener)
        except _NoLockFile:
            return self._lock_folder()
        except BlockingIOError:
            raise Refusal(self._busy(str(read_pid(self.path) or ""))) from None
        _HELD.add(self.key)

    def _lock_folder(self):
        fd = os.open(self.dst, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise Refusal(self._busy("")) from None
        self.fd, self.path = fd, None
        _HELD.add(self.key)

    def _busy(self, holder: str) -> str:
        who = f" (pid {holder})" if holder.isdigit() else ""
        return f"another infer prep{who} is writing {self.dst}; wait for it to end, then run this again"

    def _remove_made(self):
        for p in self.made:  # deepest first; one that holds something stays
            try:
                p.rmdir()
            except OSError:
                break

    def __exit__(self, *exc):
        if self.fd is None:
            return
        _HELD.discard(self.key)
        if self.path is not None:
            self.path.unlink(missing_ok=True)
        os.close(self.fd)
        self._remove_made()


_HELD = set()  # lock files this process holds


class _NoLockFile(Exception):
    """The lock file cannot be made beside --out: the folder itself is locked."""


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
    ``dtype`` apply to those only. Interrupted, the folder is left
    resumable if a layer was written, else as it was (a folder it made is
    removed). One prep at a time writes ``dst`` (OutLock)."""
    src, dst = Path(src), Path(dst)
    config = load_config(src)
    check_dst(src, dst)
    with OutLock(dst):
        check_dst_empty(dst, force, resume)
        sweep_staging(dst)  # of any prep into dst killed before it could clean up
        if dst.is_dir() and any(dst.iterdir()) and force and not resume:
            # the folder being replaced stays whole until its replacement is
            staging = dst.parent / f".{dst.name}.prep-{os.getpid()}"
            shutil.rmtree(staging, ignore_errors=True)
            try:
                m = _write(src, staging, config, False, progress, shard_bytes, quant, dtype)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            old = dst.parent / f".{dst.name}.old-{os.getpid()}"
            os.replace(dst, old)
            os.replace(staging, dst)
            shutil.rmtree(old)
        else:
            m = _write(src, dst, config, resume, progress, shard_bytes, quant, dtype)
        return m


def _save_partial(dst: Path, model_type: str, layers, source: dict) -> None:
    """The progress record --resume continues from; manifest.json comes last."""
    tmp = dst / (PARTIAL_MANIFEST + ".tmp")
    tmp.write_text(Manifest(model_type=model_type, layers=layers, source=source).to_json())
    os.replace(tmp, dst / PARTIAL_MANIFEST)


def _write(src, dst, config, resume, progress, shard_bytes, quant, dtype) -> Manifest:
    from infer.prep import convert as prep_convert

    tensors = read_tensors(src)
    check_layer_count(src, config, tensors)  # before mlx-lm builds anything per layer
    converted = None
    if prep_convert.is_published_layout(src, config, tensors):
        import mlx_lm

        quant = prep_convert.Quantization() if quant is None else quant
        options = {"layout": "hf", "quant": quant and vars(quant), "dtype": dtype, "mlx_lm": mlx_lm.__version__}
        layers, resident, converted = prep_convert.convert(src, config, quant or None, dtype)
        mtp_resident = []
    else:
        if quant is not None or dtype is not None:
            raise Refusal(f"{src} is already converted by mlx-lm; its dtype and quantization are kept "
                          "(--q-bits, --q-group-size, --q-mode, --no-quantize and --dtype apply to "
                          "folders as Hugging Face publishes them)")
        options = {"layout": "mlx"}
        layers, resident, mtp_resident = plan(src, config, tensors)
    source = {"path": str(src.resolve()), "fingerprint": source_fingerprint(src, options)}

    previous, why = previous_layouts(dst, source) if resume and dst.is_dir() else ({}, None)
    made = not dst.exists()
    was_empty = not made and not any(dst.iterdir())
    dst.mkdir(exist_ok=True)
    manifest = Manifest(model_type=config["model_type"], layers=[l.layout for l in layers], source=source)
    done: List[LayerLayout] = []
    try:
        # the folder says what it is from here on: unfinished until manifest.json
        _save_partial(dst, manifest.model_type, list(previous.values()), source)
        (dst / MANIFEST_NAME).unlink(missing_ok=True)

        total = sum(l.layout.record_bytes * l.layout.num_experts for l in layers)
        total += sum(t.nbytes for t in resident) + sum(t.nbytes for t in mtp_resident)
        bar = Progress(total, progress)
        skipped = 0
        for el in layers:
            old = previous.pop(el.layout.layer, None)
            if old is not None and same_layout(old, el.layout) and blob_verifies(dst, old):
                el.layout.checksums = old.checksums
                skipped += 1
                bar.add(el.layout.record_bytes * el.layout.num_experts, f"layer {el.layout.layer} ok")
            else:
                write_blob(dst, el, bar)
            done.append(el.layout)
            # layers not reached yet stay keepable by a later --resume
            _save_partial(dst, manifest.model_type, done + list(previous.values()), source)

        files = copy_resident(dst, resident, "model", bar, shard_bytes)
        if mtp_resident:
            files += copy_resident(dst, mtp_resident, "mtp", bar, shard_bytes)
        if converted is not None:
            from mlx_lm.utils import save_config

            side = copy_side_files(src, dst, skip=("config.json",))
            save_config(converted, dst / "config.json")
            side.append("config.json")
        else:
            side = copy_side_files(src, dst)
        files += [file_record(dst / name) for name in side]
        bar.end()
        manifest.files = sorted(files, key=lambda f: f["file"])
        remove_stale(dst, {l.file for l in manifest.layers} | {f["file"] for f in files}
                     | {MANIFEST_NAME, PARTIAL_MANIFEST})
        manifest.save(dst)
        (dst / PARTIAL_MANIFEST).unlink(missing_ok=True)
    except BaseException:
        if not done and (made or was_empty):  # nothing worth resuming: leave it as it was
            if made:
                shutil.rmtree(dst, ignore_errors=True)
            else:
                for p in dst.iterdir():
                    shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        raise
    manifest.skipped = skipped  # for the summary line
    manifest.not_kept = why
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
            if a.calibrate.exists() and not a.calibrate.is_dir() and \
                    not stat.S_ISREG(a.calibrate.stat().st_mode):
                raise IsADirectoryError  # a FIFO or device: never waited on
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
    caught = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is signal.SIG_DFL:  # a caller's own handler wins
            caught[sig] = signal.signal(sig, _terminate)
    try:
        with OutLock(a.out):
            return _run(a)
    except Refusal as e:
        print(f"infer prep: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Terminated) as e:
        signum = e.args[0] if isinstance(e, Terminated) else signal.SIGINT
        what = {signal.SIGTERM: "terminated", signal.SIGHUP: "hung up"}.get(signum, "interrupted")
        try:  # a closed terminal may refuse the line
            print(f"\ninfer prep: {what}; {left_behind(a)}", file=sys.stderr)
        except OSError:
            pass
        return 128 + signum
    except OSError as e:  # e.g. a full disk: one line, and what the folder is now
        where = f"{e.filename}: " if e.filename else ""
        left = left_behind(a)
        more = f"; {left}" if "--resume" in left else ""
        print(f"infer prep: {where}{e.strerror or e}{more}", file=sys.stderr)
        return 1
    finally:
        for sig, old in caught.items():
            signal.signal(sig, old)


class Terminated(BaseException):
    """SIGTERM or SIGHUP: unwinds like Ctrl-C, so the folder is left as
    an interrupted prep leaves it."""


def _terminate(signum, frame):
    raise Terminated(signum)


def left_behind(a) -> str:
    """What an interrupted or failed prep left in --out, with the next step."""
    out = a.out
    if getattr(a, "finished", False):
        return f"{out} is whole; its calibration (--calibrate) was not written"
    try:
        partial = Manifest.load(out, PARTIAL_MANIFEST)
    except (OSError, ManifestError):
        partial = None
    if partial is not None and not (out / MANIFEST_NAME).exists():
        return (f"{out} is unfinished ({len(partial.layers)} MoE layers written): "
                f"infer prep --model {a.model} --out {out} --resume finishes it")
    if (out / MANIFEST_NAME).exists():
        return f"{out} is as it was"
    return "nothing was written" if not out.exists() or not any(out.iterdir()) else f"{out} is as it was"


def _run(a) -> int:
    t0 = time.time()
    m = prep(a.model, a.out, a.force, a.resume, progress=not a.no_progress,
             quant=quant_from_args(a), dtype=a.dtype)
    a.finished = True
    experts = sum(l.stride * l.num_experts for l in m.layers)
    resident = sum(p.stat().st_size for p in a.out.glob("*.safetensors"))
    kept = ""
    if a.resume:
        kept = f" ({m.skipped} kept by --resume{': ' + m.not_kept if m.not_kept else ''})"
    print(
        f"wrote {a.out}: {len(m.layers)} MoE layers{kept}, "
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
