"""The on-disk expert format: blob files, records and ``manifest.json``.

Every MoE layer's experts live in one blob file, one fixed-stride record per
expert, so one aligned read returns one whole expert. A record is the
concatenation of the expert's slice of each expert tensor (its segments), in
manifest order, each segment starting on a ``SEGMENT_ALIGN`` boundary; the
stride is the record size rounded up to ``RECORD_ALIGN`` for O_DIRECT.

Each record has an xxh3-64 checksum seeded with its identity (layer, expert),
so a record written in the wrong place fails its check as surely as a flipped
bit does.
"""

import hashlib
import json
import os
import re
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePath
from typing import Dict, List, Optional, Tuple

import numpy as np
import xxhash

MANIFEST_NAME = "manifest.json"
# an unfinished prep's progress record (`infer prep --resume` continues from it)
PARTIAL_MANIFEST_NAME = "manifest.partial.json"
MANIFEST_FORMAT = "iod-experts"
MANIFEST_VERSION = 1
RECORD_ALIGN = 4096
SEGMENT_ALIGN = 64
# the largest manifest read (a 512-expert, 94-layer model's is ~2 MiB): a
# daemon reading a folder a session names never reads without bound
MANIFEST_MAX_BYTES = 64 << 20
# A shared daemon parses the manifest a session names inside its loop, so a
# manifest's cost must be bounded and linear in its size: at most this many
# values (commas, counted before parsing: every value past the first costs
# one; ~40 MB of Python objects at most), layers (a blob file opened each)
# and dimensions per segment shape (real ones have 1 or 2).
MANIFEST_MAX_VALUES = 1 << 20
MANIFEST_MAX_LAYERS = 1024
SHAPE_MAX_DIMS = 8

# dtype name (as MLX spells it) -> numpy dtype of the raw bytes.
# bfloat16 has no numpy type; its bytes travel as uint16.
NUMPY_DTYPES = {
    "uint32": np.uint32,
    "uint16": np.uint16,
    "uint8": np.uint8,
    "int8": np.int8,
    "int32": np.int32,
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": np.uint16,
}


class ManifestError(ValueError):
    pass


def round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def record_checksum(layer: int, expert: int, data) -> int:
    """xxh3-64 of a record's bytes, seeded with its (layer, expert) identity."""
    return xxhash.xxh3_64_intdigest(data, seed=(layer << 32) | expert)


@dataclass
class Segment:
    projection: str  # e.g. "gate_proj", "fc1"
    tensor: str  # "weight", "scales", "biases" or "bias"
    dtype: str
    shape: List[int]  # of one expert's slice
    offset: int
    nbytes: int


@dataclass
class LayerLayout:
    layer: int  # blob identity: decoder layer index, MTP layers after them
    module: str  # path of the expert module in the mlx-lm model
    file: str
    num_experts: int
    record_bytes: int
    stride: int
    segments: List[Segment]
    # per projection: {"mode", "bits", "group_size"}; absent when unquantized
    quantization: Dict[str, Dict[str, object]] = field(default_factory=dict)
    checksums: List[str] = field(default_factory=list)

    @property
    def projections(self) -> List[str]:
        seen = []
        for s in self.segments:
            if s.projection not in seen:
                seen.append(s.projection)
        return seen

    def checksum(self, expert: int) -> int:
        return int(self.checksums[expert], 16)

    def split(self, record) -> Dict[Tuple[str, str], np.ndarray]:
        """Views of a record's segments as numpy arrays (raw dtypes)."""
        buf = memoryview(record)
        out = {}
        for s in self.segments:
            a = np.frombuffer(buf[s.offset : s.offset + s.nbytes], NUMPY_DTYPES[s.dtype])
            out[(s.projection, s.tensor)] = a.reshape(s.shape)
        return out


def plan_layer(layer: int, module: str, tensors, quantization=None) -> LayerLayout:
    """Lay out a record from ``[(projection, tensor, dtype, shape_per_expert,
    itemsize, num_experts)]`` in the given order."""
    offset = 0
    segments = []
    num_experts = None
    for projection, tensor, dtype, shape, itemsize, n in tensors:
        if num_experts is None:
            num_experts = n
        elif n != num_experts:
            raise ManifestError(f"layer {layer}: {projection}.{tensor} has {n} experts")
        nbytes = int(np.prod(shape)) * itemsize
        offset = round_up(offset, SEGMENT_ALIGN)
        segments.append(Segment(projection, tensor, dtype, list(shape), offset, nbytes))
        offset += nbytes
    return LayerLayout(
        layer=layer,
        module=module,
        file=f"layer{layer:03d}.blob",
        num_experts=num_experts,
        record_bytes=offset,
        stride=round_up(offset, RECORD_ALIGN),
        segments=segments,
        quantization=dict(quantization or {}),
    )


