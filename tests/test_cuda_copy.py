"""The CUDA copy path (records from the pinned arena into the stacks by
cudaMemcpy), run on the CPU with a fake CUDA runtime that keeps track of
which mapping each registration pinned.

A registration must belong to one mapping of the arena and end before that
mapping goes: a later mapping at the same address would otherwise be read
through the old registration (stale bytes; the lent H200 decoded wrong ids
that way when a bench opened a fresh source per configuration)."""

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mlx_lm import load as mlx_load

import native
from infer.runtime import streaming
from infer.tools.bench import decode
from infer.runtime.loader import load_streaming
from iod.inproc import InprocSource


class FakeCuda:
    """cuda_register / cuda_unregister / cuda_copy over host memory. A copy
    from an address registered for another buffer counts as stale: the real
    DMA would read the pages that registration pinned."""

    def __init__(self):
        self.live = {}  # address -> the buffer registered there
        self.registered = 0
        self.copies = 0
        self.stale = 0
        self.wrong_flag = 0

    refuse = False  # as a driver that cannot pin a read-only mapping

    def register(self, buf, read_only):
        self.attempts = getattr(self, "attempts", 0) + 1
        if self.refuse:
            return False
        addr = native.address(buf)
        if addr in self.live:
            return False  # cudaErrorHostMemoryAlreadyRegistered
        self.live[addr] = buf
        self.registered += 1
        return True

    def unregister(self, buf):
        self.live.pop(native.address(buf), None)

    def copy(self, src, plan, pinned=False):
        base = native.address(src)
        registered = self.live.get(base)
        if registered is not None and registered is not src:
            self.stale += 1
        if pinned != (registered is src):
            self.wrong_flag += 1  # the native copy would stage (or not) wrongly
        for dst, off, n in plan.reshape(-1, 3).tolist():
            ctypes.memmove(dst, base + off, n)
            self.copies += 1
        return int(plan.reshape(-1, 3)[:, 2].sum())


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = FakeCuda()
    monkeypatch.setattr(streaming, "copy_mode", lambda: "cuda")
    monkeypatch.setattr(native, "cuda_register", fake.register)
    monkeypatch.setattr(native, "cuda_unregister", fake.unregister)
    monkeypatch.setattr(native, "cuda_copy", fake.copy)
    return fake


def test_cuda_copies_decode_mlx_lm_ids_and_each_mapping_registers_and_unregisters(
        synth_model, prep_model, fake_cuda):
    src = synth_model("qwen3_moe")
    prep = prep_model("qwen3_moe")
    n = 12
    resident, tok = mlx_load(str(src))
    prompt = tok.encode("Hello there, lighthouse")
    want = decode(resident, prompt, None, n)["tokens"]
    for session in range(3):  # a fresh source each time, as bench does per configuration
        source = InprocSource(prep, arena=64 << 20)
        model, _, store = load_streaming(prep, source, None)
        store.cache_bytes = int(source.manifest.expert_bytes * 0.3)
        ids = decode(model, prompt, None, n, store)["tokens"]
        assert fake_cuda.copies > 0 and store.stacks
        assert all(s.mode == "cuda" for s in store.stacks.values())
        assert len(fake_cuda.live) == 1, "the session's arena is registered, once"
        source.close()
        assert fake_cuda.live == {}, "a closed session leaves no registration behind"
        assert ids == want, f"session {session}"
    assert fake_cuda.registered == 3 and fake_cuda.stale == 0 and fake_cuda.wrong_flag == 0


def test_a_refused_registration_is_tried_once_and_copies_still_decode(
        synth_model, prep_model, fake_cuda):
    """A driver that will not pin the arena's mapping: copies staged by the
    native copy, still exact, registered once per session rather than at every copy, and
    said (``arena_pinned`` False, in infer bench's JSON)."""
    fake_cuda.refuse = True
    src, prep = synth_model("qwen3_moe"), prep_model("qwen3_moe")
    resident, tok = mlx_load(str(src))
    prompt = tok.encode("Hello there, lighthouse")
    want = decode(resident, prompt, None, 8)["tokens"]
    source = InprocSource(prep, arena=64 << 20)
    model, _, store = load_streaming(prep, source, None)
    store.cache_bytes = int(source.manifest.expert_bytes * 0.3)
    assert decode(model, prompt, None, 8, store)["tokens"] == want
    assert fake_cuda.copies > 1 and fake_cuda.attempts == 1 and fake_cuda.wrong_flag == 0
    assert source.cuda_pinned is False
    source.close()
    assert source.cuda_pinned is None and fake_cuda.live == {}


NATIVE_COPY = r"""
import ctypes, os, sys
import numpy as np
import native

fake = ctypes.CDLL(os.environ["IOD_CUDART"])
def stats():
    out = (ctypes.c_int64 * 7)()
    fake.fake_stats(out)
    return list(out)

rng = np.random.default_rng(0)
src = rng.integers(0, 256, size=40 << 20, dtype=np.uint8)
dst = np.zeros_like(src)
base = native.address(dst)
piece = 3 << 20  # 14 rows of 3 MB (the last shorter): more than the 32 MB staging buffer
offs = list(range(0, src.size, piece))
rng.shuffle(offs)
plan = np.array([(base + o, o, min(piece, src.size - o)) for o in offs], dtype=np.int64)
assert native.cuda_available()
# a refused registration: False, and CUDA's last error cleared (MLX would read it as its own)
os.environ["FAKE_REFUSE"] = "1"
assert native.cuda_register(src, True) is False and stats()[5] == 1 and stats()[6] == 0
del os.environ["FAKE_REFUSE"]
# unpinned: staged, the buffer reused only after its copies are done
assert native.cuda_copy(src, plan, False) == src.size and np.array_equal(dst, src)
s = stats()
assert s[0] == 0 and s[1] == len(offs) and s[4] == len(offs) and s[2] >= 2 and s[3] == 1, s
# pinned: straight from the source, one wait
dst[:] = 0
assert native.cuda_copy(src, plan, True) == src.size and np.array_equal(dst, src)
t = stats()
assert t[1] - s[1] == len(offs) and t[4] == s[4] and t[2] == s[2] + 1 and t[0] == 0, t
# a row larger than the staging buffer: one cudaMemcpy
big = np.zeros(33 << 20, dtype=np.uint8)
native.cuda_copy(src, np.array([(native.address(big), 0, big.size)], dtype=np.int64), False)
assert np.array_equal(big, src[: big.size]) and stats()[0] == 1
try:
    native.cuda_copy(src, np.array([(base, src.size - 1, 2)], dtype=np.int64), True)
    raise SystemExit("out of range accepted")
except ValueError:
    pass
print("ok")
"""


def test_native_copy_queues_its_rows_and_stages_an_unpinned_source(tmp_path):
    """native.cuda_copy against a fake libcudart (IOD_CUDART) whose async
    copies run only when the stream is waited for: every byte arrives, from
    a pinned source straight and with one wait; from an unpinned one through
    the staging buffer, reused only after a wait; a row larger than the
    buffer by cudaMemcpy; an out-of-range plan refused; a refused
    registration leaves no CUDA error behind."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.fail("no C compiler (the native extension needs one too)")
    lib = tmp_path / "libfakecudart.so"
    src = Path(__file__).parent / "native" / "fake_cudart.c"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(lib), str(src)], check=True)
    r = subprocess.run([sys.executable, "-c", NATIVE_COPY], capture_output=True, text=True,
                       env={**os.environ, "IOD_CUDART": str(lib)}, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
