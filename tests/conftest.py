"""Shared fixtures: synthetic models and prep folders, built once per session.

    def test_x(synth_model, prep_model):
        src = synth_model("qwen3_moe")                  # mlx-lm model folder
        dst = prep_model("gpt_oss", quant="mxfp4")      # prep folder of the same synth model
"""

import contextlib
import io
import signal
import threading
from pathlib import Path

import pytest

# A suite started in the background by a shell without job control ignores
# SIGINT, and under nohup SIGHUP; every child inherits that: the signal tests
# need them delivered.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
    signal.signal(signal.SIGHUP, signal.SIG_DFL)

_lock = threading.Lock()


def pytest_sessionfinish(session, exitstatus):
    """The short folders the tests made under /tmp (sockets, run dirs) go
    with the session, as pytest's own tmp_path folders are kept apart."""
    import shutil

    from shared.fixtures import SHORT_DIRS

    for folder in SHORT_DIRS:
        shutil.rmtree(folder, ignore_errors=True)


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
    from infer.synth.synth import main as synth_main

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
                # its progress must not land in the stderr of the test that
                # first asks for the model (tests count their stderr lines)
                said = io.StringIO()
                with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
                    rc = synth_main(argv)
                assert rc == 0, f"infer synth {' '.join(argv)} failed ({rc}): {said.getvalue()}"
                cache[key] = out
            return cache[key]

    return make


@pytest.fixture(scope="session")
def prep_model(tmp_path_factory, synth_model):
    """``prep_model(arch, quant="affine4", dtype="float32", preset="tiny", layers=None, seed=0) -> Path``

    The prep folder (`infer prep` output) of ``synth_model`` with the same
    arguments. Cached per session; treat it as read-only (copy it to corrupt it)."""
    from infer.prep.prep import prep

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
    from shared.fixtures import make_prep

    folder = tmp_path_factory.mktemp("model")
    make_prep(folder)
    return folder


TRAINED = Path(__file__).parent / "models"


@pytest.fixture(scope="session")
def trained_model():
    """``trained_model(arch) -> Path``: the committed tiny-trained checkpoint
    (`infer train --preset tiny`, docs/trained.md) of qwen3_moe or qwen3_next;
    its ``heldout.txt`` is text the model never trained on. Read-only."""

    def get(arch) -> Path:
        folder = TRAINED / f"tiny-trained-{arch}"
        assert (folder / "config.json").is_file(), f"missing checkpoint {folder}"
        return folder

    return get


@pytest.fixture(scope="session")
def trained_prep(tmp_path_factory, trained_model):
    """``trained_prep(arch) -> Path``: the prep folder of ``trained_model(arch)``, built once per session."""
    from infer.prep.prep import prep

    cache = {}
    root = tmp_path_factory.mktemp("trained-prep")

    def make(arch) -> Path:
        with _lock:
            if arch not in cache:
                out = root / arch
                prep(trained_model(arch), out, progress=False)
                cache[arch] = out
            return cache[arch]

    return make
