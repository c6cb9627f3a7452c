"""`infer verify DST`: re-read every expert record of a prep folder and check it."""

import argparse
import os
import sys
from pathlib import Path
from typing import Iterator, Tuple

from shared.blob import LayerLayout, Manifest, ManifestError, record_checksum


def check_layer(folder: Path, layout: LayerLayout) -> Iterator[Tuple[int, str]]:
    """(expert, reason) for every bad record of one layer."""
    path = folder / layout.file
    if len(layout.checksums) != layout.num_experts:
        for e in range(layout.num_experts):
            yield e, f"manifest has {len(layout.checksums)} checksums for {layout.num_experts} experts"
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        for x in range(layout.num_experts):
            yield x, f"cannot open {layout.file} ({e.strerror})"
        return
    try:
        size = os.fstat(fd).st_size
        for e in range(layout.num_experts):
            start = e * layout.stride
            data = os.pread(fd, layout.record_bytes, start)
            if len(data) < layout.record_bytes:
                yield e, f"short record ({len(data)} of {layout.record_bytes} bytes)"
            elif size < start + layout.stride:
                yield e, f"short record (blob ends {start + layout.stride - size} bytes before the stride)"
            elif record_checksum(layout.layer, e, data) != layout.checksum(e):
                yield e, "checksum mismatch"
    finally:
        os.close(fd)


def main(argv) -> int:
    ap = argparse.ArgumentParser(prog="infer verify", description="check every expert record of a prep folder")
    ap.add_argument("folder", type=Path, help="prep folder (written by `infer prep`)")
    a = ap.parse_args(argv)
    try:
        manifest = Manifest.load(a.folder)
    except ManifestError as e:
        print(f"infer verify: {e}", file=sys.stderr)
        return 2
    bad = records = 0
    for layout in manifest.layers:
        for e, reason in check_layer(a.folder, layout):
            print(f"layer {layout.layer} expert {e}: {reason}")
            bad += 1
        records += layout.num_experts
    status = "OK" if not bad else f"{bad} bad"
    print(f"verified {len(manifest.layers)} layers, {records} records: {status}")
    return 1 if bad else 0
