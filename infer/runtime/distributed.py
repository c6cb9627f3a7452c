"""Pipeline over ranks with MLX's own distributed layer.

The ranks are processes started by ``mlx.launch`` (a hosts file, or
``infer run --ranks N`` on one machine: ring backend over loopback). Each
rank runs a slice of the decoder layers, split the mlx-lm way
(``PipelineMixin.pipeline``: rank ``size-1`` runs the first layers, rank 0
the last; the hidden state goes from rank to rank with ``send`` /
``recv_like`` and the last one is ``all_gather``-ed so every rank samples the
same token). A rank streams only its own layers' experts, through the iod of
its host, within its own memory budget. Rank 0 prints.
"""

import dataclasses
import functools
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from infer.runtime.budget import model_config

STATUS_ENV = "INFER_RANK_STATUS"  # folder where each local rank leaves its exit status
RANK_EXIT_S = 30  # after a forwarded signal, how long the ranks have to leave
_MODULE_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def launched() -> bool:
    """Whether this process is a rank started by ``mlx.launch``."""
    return "MLX_RANK" in os.environ


@functools.cache
def group():
    """The pipeline group of this rank, or None outside ``mlx.launch`` (or a
    group of one)."""
    if not launched():
        return None
    import mlx.core as mx

    g = mx.distributed.init()
    return g if g.size() > 1 else None


def rank() -> int:
    g = group()
    return g.rank() if g is not None else 0


def check_pipelined(model_dir, ranks=None):
    """ValueError unless mlx-lm can pipeline the folder's architecture (over
    ``ranks`` ranks: each needs a decoder layer of its own)."""
    import importlib

    from mlx_lm.models.pipeline import PipelineMixin

    config = model_config(model_dir)
    model_type = config["model_type"]
    layers = config.get("num_hidden_layers")
    if ranks is not None and isinstance(layers, int) and ranks > layers:
        raise ValueError(f"--ranks {ranks}: the model has {layers} decoder layers to split")
    try:
        module = importlib.import_module(f"mlx_lm.models.{model_type}")
    except ImportError:
        raise ValueError(f"mlx-lm has no model {model_type!r}") from None
    if not any(isinstance(c, type) and issubclass(c, PipelineMixin) and c is not PipelineMixin
               for c in vars(module).values()):
        raise ValueError(f"--ranks: mlx-lm cannot split {model_type} into a pipeline "
                         f"(its model has no pipeline())")


def layer_range(num_layers, g):
    """[start, end) of the decoder layers rank ``g.rank()`` runs: mlx-lm's own split."""
    from mlx_lm.models.pipeline import PipelineMixin

    probe = SimpleNamespace(layers=list(range(num_layers)))
    PipelineMixin.pipeline(probe, g)
    return probe.start_idx, probe.end_idx


def rank_manifest(manifest, model_dir, g):
    """The manifest of this rank's layers only: its store, cache and budget
    cover those (an MTP head's layers stay out: --draft does not pipeline)."""
    start, end = layer_range(int(model_config(model_dir)["num_hidden_layers"]), g)

    def own(layout):
        m = _MODULE_LAYER.match(layout.module)
        return m is not None and start <= int(m.group(1)) < end

    return dataclasses.replace(manifest, layers=[l for l in manifest.layers if own(l)])


# Bytes of hidden states this rank sent to the others, from the shapes of the
# tensors mlx-lm's pipelined model sends: each rank but 0 sends its output to
# the next stage, and every rank sends its copy of the last hidden state to the
# size-1 others (all_gather).
sent = {"bytes": 0, "decode_bytes": 0, "decode_steps": 0}


def pipeline(inner, g):
    """Split ``inner`` (an mlx-lm ``...Model`` with ``PipelineMixin``) over
    ``g`` and count what it sends per call."""
    inner.pipeline(g)
    pieces = (1 if g.rank() > 0 else 0) + (g.size() - 1)
    base = type(inner)

    class Pipelined(base):
        def __call__(self, inputs, *args, **kwargs):
            h = super().__call__(inputs, *args, **kwargs)
            n = h.nbytes * pieces  # the norm keeps the sent tensor's shape and dtype
            sent["bytes"] += n
            if h.shape[1] == 1:
                sent["decode_bytes"] += n
                sent["decode_steps"] += 1
            return h

    Pipelined.__name__ = base.__name__
    inner.__class__ = Pipelined


_RANK_FIELDS = ("hits", "misses", "bytes_read", "stall_us", "peak_rss", "peak_mlx_memory",
                "start", "end", "sent_bytes", "sent_decode_bytes", "decode_steps")


