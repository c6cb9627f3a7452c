"""Raw safetensors access: read tensor bytes by offset, write files by streaming.

Working on bytes keeps `infer prep` byte-exact for every dtype (bfloat16
included) and its memory bounded: nothing is decoded or held whole.
"""

import json
import math
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Tuple

import xxhash

# safetensors dtype tag -> (MLX dtype name, itemsize)
DTYPES = {
    "BOOL": ("bool", 1),
    "U8": ("uint8", 1),
    "I8": ("int8", 1),
    "U16": ("uint16", 2),
    "I16": ("int16", 2),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "U32": ("uint32", 4),
    "I32": ("int32", 4),
    "F32": ("float32", 4),
    "U64": ("uint64", 8),
    "I64": ("int64", 8),
    "F64": ("float64", 8),
}
TAGS = {name: tag for tag, (name, _) in DTYPES.items()}


class SafetensorsError(ValueError):
    pass


@dataclass
class TensorInfo:
    name: str
    file: Path
    tag: str  # safetensors dtype tag, e.g. "BF16"
    shape: Tuple[int, ...]
    start: int  # absolute file offset of the first byte
    nbytes: int

    @property
    def dtype(self) -> str:
        return DTYPES[self.tag][0]

    @property
    def itemsize(self) -> int:
        return DTYPES[self.tag][1]


class ArrayTensor:
    """A tensor to write that is not in a file yet: an MLX array (lazy until
    written), evaluated and turned into bytes only when its turn comes."""

    def __init__(self, name: str, array):
        self.name = name
        self.array = array
        self.shape = tuple(array.shape)
        self.nbytes = array.nbytes
        self.tag = TAGS[str(array.dtype).rsplit(".", 1)[-1]]

    def take_bytes(self) -> memoryview:
        """Evaluate, return the raw bytes, and let go of the array."""
        import mlx.core as mx
        import numpy as np

        a, self.array = self.array, None
        if a.dtype == mx.bfloat16:
            a = a.view(mx.uint16)
        return memoryview(np.ascontiguousarray(np.asarray(a))).cast("B")


def open_regular(path) -> int:
    """A read-only descriptor of ``path``, which must be a regular file: the
    open never waits on a FIFO or device (O_NONBLOCK), fstat decides."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise SafetensorsError(f"{path}: {e.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise SafetensorsError(f"{path} is not a regular file")
    os.set_blocking(fd, True)
    return fd


def _whole(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def read_header(path) -> Tuple[Dict[str, TensorInfo], Dict[str, str]]:
    """Tensors of a safetensors file (by name) and its metadata. Every entry
    is checked against the file (types, its bytes match its shape, inside
    the file), so nothing later reads another tensor's bytes as its own."""
    path = Path(path)
    with os.fdopen(open_regular(path), "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise SafetensorsError(f"{path}: not a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > 100 << 20:
            raise SafetensorsError(f"{path}: header of {n} bytes")
        try:
            header = json.loads(f.read(n))
        except (ValueError, RecursionError) as e:
            raise SafetensorsError(f"{path}: bad header ({str(e).splitlines()[0] if str(e) else e})") from None
        size = os.fstat(f.fileno()).st_size
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: bad header (not a JSON object)")
    base = 8 + n
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise SafetensorsError(f"{path}: bad header (__metadata__ is not an object)")
    out = {}
    for name, d in header.items():
        if not isinstance(d, dict):
            raise SafetensorsError(f"{path}: bad header ({name}: {type(d).__name__}, not an object)")
        tag, shape, offsets = d.get("dtype"), d.get("shape"), d.get("data_offsets")
        if not isinstance(tag, str) or tag not in DTYPES:
            raise SafetensorsError(f"{path}: {name} has unknown dtype {tag!r}")
        if not isinstance(shape, list) or not all(_whole(x) for x in shape):
            raise SafetensorsError(f"{path}: {name} has shape {shape!r}, not a list of sizes")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_whole(x) for x in offsets)
                and offsets[0] <= offsets[1]):
            raise SafetensorsError(f"{path}: {name} has data_offsets {offsets!r}")
        b, e = offsets
        need = math.prod(shape) * DTYPES[tag][1]
        if e - b != need:
            raise SafetensorsError(f"{path}: {name} has shape {shape} {tag} ({need} bytes) "
                                   f"but {e - b} bytes of data: the file is damaged (download it again)")
        if base + e > size:  # found now, before anything is written, not midway
            raise SafetensorsError(f"{path} is truncated: {name} ends at byte {base + e} of {size} "
                                   "(download it again)")
        out[name] = TensorInfo(name, path, tag, tuple(shape), base + b, e - b)
    return out, meta


def read_bytes(info: TensorInfo, fd: int, begin: int = 0, length: int = None) -> bytes:
    length = info.nbytes - begin if length is None else length
    data = os.pread(fd, length, info.start + begin)
    if len(data) != length:
        raise SafetensorsError(f"{info.file}: {info.name} is truncated")
    return data


def write_file(path, tensors: List[TensorInfo], metadata=None, chunk=16 << 20, on_bytes=None) -> dict:
    """Write ``tensors`` (copied from their source files, or ``ArrayTensor``s
    evaluated one at a time) into one new safetensors file, reading at most
    ``chunk`` bytes of a file at a time. Returns what was written:
    ``{"bytes", "checksum", "tensors": {name: checksum}}`` (hex xxh3-64 of the
    whole file and of each tensor's bytes), for the manifest."""
    header = {}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.tag, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    if metadata:
        header["__metadata__"] = dict(metadata)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    whole = xxhash.xxh3_64()
    sums = {}
    fds = {}

    def put(out, data, one):
        out.write(data)
        whole.update(data)
        one.update(data)
        if on_bytes:
            on_bytes(len(data))

    try:
        with open(path, "wb") as out:
            head = struct.pack("<Q", len(raw)) + raw
            out.write(head)
            whole.update(head)
            for t in tensors:
                one = xxhash.xxh3_64()
                if isinstance(t, ArrayTensor):
                    data = t.take_bytes()
                    if len(data) != t.nbytes:
                        raise SafetensorsError(f"{t.name}: {len(data)} bytes, expected {t.nbytes}")
                    for begin in range(0, t.nbytes, chunk):
                        put(out, data[begin : begin + chunk], one)
                    del data
                else:
                    fd = fds.get(t.file)
                    if fd is None:
                        fd = fds[t.file] = open_regular(t.file)
                    for begin in range(0, t.nbytes, chunk):
                        put(out, read_bytes(t, fd, begin, min(chunk, t.nbytes - begin)), one)
                sums[t.name] = one.hexdigest()
            out.flush()
            os.fsync(out.fileno())
    finally:
        for fd in fds.values():
            os.close(fd)
    return {"bytes": len(head) + offset, "checksum": whole.hexdigest(), "tensors": sums}


def shard(tensors: Iterable[TensorInfo], max_bytes: int) -> List[List[TensorInfo]]:
    shards: List[List[TensorInfo]] = []
    size = 0
    for t in tensors:
        if not shards or (size + t.nbytes > max_bytes and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def shard_names(n: int) -> List[str]:
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