@dataclass
class Manifest:
    model_type: str
    layers: List[LayerLayout]
    format: str = MANIFEST_FORMAT
    version: int = MANIFEST_VERSION
    checksum: str = "xxh3_64"
    record_align: int = RECORD_ALIGN
    # what the records were made from: {"path", "fingerprint"} (None: not
    # recorded, a folder written before prep recorded it)
    source: Optional[Dict[str, str]] = None
    # every other file prep wrote: [{"file", "bytes", "checksum", "tensors"?}]
    # (None: not recorded); see docs/format.md
    files: Optional[List[Dict[str, object]]] = None

    def source_path(self) -> str:
        """The source folder to name in a next step (SRC if unknown)."""
        return self.source["path"] if self.source else "SRC"

    def layer(self, layer: int) -> LayerLayout:
        for l in self.layers:
            if l.layer == layer:
                return l
        raise KeyError(layer)

    @property
    def max_stride(self) -> int:
        return max(l.stride for l in self.layers)

    @property
    def expert_bytes(self) -> int:
        return sum(l.stride * l.num_experts for l in self.layers)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    def save(self, folder) -> None:
        """Write atomically: a reader never sees half a manifest."""
        path = Path(folder) / MANIFEST_NAME
        tmp = path.with_suffix(".tmp")
        tmp.write_text(self.to_json())
        os.replace(tmp, path)

    @classmethod
    def from_dict(cls, d) -> "Manifest":
        if not isinstance(d, dict) or d.get("format") != MANIFEST_FORMAT:
            raise ManifestError("not an iod expert manifest")
        if d.get("version") != MANIFEST_VERSION:
            raise ManifestError(
                f"manifest version {d.get('version')} is not the supported "
                f"version {MANIFEST_VERSION}; run `infer prep` again"
            )
        try:
            layers = []
            for l in d["layers"]:
                l = dict(l)
                l["segments"] = [Segment(**s) for s in l["segments"]]
                layers.append(LayerLayout(**l))
            m = cls(
                model_type=d["model_type"],
                layers=layers,
                format=d["format"],
                version=d["version"],
                checksum=d["checksum"],
                record_align=d["record_align"],
                source=d.get("source"),
                files=d.get("files"),
            )
        except (KeyError, TypeError) as e:
            raise ManifestError(f"malformed manifest: {e}") from None
        m.check()
        return m

    def check(self) -> None:
        """Every field of the right type and in range, so that nothing that
        reads a manifest (a shared daemon above all) meets a value it cannot
        use. Checksums may be fewer than the experts (an interrupted prep's
        partial manifest); ``open_blob`` asks for all of them."""
        if not isinstance(self.model_type, str) or not isinstance(self.layers, list):
            raise ManifestError("malformed manifest: model_type or layers")
        if len(self.layers) > MANIFEST_MAX_LAYERS:
            raise ManifestError(f"malformed manifest: {len(self.layers)} layers, more than "
                                f"{MANIFEST_MAX_LAYERS}")
        seen = set()
        for l in self.layers:
            _check_layer(l)
            if l.layer in seen:
                raise ManifestError(f"malformed manifest: layer {l.layer} appears twice")
            seen.add(l.layer)
        s = self.source
        if s is not None and not (isinstance(s, dict) and all(isinstance(s.get(k), str)
                                                              for k in ("path", "fingerprint"))):
            raise ManifestError("malformed manifest: source is not {path, fingerprint}")
        if self.files is not None:
            if not isinstance(self.files, list):
                raise ManifestError("malformed manifest: files is not a list")
            for f in self.files:
                _check_file(f)

    @classmethod
    def load(cls, folder, name: str = MANIFEST_NAME) -> "Manifest":
        return cls.load_with_hash(folder, name)[0]

    @classmethod
    def load_with_hash(cls, folder, name: str = MANIFEST_NAME) -> Tuple["Manifest", str]:
        """The manifest (or ``name``: the partial one) and its hash, from one read of the file."""
        data = read_manifest_bytes(folder, name)
        if data.count(b",") >= MANIFEST_MAX_VALUES:
            raise ManifestError(f"{Path(folder) / MANIFEST_NAME}: more than "
                                f"{MANIFEST_MAX_VALUES} values, the most a manifest may have")
        try:
            d = json.loads(data)
        except (ValueError, RecursionError) as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ManifestError(f"cannot read {Path(folder) / MANIFEST_NAME}: {why}") from None
        try:
            return cls.from_dict(d), _hash(data)
        except ManifestError:
            raise
        except (ValueError, AttributeError, RecursionError) as e:
            raise ManifestError(f"malformed manifest: {e}") from None


