"""`iod doctor`: measure this machine's disk the way iod reads it.

Cold random reads of one record each, bypassing the page cache (O_DIRECT,
F_NOCACHE on macOS), from ``depth`` threads at once, for queue depths 1 to
32: the curve of bytes/s and latency against depth. It is printed, plotted
(``--plot``) and stored (``shared.disk.profile_path()``: under $IOD_RUN_DIR
when it is set, else the user's), where the daemon
finds it (its reader threads: the depth that reaches the ceiling) and so do
sessions (the rate their prefetch plans with).

The records read are a prep folder's (``--model``), or those of a scratch
file written in ``--dir`` and removed after.
"""

import argparse
import json
import mmap
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

from shared import disk, paths

from .argtypes import count, number, size

DEPTHS = (1, 2, 4, 8, 16, 32)
MAX_DEPTH = 256


def _depths(text: str) -> list:
    try:
        depths = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        depths = []
    if not depths or depths[0] < 1 or depths[-1] > MAX_DEPTH:
        raise argparse.ArgumentTypeError(f"takes integers from 1 to {MAX_DEPTH}, comma-separated: "
                                         f"{text!r}")
    return depths


def _record_size(text):
    return 0 if text.strip() == "0" else size(text)


def add_parser(sub, fmt):
    d = sub.add_parser("doctor", help="measure the disk as iod reads it (rate against queue depth)",
                       formatter_class=fmt, description=__doc__.split("\n\n")[0])
    where = d.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", type=Path, help="a prep folder: read its expert records")
    where.add_argument("--dir", type=Path, help="write a scratch file here and read it")
    d.add_argument("--record-size", type=_record_size, default=0,
                   help="bytes per read, e.g. 2654208 or 2.5M (0: the model's record stride; "
                        "2654208 with --dir)")
    d.add_argument("--scratch", type=size, default=2 << 30,
                   help="bytes of the scratch file (--dir), e.g. 4G, larger than the device's cache")
    d.add_argument("--depths", type=_depths, default=",".join(map(str, DEPTHS)),
                   help="queue depths to measure")
    d.add_argument("--seconds", type=number("a finite number above 0", positive=True), default=2.0,
                   help="per depth and round")
    d.add_argument("--rounds", type=count(1), default=3,
                   help="passes over the depths, interleaved; the median of each depth is kept")
    d.add_argument("--json", action="store_true", help="print the profile as JSON")
    d.add_argument("--plot", type=Path, help="write the curve as a PNG")
    d.add_argument("--no-save", action="store_true", help="do not store the profile")
    return d


class _Records:
    """Where one record lies: (fd, offset) of each, in a random order that
    each depth continues, so no record is read twice while others are unread."""

    def __init__(self, files, mode, seed=0):
        self.fds = files
        self.mode = mode
        self.order = []
        for i, (_, n, stride) in enumerate(files):
            self.order += [(i, k * stride) for k in range(n)]
        random.Random(seed).shuffle(self.order)
        self.next = 0
        self.lock = threading.Lock()

    def take(self):
        with self.lock:
            i, off = self.order[self.next % len(self.order)]
            self.next += 1
        return self.fds[i][0], off


def _model_files(folder, record_size):
    from shared.blob import Manifest, ManifestError

    from .reader import open_blob

    try:
        manifest = Manifest.load(folder)
    except ManifestError as e:
        raise ValueError(f"--model: {e}") from None
    files, mode = [], ""
    for layout in manifest.layers:
        try:
            fd, mode = open_blob(folder, layout)
        except (ManifestError, OSError) as e:
            for fd, *_ in files:
                os.close(fd)
            raise ValueError(f"--model: {e}") from None
        files.append((fd, layout.num_experts, layout.stride))
    size = record_size or manifest.max_stride
    first = folder / manifest.layers[0].file
    return files, mode, size, first


def _scratch_file(folder, nbytes, record_size):
    """A file of random bytes (written once, synced) to read back cold."""
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=".iod-doctor-", dir=folder)
    block = np.random.default_rng(0).integers(0, 256, 8 << 20, dtype=np.uint8).tobytes()
    written = 0
    try:
        while written < nbytes:
            written += os.write(fd, block[: min(len(block), nbytes - written)])
        os.fsync(fd)
    except BaseException:  # a full disk or Ctrl-C: leave no half-written scratch behind
        os.unlink(name)
        raise
    finally:
        os.close(fd)
    return Path(name)


def measure(records: _Records, size: int, depth: int, seconds: float):
    """(bytes/s, p50 s, p99 s) of ``depth`` threads reading records for ``seconds``."""
    import numpy as np

    import native
    from shared.blob import round_up

    stop = time.monotonic() + seconds
    lat = [[] for _ in range(depth)]
    got = [0] * depth
    errors = []

    def run(i):
        try:
            buf = mmap.mmap(-1, round_up(size, 4096))  # page-aligned, as O_DIRECT wants
        except OSError as e:
            errors.append(e)
            return
        try:
            while time.monotonic() < stop:
                fd, off = records.take()
                t = time.perf_counter()
                n = native.pread_full(fd, buf, 0, size, off)
                lat[i].append(time.perf_counter() - t)
                got[i] += n
                if records.mode == "fadvise":
                    os.posix_fadvise(fd, off, size, os.POSIX_FADV_DONTNEED)
        except OSError as e:  # said once by main, not as a thread's traceback
            errors.append(e)
        finally:
            buf.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(depth)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    if errors:
        raise errors[0]
    all_lat = np.array([x for l in lat for x in l]) if any(lat) else np.zeros(1)
    return sum(got) / wall, float(np.percentile(all_lat, 50)), float(np.percentile(all_lat, 99))


