"""`infer verify`: flipped bits, swapped records and truncated blobs are all reported, one line per blob."""

import os
import shutil
import subprocess
import sys

import pytest

from infer.prep.verify import main as verify_main
from shared.blob import Manifest


@pytest.fixture
def folder(prep_model, tmp_path):
    dst = tmp_path / "prep"
    shutil.copytree(prep_model("qwen3_moe"), dst)
    return dst


def run(folder, capsys):
    rc = verify_main([str(folder)])
    return rc, capsys.readouterr().out.splitlines()


def test_clean_folder_passes(folder, capsys):
    rc, lines = run(folder, capsys)
    assert rc == 0
    assert lines[-1].startswith("verified ") and lines[-1].endswith(": OK")
    assert len(lines) == 1


def test_cli_subprocess(folder):
    r = subprocess.run([sys.executable, "-m", "infer.cli", "verify", str(folder)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    layout = Manifest.load(folder).layers[0]
    with open(folder / layout.file, "r+b") as f:
        f.seek(3 * layout.stride + 17)
        b = f.read(1)
        f.seek(3 * layout.stride + 17)
        f.write(bytes([b[0] ^ 0x01]))
    r = subprocess.run([sys.executable, "-m", "infer.cli", "verify", str(folder)], capture_output=True, text=True)
    assert r.returncode == 1
    assert f"layer {layout.layer} ({layout.file}): 1 of {layout.num_experts} records bad; checksum mismatch: expert 3" in r.stdout


def test_flipped_bit(folder, capsys):
    layout = Manifest.load(folder).layers[2]
    seg = layout.segments[-1]
    pos = 7 * layout.stride + seg.offset + seg.nbytes - 1  # last byte of the record
    with open(folder / layout.file, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x80]))
    rc, lines = run(folder, capsys)
    assert rc == 1
    assert lines[:-1] == [f"layer {layout.layer} ({layout.file}): 1 of {layout.num_experts} records bad; "
                          "checksum mismatch: expert 7"]
    assert "1 bad" in lines[-1]


def test_swapped_records(folder, capsys):
    layout = Manifest.load(folder).layers[1]
    path = folder / layout.file
    with open(path, "r+b") as f:
        a = os.pread(f.fileno(), layout.stride, 2 * layout.stride)
        b = os.pread(f.fileno(), layout.stride, 5 * layout.stride)
        assert a != b
        os.pwrite(f.fileno(), b, 2 * layout.stride)
        os.pwrite(f.fileno(), a, 5 * layout.stride)
    rc, lines = run(folder, capsys)
    assert rc == 1
    assert lines[:-1] == [f"layer {layout.layer} ({layout.file}): 2 of {layout.num_experts} records bad; "
                          "checksum mismatch: experts 2, 5"]


def test_truncated_blob(folder, capsys):
    layout = Manifest.load(folder).layers[3]
    path = folder / layout.file
    n = layout.num_experts
    os.truncate(path, (n - 2) * layout.stride + 100)  # mid-record n-2
    rc, lines = run(folder, capsys)
    assert rc == 1
    size = (n - 2) * layout.stride + 100
    assert lines[:-1] == [f"layer {layout.layer} ({layout.file}): 2 of {n} records bad; short record "
                          f"(the blob has {size} of {n * layout.stride} bytes): experts {n - 2}-{n - 1}"]


def test_truncated_padding_is_short(folder, capsys):
    layout = Manifest.load(folder).layers[0]
    n = layout.num_experts
    os.truncate(folder / layout.file, (n - 1) * layout.stride + layout.record_bytes)
    rc, lines = run(folder, capsys)
    assert rc == 1
    assert lines[0].startswith(f"layer {layout.layer} ({layout.file}): 1 of {n} records bad; short record")
    assert lines[0].endswith(f": expert {n - 1}")


def test_missing_blob(folder, capsys):
    layout = Manifest.load(folder).layers[0]
    (folder / layout.file).unlink()
    rc, lines = run(folder, capsys)
    assert rc == 1
    # one line for the blob, not one per expert
    assert len(lines) == 2
    assert lines[0].startswith(f"layer {layout.layer} ({layout.file}): {layout.num_experts} of "
                               f"{layout.num_experts} records bad; cannot open")
    assert lines[0].endswith(": all records")


def test_not_a_prep_folder(tmp_path, synth_model, capsys):
    assert verify_main([str(synth_model("qwen3_moe"))]) == 2
    assert capsys.readouterr().err.startswith("infer verify: ")
    assert verify_main([str(tmp_path / "missing")]) == 2
    (tmp_path / "manifest.json").write_text('{"format": "something else"}')
    assert verify_main([str(tmp_path)]) == 2
