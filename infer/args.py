"""Argument parsing shared by the `infer` commands: one-line errors, checked
values, defaults in --help, --version."""

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Callable

from shared.paths import tmp_beside

DTYPES = ("float32", "bfloat16", "float16")
DTYPE_HELP = ("cast the weights (experts included) to this dtype; auto: the folder's, except "
              "on a CPU without fast bfloat16 (MLX's CPU backend on x86, where bfloat16 runs "
              "~8x slower and float16 slower still), where a 16-bit folder computes in float32")


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` where there is a default to show."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS \
                or "%(default)" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse with mlx-lm's plainness: a bad argument is one line on stderr
    and exit status 2; --help shows every default."""

    def __init__(self, *a, **kw):
        kw.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*a, **kw)

    def error(self, message):
        sys.stderr.write(f"{self.prog}: {message}\n")
        sys.exit(2)

    def parse_args(self, args=None, namespace=None):
        ns = super().parse_args(args, namespace)
        if getattr(self, "resolves_dtype", False):  # add_dtype's: --dtype auto becomes a choice
            ns.dtype, ns.dtype_choice = resolve_dtype(ns.dtype, getattr(ns, "model", None))
        return ns


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as v

    def get(name):
        try:
            return v(name)
        except PackageNotFoundError:
            return "unknown"

    return f"iod-moe {get('iod-moe')} (mlx {get('mlx')}, mlx-lm {get('mlx-lm')})"


def add_version(p):
    p.add_argument("--version", action="version", version=f"%(prog)s: {version()}")


def _number(kind, lo=None, hi=None, lo_open=False, what=None):
    def parse(text):
        try:
            x = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {what or ('an integer' if kind is int else 'a number')}: {text!r}")
        if kind is float and not math.isfinite(x):
            raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
        if lo is not None and (x < lo or (lo_open and x == lo)):
            raise argparse.ArgumentTypeError(f"must be {'>' if lo_open else '>='} {lo} (got {text})")
        if hi is not None and x > hi:
            raise argparse.ArgumentTypeError(f"must be <= {hi} (got {text})")
        return x

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


positive_int = _number(int, 1)
nonneg_int = _number(int, 0)
nonneg_float = _number(float, 0.0)
positive_float = _number(float, 0.0, lo_open=True)
unit_float = _number(float, 0.0, 1.0)
seed_int = _number(int, 0, (1 << 64) - 1)
port_int = _number(int, 0, 65535)


def tokens_or_no_limit(text):
    """-m/--max-tokens of mlx_lm.generate: a count, or -1 for no limit."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if n < 1 and n != -1:
        raise argparse.ArgumentTypeError(f"must be >= 1, or -1 for no limit (got {text})")
    return n


tokens_or_no_limit.__name__ = "int"


def one_of(*values):
    """An integer among ``values`` (what MLX's quantization takes)."""
    def parse(text):
        try:
            n = int(text)
        except ValueError:
            n = None
        if n not in values:
            raise argparse.ArgumentTypeError(f"takes {', '.join(map(str, values))} (got {text!r})")
        return n

    parse.__name__ = "int"
    return parse


def iod_target(text):
    """--iod: "auto" or a socket path (not empty)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("'auto' or a daemon's socket file, not an empty string")
    return text


def json_object(text):
    try:
        x = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e})") from None
    if not isinstance(x, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    return x


json_object.__name__ = "JSON object"


def str2bool(text):
    """mlx-lm's --verbose: anything but false/f is true."""
    return str(text).lower() not in ("false", "f", "0", "no")


def add_sampling(p, max_tokens=100, serve=False, no_limit=False):
    """mlx-lm's generation flags, with its names and short forms; with
    ``no_limit``, -1 tokens is no limit (as in mlx_lm.generate)."""
    what = "default per request: " if serve else ""
    names = ["--max-tokens"] if serve else ["--max-tokens", "-m"]  # as mlx_lm.server / generate
    p.add_argument(*names, type=tokens_or_no_limit if no_limit else positive_int, default=max_tokens,
                   help=f"{what}tokens to generate at most" + ("; -1: until the eos token, or the "
                                                                "model's context is full" if no_limit else ""))
    p.add_argument("--temp", type=nonneg_float, default=0.0, help=f"{what}sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=unit_float, default=1.0, help=f"{what}nucleus sampling (1: off)")
    p.add_argument("--top-k", type=nonneg_int, default=0, help=f"{what}sample from the k likeliest (0: off)")
    p.add_argument("--min-p", type=unit_float, default=0.0, help=f"{what}min-p sampling (0: off)")


def add_device_wait(p):
    """--device-wait: "auto", "on" or "off" (``infer.runtime.device.wanted``)."""
    p.add_argument("--device-wait", choices=("auto", "on", "off"), default="auto",
                   help="decode calls find their experts on the GPU and wait there for misses, where "
                        "the backend has it and its kernel passes a check at load (on: MLX CUDA or Metal; "
                        "auto: Metal only, as MLX CUDA hung with it on an H100), or sync at each router (off)")


def add_prefill(p, default="layer-major", more=""):
    """--prefill: the order of a long prompt's chunks (infer.runtime.prefill)."""
    p.add_argument("--prefill", choices=("layer-major", "chunked"), default=default,
                   help="a prompt longer than a prefill step: its chunks pass each streamed layer "
                        "in turn, so the layer's experts are read once (layer-major), or each chunk "
                        "goes through the whole model before the next, as mlx-lm (chunked); the "
                        "same ids either way" + more)


def add_dtype(p):
    """--dtype, resolved after parsing (``resolve_dtype``): ``args.dtype`` is
    a dtype's name or None (the folder's), ``args.dtype_choice`` says why."""
    p.add_argument("--dtype", choices=("auto", *DTYPES), default="auto", help=DTYPE_HELP)
    p.resolves_dtype = True


def slow_bfloat16() -> bool:
    """Whether MLX computes 16-bit floats slowly here: its CPU backend on x86
    (measured on this project's CPU: a 4-bit matmul 5x slower in bfloat16,
    20x in float16, than in float32); not Apple silicon, not a GPU."""
    import platform

    import mlx.core as mx

    return mx.default_device() == mx.cpu and \
        platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")


def resolve_dtype(choice, model_dir, slow=None):
    """(the dtype to cast to, or None for the folder's own; what was chosen
    and why, in words) for ``--dtype choice``. ``auto``: a 16-bit folder
    computes in float32 where ``slow_bfloat16``, else as stored."""
    from infer.runtime.budget import folder_dtype

    if choice is None:
        return None, "the folder's"
    if choice != "auto":
        return choice, f"{choice} (--dtype {choice})"
    stored = folder_dtype(model_dir) if model_dir else None
    if stored in ("bfloat16", "float16") and (slow_bfloat16() if slow is None else slow):
        return "float32", (f"float32 (auto: the folder's {stored} is slow on this CPU; "
                           f"--dtype {stored} keeps it)")
    return None, f"{stored} (auto: the folder's)" if stored else "the folder's (auto)"


def mx_dtype(name):
    import mlx.core as mx

    return None if name is None else getattr(mx, name)


def first_line(e) -> str:
    """An exception's message, its first line only (else its type's name)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def write_atomic(path: Path, write: Callable[[Path], None]):
    """``write(tmp)`` beside ``path``, then renamed over it: a failed write leaves nothing."""
    tmp = tmp_beside(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