def merge_stats(stats, manifest, g):
    """Every rank's figures gathered (a collective: all ranks call it); the
    session's expert figures become the sums over ranks, with the per-rank
    ones and the traffic between ranks added."""
    import mlx.core as mx

    # the generation's last transfers run on mlx-lm's own stream: finish them,
    # so that this all_gather is not interleaved with them on the wire (a
    # bare mx.synchronize() waits for the default stream only)
    from mlx_lm.generate import generation_stream

    mx.synchronize(generation_stream)
    mx.synchronize()
    layers = sorted(l.layer for l in manifest.layers)
    mine = {**stats, "stall_us": int(stats["stall_s"] * 1e6),
            "start": layers[0] if layers else -1, "end": layers[-1] + 1 if layers else -1,
            "sent_bytes": sent["bytes"], "sent_decode_bytes": sent["decode_bytes"],
            "decode_steps": sent["decode_steps"]}
    row = mx.array([[int(mine[f]) for f in _RANK_FIELDS]], dtype=mx.int64)
    rows = mx.distributed.all_gather(row, group=g, stream=mx.cpu).tolist()
    ranks = []
    for r, values in enumerate(rows):
        d = dict(zip(_RANK_FIELDS, values))
        ranks.append({"rank": r, "moe_layers": [d["start"], d["end"]], "hits": d["hits"],
                      "misses": d["misses"], "bytes_read": d["bytes_read"],
                      "stall_s": d["stall_us"] / 1e6, "peak_rss": d["peak_rss"],
                      "peak_mlx_memory": d["peak_mlx_memory"],
                      "activation_bytes_sent": d["sent_bytes"]})
    out = dict(stats)
    for key in ("hits", "misses", "bytes_read", "stall_s"):
        out[key] = sum(r[key] for r in ranks)
    steps = max(1, rows[0][_RANK_FIELDS.index("decode_steps")])
    decode_bytes = sum(r[_RANK_FIELDS.index("sent_decode_bytes")] for r in rows)
    out["ranks"] = ranks
    out["activation_bytes"] = sum(r["activation_bytes_sent"] for r in ranks)
    out["activation_bytes_per_token"] = decode_bytes / steps
    return out


def pipeline_line(s):
    """The stats block's line for a pipelined session."""
    from shared.units import format_size

    per_rank = ", ".join(f"rank {r['rank']} layers {r['moe_layers'][0]}-{r['moe_layers'][1] - 1} "
                         f"read {format_size(r['bytes_read'])}" for r in s["ranks"])
    return (f"Pipeline: {len(s['ranks'])} ranks ({per_rank}); activations "
            f"{format_size(int(s['activation_bytes_per_token']))} per token between ranks")


# ---- starting local ranks -------------------------------------------------------------


def _free_ports(n):
    """A first port with ``n`` free ones after it (mlx.launch's ring uses consecutive ports)."""
    for _ in range(64):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        if first + n > 65535:
            continue
        try:
            held = []
            for p in range(first, first + n):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", p))
            return first
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise OSError("no free ports for the ranks")


def launcher() -> str:
    """The ``mlx.launch`` next to this Python (the venv's), else on PATH."""
    here = Path(sys.executable).parent / "mlx.launch"
    found = str(here) if here.exists() else shutil.which("mlx.launch")
    if found is None:
        raise ValueError("--ranks: mlx.launch not found (it comes with the mlx package)")
    return found


TERMINATED = 128 + 15  # a rank's exit status after SIGTERM (infer run's Terminated)


def worst(codes) -> int:
    """The exit status that says most: a failure over success, and a rank's
    own failure over TERMINATED (mlx.launch sends SIGTERM to the other ranks
    when one fails: their 143 follows the failure, it is not its cause)."""
    return max(codes, key=lambda c: (c != 0, c != TERMINATED, c))


def launch(command, ranks, extra_args=()) -> int:
    """Run ``infer <command> <extra_args>`` as ``ranks`` local ranks through
    ``mlx.launch`` (ring backend over loopback). Returns the worst exit status
    (mlx.launch itself exits 0 whatever its ranks did, so each leaves its own).
    SIGINT and SIGTERM go to every rank (mlx.launch and its ranks run in a
    process group of their own, which a terminal's Ctrl-C would not reach)."""
    import signal

    status = Path(tempfile.mkdtemp(prefix="infer-ranks-"))
    cmd = [launcher(), "--backend", "ring", "--hosts", "127.0.0.1", "-n", str(ranks),
           "--starting-port", str(_free_ports(ranks)), "--env", f"{STATUS_ENV}={status}",
           "--", sys.executable, "-m", "infer.cli", command, *extra_args]
    # mlx.launch's rank scripts leave a pid file and a host file (mktemp) in
    # TMPDIR: made in the status folder, they go with it
    env = dict(os.environ, TMPDIR=str(status))
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True, env=env)
    forwarded = []

    def forward(signum, frame):
        forwarded.append(signum)
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        launcher_rc = proc.wait()
        if forwarded:
            # mlx.launch died of the signal at once; the ranks may still be
            # leaving (each writes its status last): their statuses tell
            launcher_rc = 0 if launcher_rc < 0 else launcher_rc
            deadline = time.monotonic() + RANK_EXIT_S
            while time.monotonic() < deadline and not all(
                    (status / f"rank-{r}").exists() for r in range(ranks)):
                time.sleep(0.05)
        codes = []
        for r in range(ranks):
            f = status / f"rank-{r}"
            codes.append(int(f.read_text()) if f.exists() else 1)  # killed before its end
        return worst(codes + [launcher_rc])
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        shutil.rmtree(status, ignore_errors=True)


def leave_status(rc):
    """Record this rank's exit status for ``launch`` (no-op outside it)."""
    folder = os.environ.get(STATUS_ENV)
    if folder and launched():
        # whole or absent: the launcher may be reading while this rank leaves
        name = Path(folder, f"rank-{os.environ['MLX_RANK']}")
        tmp = name.with_suffix(".tmp")
        try:
            tmp.write_text(str(rc))
            os.replace(tmp, name)
        except OSError:
            pass  # the launcher is gone (and its folder with it)


def quiet_unless_rank0():
    """Ranks other than 0 print nothing on stdout: the output appears once."""
    if rank() != 0:
        sys.stdout = open(os.devnull, "w")
