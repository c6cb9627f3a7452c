"""The CUDA copy path (records from the pinned arena into the stacks by
cudaMemcpy), run on the CPU with a fake CUDA runtime that keeps track of
which mapping each registration pinned.

A registration must belong to one mapping of the arena and end before that
mapping goes: a later mapping at the same address would otherwise be read
through the old registration (stale bytes; the lent H200 decoded wrong ids
that way when a bench opened a fresh source per configuration)."""

import ctypes

import pytest
from mlx_lm import load as mlx_load

import native
from infer import streaming
from infer.bench import decode
from infer.loader import load_streaming
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

    def copy(self, src, plan):
        base = native.address(src)
        pinned = self.live.get(base)
        if pinned is not None and pinned is not src:
            self.stale += 1
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
    assert fake_cuda.registered == 3 and fake_cuda.stale == 0


def test_a_refused_registration_is_tried_once_and_copies_still_decode(
        synth_model, prep_model, fake_cuda):
    """A driver that will not pin the arena's mapping leaves pageable copies:
    still exact, registered once per session rather than at every copy, and
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
    assert fake_cuda.copies > 1 and fake_cuda.attempts == 1
    assert source._cuda_pinned is False
    source.close()
    assert source._cuda_pinned is None and fake_cuda.live == {}
