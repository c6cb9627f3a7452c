"""Shared fixtures: synthetic models and prep folders, built once per session.

    def test_x(synth_model, prep_model):
        src = synth_model("qwen3_moe")                  # mlx-lm model folder
        dst = prep_model("gpt_oss", quant="mxfp4")      # prep folder of the same synth model
"""

import threading
from pathlib import Path

import pytest

_lock = threading.Lock()


@pytest.fixture(scope="session", autouse=True)
def _private_run_dir(tmp_path_factory):
    """Every test's default run dir is the test session's own: no test sees a
    daemon the user (or another test run on this machine) has running."""
    import os

    folder = tmp_path_factory.mktemp("run")
    folder.chmod(0o700)
    old = os.environ.get("IOD_RUN_DIR")
    os.environ["IOD_RUN_DIR"] = str(folder)
    yield folder
    if old is None:
        os.environ.pop("IOD_RUN_DIR", None)
    else:
        os.environ["IOD_RUN_DIR"] = old


def _key(arch, quant, dtype, preset, kw):
    if quant is None:
        quant = "mxfp4" if arch == "gpt_oss" else "affine4"
    return (arch, quant, dtype, preset, tuple(sorted(kw.items())))


@pytest.fixture(scope="session")
def synth_model(tmp_path_factory):
    """``synth_model(arch, quant="affine4", dtype="float32", preset="tiny", layers=None, seed=0) -> Path``

    A random-weight mlx-lm model folder (``quant`` defaults to mxfp4 for gpt_oss).
    Cached by arguments for the whole session; treat the folder as read-only."""
    from infer.synth import main as synth_main

    cache = {}
    root = tmp_path_factory.mktemp("synth")

    def make(arch, quant=None, dtype="float32", preset="tiny", **kw) -> Path:
        key = _key(arch, quant, dtype, preset, kw)
        with _lock:
            if key not in cache:
                out = root / f"m{len(cache)}-{arch}-{key[1]}-{dtype}-{preset}"
                argv = ["--arch", arch, "--preset", preset, "--quant", key[1], "--dtype", dtype, "--out", str(out)]
                for k, v in sorted(kw.items()):
                    argv += [f"--{k}", str(v)]
                rc = synth_main(argv)
                assert rc == 0, f"infer synth {' '.join(argv)} failed ({rc})"
                cache[key] = out
            return cache[key]

    return make


@pytest.fixture(scope="session")
def prep_model(tmp_path_factory, synth_model):
    """``prep_model(arch, quant="affine4", dtype="float32", preset="tiny", layers=None, seed=0) -> Path``

    The prep folder (`infer prep` output) of ``synth_model`` with the same
    arguments. Cached per session; treat it as read-only (copy it to corrupt it)."""
    from infer.prep import prep

    cache = {}
    root = tmp_path_factory.mktemp("prep")

    def make(arch, quant=None, dtype="float32", preset="tiny", **kw) -> Path:
        key = _key(arch, quant, dtype, preset, kw)
        src = synth_model(arch, quant, dtype, preset, **kw)
        with _lock:
            if key not in cache:
                out = root / src.name
                prep(src, out, progress=False)
                cache[key] = out
            return cache[key]

    return make


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A fake prep folder (random records, correct checksums) for daemon tests;
    one per test module."""
    from tests.iod_fixtures import make_prep

    folder = tmp_path_factory.mktemp("model")
    make_prep(folder)
    return folder
