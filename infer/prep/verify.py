"""`infer verify DST`: re-read every expert record of a prep folder and every
other file prep wrote (resident weights, config, tokenizer), and check them."""

import os
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import xxhash

from shared.blob import LayerLayout, Manifest, ManifestError, open_inside, record_checksum

from infer.args import Parser, add_version


def check_layer(folder: Path, layout: LayerLayout) -> Iterator[Tuple[int, str]]:
    """(expert, reason) for every bad record of one layer."""
    if len(layout.checksums) != layout.num_experts:
        for e in range(layout.num_experts):
            yield e, f"manifest has {len(layout.checksums)} checksums for {layout.num_experts} experts"
        return
    try:
        fd = open_inside(folder, layout.file)  # a FIFO or device: ManifestError, never waited on
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


def _digest(fd: int, start: int, length: int) -> str:
    h = xxhash.xxh3_64()
    while length > 0:
        chunk = os.pread(fd, min(length, 16 << 20), start)
        if not chunk:
            break
        h.update(chunk)
        start += len(chunk)
        length -= len(chunk)
    return h.hexdigest()


def check_file(folder: Path, entry: dict) -> List[str]:
    """What is wrong with one file the manifest lists (resident weights,
    config, tokenizer): nothing, or reasons naming the tensors that changed."""
    name = entry["file"]
    try:
        fd = open_inside(folder, name)
    except FileNotFoundError:
        return ["missing"]
    try:
        size = os.fstat(fd).st_size
        if size == entry["bytes"] and _digest(fd, 0, size) == entry["checksum"]:
            return []
        tensors = entry.get("tensors")
        if not tensors:
            return [f"{size} bytes, prep wrote {entry['bytes']}" if size != entry["bytes"]
                    else "checksum mismatch"]
        from infer.prep.safetensors import SafetensorsError, read_header

        try:
            found = read_header(folder / name)[0]
        except (OSError, SafetensorsError) as e:
            return [f"its header does not read ({e})"]
        bad = sorted(n for n in tensors if n not in found or
                     _digest(fd, found[n].start, found[n].nbytes) != tensors[n])
        extra = sorted(set(found) - set(tensors))
        why = []
        if bad:
            shown = ", ".join(bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
            why.append(f"tensor{'s' if len(bad) > 1 else ''} {shown} changed")
        if extra:
            why.append(f"tensors prep did not write: {', '.join(extra[:8])}")
        return why or ["its header changed (the tensors' bytes are as written)"]
    finally:
        os.close(fd)


def main(argv) -> int:
    ap = Parser(prog="infer verify", description="check every expert record of a prep folder and "
                "every other file infer prep wrote (resident weights, config, tokenizer): one line "
                "per damaged blob or file; exit status 1 if any")
    ap.add_argument("folder", type=Path, help="prep folder (written by `infer prep`)")
    add_version(ap)
    a = ap.parse_args(argv)
    try:
        manifest = Manifest.load(a.folder)
        # what is not a regular file inside the folder is never read: one line, exit 2
        for name in [l.file for l in manifest.layers] + [f["file"] for f in manifest.files or []]:
            try:
                os.close(open_inside(a.folder, name))
            except FileNotFoundError:
                pass  # reported below, with the layer or file it leaves out
    except ManifestError as e:
        print(f"infer verify: {e}", file=sys.stderr)
        return 2
    try:
        bad = records = bad_files = 0
        for layout in manifest.layers:
            found = list(check_layer(a.folder, layout))
            if found:
                print(summary(layout, found))
                bad += len(found)
            records += layout.num_experts
        if manifest.files is None:
            print("resident weights: no checksums in this manifest (written before infer prep recorded "
                  "them): only the expert records were checked; infer prep --resume adds them")
        for entry in manifest.files or []:
            why = check_file(a.folder, entry)
            if why:
                print(f"{entry['file']}: {'; '.join(why)}")
                bad_files += 1
    except ManifestError as e:  # replaced by a FIFO or a link out while we read
        print(f"infer verify: {e}", file=sys.stderr)
        return 2
    files = f", {len(manifest.files)} files" if manifest.files is not None else ""
    problems = [f"{bad} bad"] if bad else []
    problems += [f"{bad_files} bad file{'s' if bad_files > 1 else ''}"] if bad_files else []
    status = ", ".join(problems) or "OK"
    fix = (f"; to repair: infer prep --model {manifest.source_path()} --out {a.folder} --resume "
           "(rewrites what is damaged)") if problems else ""
    print(f"verified {len(manifest.layers)} layers, {records} records{files}: {status}{fix}")
    return 1 if problems else 0
