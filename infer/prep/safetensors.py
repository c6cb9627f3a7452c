"""Raw safetensors access: read tensor bytes by offset, write files by streaming.

Working on bytes keeps `infer prep` byte-exact for every dtype (bfloat16
included) and its memory bounded: nothing is decoded or held whole.
"""

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Tuple

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


def read_header(path) -> Tuple[Dict[str, TensorInfo], Dict[str, str]]:
    """Tensors of a safetensors file (by name) and its metadata."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise SafetensorsError(f"{path}: not a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > 100 << 20:
            raise SafetensorsError(f"{path}: header of {n} bytes")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise SafetensorsError(f"{path}: bad header ({e})") from None
        size = os.fstat(f.fileno()).st_size
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: bad header (not a JSON object)")
    base = 8 + n
    meta = header.pop("__metadata__", None) or {}
    out = {}
    for name, d in header.items():
        if d["dtype"] not in DTYPES:
            raise SafetensorsError(f"{path}: {name} has unknown dtype {d['dtype']}")
        b, e = d["data_offsets"]
        if base + e > size:  # found now, before anything is written, not midway
            raise SafetensorsError(f"{path} is truncated: {name} ends at byte {base + e} of {size}")
        out[name] = TensorInfo(name, path, d["dtype"], tuple(d["shape"]), base + b, e - b)
    return out, meta


def read_bytes(info: TensorInfo, fd: int, begin: int = 0, length: int = None) -> bytes:
    length = info.nbytes - begin if length is None else length
    data = os.pread(fd, length, info.start + begin)
    if len(data) != length:
        raise SafetensorsError(f"{info.file}: {info.name} is truncated")
    return data


def write_file(path, tensors: List[TensorInfo], metadata=None, chunk=16 << 20, on_bytes=None) -> None:
    """Write ``tensors`` (copied from their source files, or ``ArrayTensor``s
    evaluated one at a time) into one new safetensors file, reading at most
    ``chunk`` bytes of a file at a time."""
    header = {}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.tag, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    if metadata:
        header["__metadata__"] = dict(metadata)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    fds = {}
    try:
        with open(path, "wb") as out:
            out.write(struct.pack("<Q", len(raw)))
            out.write(raw)
            for t in tensors:
                if isinstance(t, ArrayTensor):
                    data = t.take_bytes()
                    if len(data) != t.nbytes:
                        raise SafetensorsError(f"{t.name}: {len(data)} bytes, expected {t.nbytes}")
                    for begin in range(0, t.nbytes, chunk):
                        out.write(data[begin : begin + chunk])
                        if on_bytes:
                            on_bytes(min(chunk, t.nbytes - begin))
                    del data
                    continue
                fd = fds.get(t.file)
                if fd is None:
                    fd = fds[t.file] = os.open(t.file, os.O_RDONLY)
                for begin in range(0, t.nbytes, chunk):
                    data = read_bytes(t, fd, begin, min(chunk, t.nbytes - begin))
                    out.write(data)
                    if on_bytes:
                        on_bytes(len(data))
    finally:
        for fd in fds.values():
            os.close(fd)


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