def plot(profile: disk.Profile, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depth = [c[0] for c in profile.curve]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.5), dpi=100)
    a.plot(depth, [c[1] / 1e6 for c in profile.curve], "o-")
    a.axvline(profile.knee, ls="--", c="gray", label=f"knee: depth {profile.knee}")
    a.set_xscale("log", base=2)
    a.set_xlabel("reads in flight")
    a.set_ylabel("MB/s")
    a.set_title(f"cold {profile.record_bytes / 1e6:.2f} MB reads ({profile.mode})")
    a.legend()
    b.plot(depth, [c[2] * 1e3 for c in profile.curve], "o-", label="p50")
    b.plot(depth, [c[3] * 1e3 for c in profile.curve], "o-", label="p99")
    b.set_xscale("log", base=2)
    b.set_xlabel("reads in flight")
    b.set_ylabel("latency per read (ms)")
    b.legend()
    for ax in (a, b):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(args) -> int:
    from shared.blob import plan_layer, round_up

    from .reader import open_blob

    depths = args.depths  # checked by the parser, as are the other numbers
    # refused before minutes of measuring, not after
    if args.dir is not None and args.dir.exists() and not args.dir.is_dir():
        print(f"iod doctor: --dir {args.dir}: not a directory", file=sys.stderr)
        return 2
    why = args.plot is not None and paths.check_out(args.plot, "--plot")
    if why:
        print(f"iod doctor: {why}", file=sys.stderr)
        return 2
    scratch = None
    if args.model is not None:
        try:
            files, mode, size, first = _model_files(args.model, args.record_size)
        except ValueError as e:
            print(f"iod doctor: {e}", file=sys.stderr)
            return 2
    else:
        size = args.record_size or 2654208
        if args.scratch < 4 * size:
            print("iod doctor: --scratch must hold at least 4 records", file=sys.stderr)
            return 2
        try:
            scratch = first = _scratch_file(args.dir, args.scratch, size)
            n = args.scratch // round_up(size, 4096)
            layout = plan_layer(0, "scratch", [("scratch", "weight", "uint8", [size], 1, n)])
            layout.file, layout.checksums = scratch.name, ["0" * 16] * n  # read, never checked
            fd, mode = open_blob(args.dir, layout)
        except OSError as e:
            if scratch is not None:
                scratch.unlink()
            print(f"iod doctor: --dir {args.dir}: {e.strerror or e}", file=sys.stderr)
            return 1
        files = [(fd, n, layout.stride)]
    try:
        records = _Records(files, mode)
        runs = {d: [] for d in depths}
        for _ in range(args.rounds):  # interleaved: load drift hits every depth alike
            for d in depths:
                runs[d].append(measure(records, size, d, args.seconds))
        curve = []
        for d in depths:
            rate, p50, p99 = sorted(runs[d])[len(runs[d]) // 2]  # the median-rate round
            curve.append((d, rate, p50, p99))
            spread = "/".join(f"{r / 1e6:.0f}" for r, _, _ in runs[d])
            print(f"depth {d:3d}: {rate / 1e6:8.1f} MB/s ({spread})   p50 {p50 * 1e3:7.2f} ms   "
                  f"p99 {p99 * 1e3:7.2f} ms", file=sys.stderr)
    except OSError as e:
        print(f"iod doctor: a read of {size} bytes failed: {e.strerror or e}; nothing stored",
              file=sys.stderr)
        return 1
    finally:
        for fd, *_ in files:
            os.close(fd)
        if scratch is not None:
            scratch.unlink()
    profile = disk.Profile(os.stat(first.parent).st_dev, str(first.parent), size, mode,
                           tuple(curve))
    if not profile.ceiling > 0:  # the daemon would plan with it: store only a real measurement
        print("iod doctor: measured no bytes read; nothing stored", file=sys.stderr)
        return 1
    print(f"ceiling {profile.ceiling / 1e6:.0f} MB/s, reached (≥{disk.KNEE:.0%}) at depth "
          f"{profile.knee}; reads bypass the page cache ({mode})", file=sys.stderr)
    if not args.no_save:
        where = disk.save(profile)
        whose = " under this IOD_RUN_DIR" if os.environ.get("IOD_RUN_DIR") and \
            not os.environ.get("IOD_DISK_PROFILE") else ""
        print(f"stored in {where}: iod{whose} prefetches {disk.workers()} at a time from its next start, "
              f"demands beside them",
              file=sys.stderr)
    if args.plot:
        try:
            plot(profile, args.plot)
        except OSError as e:  # the curve is stored and printed: only the picture is lost
            print(f"iod doctor: --plot {args.plot}: {e.strerror or e}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(profile.to_dict(), indent=1))
    return 0
