"""`infer verify DST`: re-read every expert record of a prep folder and check it."""

import os
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

from shared.blob import LayerLayout, Manifest, ManifestError, record_checksum

from infer.args import Parser, add_version


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
            if len(data) < layout.record_bytes or size < start + layout.stride:
                yield e, f"short record (the blob has {size} of {layout.num_experts * layout.stride} bytes)"
            elif record_checksum(layout.layer, e, data) != layout.checksum(e):
                yield e, "checksum mismatch"
    finally:
        os.close(fd)


def ranges(ids: List[int], limit: int = 12) -> str:
    """'2, 5, 30-31': the first ``limit`` runs of sorted ids, then how many more."""
    runs = []
    for x in ids:
        if runs and runs[-1][1] == x - 1:
            runs[-1][1] = x
        else:
            runs.append([x, x])
    shown = runs[:limit]
    more = len(ids) - sum(b - a + 1 for a, b in shown)
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in shown)
    return text + (f" and {more} more" if more else "")


def summary(layout: LayerLayout, bad: List[Tuple[int, str]]) -> str:
    """One line for a blob with bad records, grouped by reason."""
    by_reason: Dict[str, List[int]] = {}
    for e, reason in bad:
        by_reason.setdefault(reason, []).append(e)
    n = layout.num_experts
    parts = []
    for reason, ids in by_reason.items():
        which = "all records" if len(ids) == n else f"expert{'s' if len(ids) > 1 else ''} {ranges(ids)}"
        parts.append(f"{reason}: {which}")
    return f"layer {layout.layer} ({layout.file}): {len(bad)} of {n} records bad; " + "; ".join(parts)


def main(argv) -> int:
    ap = Parser(prog="infer verify", description="check every expert record of a prep folder "
                "(one line per blob with bad records; exit status 1 if any)")
    ap.add_argument("folder", type=Path, help="prep folder (written by `infer prep`)")
    add_version(ap)
    a = ap.parse_args(argv)
    try:
        manifest = Manifest.load(a.folder)
    except ManifestError as e:
        print(f"infer verify: {e}", file=sys.stderr)
        return 2
    bad = records = 0
    for layout in manifest.layers:
        found = list(check_layer(a.folder, layout))
        if found:
            print(summary(layout, found))
            bad += len(found)
        records += layout.num_experts
    status = "OK" if not bad else f"{bad} bad"
    print(f"verified {len(manifest.layers)} layers, {records} records: {status}")
    return 1 if bad else 0