def _hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def manifest_hash(folder) -> str:
    """Identity of a prep folder's expert format and contents."""
    return _hash(read_manifest_bytes(folder))


# ---- the prep folder is a boundary: files a session names are read with care ----


def open_inside(folder, name, flags: int = 0) -> int:
    """Open ``name`` (a relative path from a manifest) under ``folder`` for
    reading. It must stay inside the folder once resolved and be a regular
    file: the open never blocks (O_NONBLOCK: a FIFO or device is refused,
    not waited on) and never follows a symlink out. Raises ManifestError."""
    if not isinstance(name, str) or not name or "\x00" in name or os.path.isabs(name) \
            or ".." in PurePath(name).parts:
        raise ManifestError(f"{folder}: file name {name!r} is not a plain relative path")
    root = Path(folder).resolve()
    path = (root / name).resolve()
    if not path.is_relative_to(root):
        raise ManifestError(f"{root / name} resolves to {path}, outside the prep folder")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC | flags)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise ManifestError(f"{path}: {e.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ManifestError(f"{path} is not a regular file")
    os.set_blocking(fd, True)
    return fd


def read_manifest_bytes(folder, name: str = MANIFEST_NAME) -> bytes:
    """A manifest file's bytes, at most MANIFEST_MAX_BYTES (see open_inside)."""
    try:
        fd = open_inside(folder, name)
    except FileNotFoundError:
        if name == MANIFEST_NAME:
            raise ManifestError(_no_manifest(folder)) from None
        raise ManifestError(f"{folder} has no {name}") from None
    try:
        size = os.fstat(fd).st_size
        if size > MANIFEST_MAX_BYTES:
            raise ManifestError(f"{Path(folder) / name}: {size} bytes, more than "
                                f"the {MANIFEST_MAX_BYTES >> 20} MiB a manifest may have")
        chunks, n = [], 0
        while n <= MANIFEST_MAX_BYTES:  # the file may grow while we read
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
            n += len(chunk)
    finally:
        os.close(fd)
    if n > MANIFEST_MAX_BYTES:
        raise ManifestError(f"{Path(folder) / name}: more than "
                            f"{MANIFEST_MAX_BYTES >> 20} MiB")
    return b"".join(chunks)


def _no_manifest(folder) -> str:
    """Why ``folder`` has no manifest.json, with the next step when it is an
    unfinished prep (interrupted, or being written now)."""
    try:
        partial = Manifest.load(folder, PARTIAL_MANIFEST_NAME)
    except (ManifestError, OSError):
        return f"{folder} is not a prep folder (no {MANIFEST_NAME})"
    return (f"{folder} is an unfinished prep ({len(partial.layers)} MoE layers written, no "
            f"{MANIFEST_NAME}): infer prep --model {partial.source_path()} --out {folder} "
            f"--resume finishes it")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


_HEX64 = re.compile(r"[0-9a-fA-F]{1,16}")


def _is_hex64(x) -> bool:
    return isinstance(x, str) and _HEX64.fullmatch(x) is not None


def _elements(shape, limit: int) -> int:
    """The product of ``shape``, or ``limit`` + 1 once it passes ``limit``:
    never a product of big numbers (a 160,000-entry shape took 26 s)."""
    n = 1
    for d in shape:
        n *= d
        if n > limit:
            return limit + 1
    return n


def _check_layer(l: LayerLayout) -> None:
    """One layer's layout is usable: see Manifest.check."""
    def bad(why):
        raise ManifestError(f"malformed manifest: layer {l.layer!r}: {why}")

    # a record's checksum seed is (layer << 32) | expert: both fit 32 bits
    if not _is_int(l.layer) or not 0 <= l.layer < 1 << 31:
        bad("layer index out of range")
    if not isinstance(l.module, str) or not l.module or not isinstance(l.file, str):
        bad("module or file is not a name")
    sizes = (l.num_experts, l.record_bytes, l.stride)
    if not all(_is_int(v) and 0 < v < 1 << 40 for v in sizes) or l.num_experts >= 1 << 31 or \
            l.stride < l.record_bytes or l.stride % RECORD_ALIGN:
        bad(f"impossible layout (experts {l.num_experts!r}, record {l.record_bytes!r} bytes, "
            f"stride {l.stride!r})")
    if not isinstance(l.checksums, list) or len(l.checksums) > l.num_experts or \
            not all(_is_hex64(c) for c in l.checksums):
        bad("checksums are not up to one 64-bit hex string per expert")
    if not isinstance(l.quantization, dict) or not isinstance(l.segments, list) or not l.segments:
        bad("no segments, or quantization is not a mapping")
    for s in l.segments:
        if not (isinstance(s.projection, str) and isinstance(s.tensor, str)):
            bad("a segment's projection or tensor is not a name")
        if not isinstance(s.dtype, str) or s.dtype not in NUMPY_DTYPES:
            bad(f"{s.projection}.{s.tensor}: dtype {s.dtype!r} is not one of {', '.join(NUMPY_DTYPES)}")
        if isinstance(s.shape, list) and len(s.shape) > SHAPE_MAX_DIMS:
            bad(f"{s.projection}.{s.tensor}: shape of {len(s.shape)} dimensions, more than "
                f"{SHAPE_MAX_DIMS}")
        if not isinstance(s.shape, list) or not s.shape or \
                not all(_is_int(n) and 0 < n < 1 << 40 for n in s.shape):
            bad(f"{s.projection}.{s.tensor}: shape {s.shape!r}")
        itemsize = np.dtype(NUMPY_DTYPES[s.dtype]).itemsize
        if not _is_int(s.offset) or not _is_int(s.nbytes) or s.offset < 0 or \
                s.nbytes != _elements(s.shape, l.record_bytes) * itemsize or \
                s.offset + s.nbytes > l.record_bytes:
            bad(f"{s.projection}.{s.tensor}: {s.nbytes!r} bytes at {s.offset!r} do not fit "
                f"its shape and a {l.record_bytes}-byte record")


def _check_file(f) -> None:
    """One entry of a manifest's ``files``: see Manifest.check."""
    name = f.get("file") if isinstance(f, dict) else None
    if not isinstance(name, str) or not name or "/" in name or name in (".", "..") or "\x00" in name:
        raise ManifestError(f"malformed manifest: files: {name!r} is not a file name")
    if not _is_int(f.get("bytes")) or f["bytes"] < 0 or not _is_hex64(f.get("checksum")):
        raise ManifestError(f"malformed manifest: files: {name}: bytes or checksum")
    tensors = f.get("tensors", {})
    if not isinstance(tensors, dict) or not all(isinstance(k, str) and _is_hex64(v)
                                                for k, v in tensors.items()):
        raise ManifestError(f"malformed manifest: files: {name}: tensors")


def open_blob(folder, layout: LayerLayout, flags: int = 0) -> int:
    """Open a layer's blob file for the daemon's reads (``flags``: e.g.
    O_DIRECT): inside the folder, a regular file (``open_inside``), long
    enough for every record of the layout, one checksum per expert. Raises
    ManifestError with one line naming the file."""
    l = layout
    if not all(_is_int(x) for x in (l.layer, l.num_experts, l.record_bytes, l.stride)) or \
            l.num_experts < 1 or l.record_bytes < 1 or l.stride < l.record_bytes or \
            l.stride % RECORD_ALIGN or not isinstance(l.checksums, list):
        raise ManifestError(f"layer {l.layer!r}: impossible layout (experts {l.num_experts!r}, "
                            f"record {l.record_bytes!r} bytes, stride {l.stride!r})")
    if len(l.checksums) != l.num_experts:
        raise ManifestError(f"layer {l.layer}: {len(l.checksums)} checksums for "
                            f"{l.num_experts} experts")
    try:
        fd = open_inside(folder, l.file, flags)
    except FileNotFoundError:
        raise ManifestError(f"{Path(folder) / str(l.file)}: no such file") from None
    size = os.fstat(fd).st_size
    need = (l.num_experts - 1) * l.stride + l.record_bytes
    if size < need:
        os.close(fd)
        raise ManifestError(f"{Path(folder) / l.file}: {size} bytes, layout needs {need} "
                            f"(truncated: infer prep --resume rewrites it)")
    return fd


def read_record(folder, layout: LayerLayout, expert: int, fd: Optional[int] = None) -> bytes:
    """Plain buffered read of one record (tools and tests; iod reads its own way)."""
    path = Path(folder) / layout.file
    if fd is None:
        with open(path, "rb") as f:
            return os.pread(f.fileno(), layout.record_bytes, expert * layout.stride)
    return os.pread(fd, layout.record_bytes, expert * layout.stride)


def verify_record(layout: LayerLayout, expert: int, data) -> bool:
    return (
        len(data) >= layout.record_bytes
        and record_checksum(layout.layer, expert, memoryview(data)[: layout.record_bytes])
        == layout.checksum(expert)
    )
