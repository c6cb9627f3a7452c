"""shared.blob: layout planning, manifest round trip, checksums."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.blob import (
    MANIFEST_VERSION,
    RECORD_ALIGN,
    SEGMENT_ALIGN,
    Manifest,
    ManifestError,
    manifest_hash,
    plan_layer,
    record_checksum,
    verify_record,
)


def affine_layer(layer=3, experts=8):
    specs = []
    for proj, (out, inp) in [("gate_proj", (96, 128)), ("up_proj", (96, 128)), ("down_proj", (128, 96))]:
        specs += [
            (proj, "weight", "uint32", [out, inp // 8], 4, experts),
            (proj, "scales", "bfloat16", [out, inp // 64], 2, experts),
            (proj, "biases", "bfloat16", [out, inp // 64], 2, experts),
        ]
    q = {p: {"mode": "affine", "bits": 4, "group_size": 64} for p in ("gate_proj", "up_proj", "down_proj")}
    return plan_layer(layer, f"model.layers.{layer}.mlp.switch_mlp", specs, q)


def test_plan_layer_offsets_and_stride():
    l = affine_layer()
    assert l.file == "layer003.blob" and l.num_experts == 8
    assert l.projections == ["gate_proj", "up_proj", "down_proj"]
    end = 0
    for s in l.segments:
        assert s.offset % SEGMENT_ALIGN == 0 and s.offset >= end
        assert s.nbytes == int(np.prod(s.shape)) * (4 if s.dtype == "uint32" else 2)
        end = s.offset + s.nbytes
    assert l.record_bytes == end
    assert l.stride % RECORD_ALIGN == 0 and l.stride - RECORD_ALIGN < l.record_bytes <= l.stride


def test_plan_layer_rejects_mismatched_expert_counts():
    with pytest.raises(ManifestError):
        plan_layer(0, "m", [("fc1", "weight", "uint32", [4, 4], 4, 8), ("fc2", "weight", "uint32", [4, 4], 4, 7)])


def test_split_views_segments():
    l = affine_layer()
    rec = bytearray(l.stride)
    s = l.segments[3]
    rec[s.offset : s.offset + 4] = (12345).to_bytes(4, "little")
    parts = l.split(bytes(rec))
    assert parts[("up_proj", "weight")].shape == (96, 16)
    assert parts[("up_proj", "weight")][0, 0] == 12345
    assert parts[("down_proj", "scales")].dtype == np.uint16  # bfloat16 bytes


def test_manifest_round_trip(tmp_path):
    layers = [affine_layer(1), affine_layer(2)]
    for l in layers:
        l.checksums = [f"{record_checksum(l.layer, e, b'x' * e):016x}" for e in range(l.num_experts)]
    m = Manifest(model_type="qwen3_moe", layers=layers)
    m.save(tmp_path)
    back = Manifest.load(tmp_path)
    assert back == m
    assert back.to_json() == m.to_json()
    assert back.layer(2).checksum(5) == record_checksum(2, 5, b"xxxxx")
    assert back.max_stride == layers[0].stride
    assert back.expert_bytes == sum(l.stride * l.num_experts for l in layers)
    assert len(manifest_hash(tmp_path)) == 16
    assert not list(tmp_path.glob("*.tmp"))


def test_manifest_rejects_other_versions_and_garbage(tmp_path):
    m = Manifest(model_type="mixtral", layers=[affine_layer(0)])
    d = json.loads(m.to_json())
    d["version"] = MANIFEST_VERSION + 1
    with pytest.raises(ManifestError, match="version"):
        Manifest.from_dict(d)
    with pytest.raises(ManifestError):
        Manifest.from_dict({"format": "iod-experts", "version": MANIFEST_VERSION})
    with pytest.raises(ManifestError, match="not a prep folder"):
        Manifest.load(tmp_path)
    (tmp_path / "manifest.json").write_text("{")
    with pytest.raises(ManifestError):
        Manifest.load(tmp_path)


def test_checksum_depends_on_identity():
    data = b"expert bytes" * 100
    c = record_checksum(4, 9, data)
    assert c != record_checksum(4, 10, data)
    assert c != record_checksum(5, 9, data)
    assert c == record_checksum(4, 9, bytearray(data))


def test_verify_record_short_and_corrupt():
    l = affine_layer()
    rec = bytes(range(256)) * (l.record_bytes // 256) + bytes(l.record_bytes % 256)
    l.checksums = [f"{record_checksum(l.layer, e, rec):016x}" for e in range(l.num_experts)]
    assert verify_record(l, 0, rec)
    assert verify_record(l, 0, rec + bytes(l.stride - l.record_bytes))  # padding ignored
    assert not verify_record(l, 0, rec[:-1])
    l.checksums[1] = f"{record_checksum(l.layer, 1, rec[::-1]):016x}"
    assert not verify_record(l, 1, rec)  # expert 0's bytes in expert 1's place
    bad = bytearray(rec)
    bad[10] ^= 1
    assert not verify_record(l, 0, bytes(bad))


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["uint32", "uint8", "float32", "bfloat16"]),
            st.lists(st.integers(1, 40), min_size=1, max_size=3),
        ),
        min_size=1,
        max_size=9,
    ),
    st.integers(1, 64),
)
def test_plan_layer_never_overlaps(tensors, experts):
    size = {"uint32": 4, "uint8": 1, "float32": 4, "bfloat16": 2}
    specs = [(f"p{i // 3}", f"t{i}", d, shape, size[d], experts) for i, (d, shape) in enumerate(tensors)]
    l = plan_layer(0, "m", specs)
    spans = sorted((s.offset, s.offset + s.nbytes) for s in l.segments)
    for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
        assert a1 <= b0
    assert spans[-1][1] == l.record_bytes <= l.stride
    back = Manifest.from_dict(json.loads(Manifest("x", [l]).to_json()))
    assert back.layers[0] == l
