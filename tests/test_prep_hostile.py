"""`infer prep` and `infer verify` against files and runs that could harm a
folder silently: another checkpoint resumed into it, resident weights
changed after prep, source headers that lie, a config that does not fit its
weights, two preps at once, a killed or interrupted prep, FIFOs where files
should be. Each test carries the attack out; docs/reliability.md, section 9."""

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from infer.prep import prep as prep_mod
from infer.prep.prep import main as prep_main
from infer.prep.safetensors import read_header
from infer.prep.verify import main as verify_main
from shared.blob import Manifest

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The lighthouse keeper counted the ships"

# `infer prep` in a child process whose write_blob, before its blob number
# AFTER, pauses (prints "paused", waits for a line on stdin) or sends itself
# a signal: a real prep, stopped or interrupted at a known point.
HOOK = r"""
import os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal's Ctrl-C
from infer.prep import prep as P
real, seen = P.write_blob, [0]
after, action = int(sys.argv[1]), sys.argv[2]
def hooked(dst, el, progress, *a, **k):
    if seen[0] == after:
        if action == "pause":
            print("paused", flush=True)
            sys.stdin.readline()
        else:
            os.kill(os.getpid(), getattr(signal, action))
    seen[0] += 1
    return real(dst, el, progress, *a, **k)
P.write_blob = hooked
sys.exit(P.main(sys.argv[3:]))
"""


def hooked_prep(after, action, *argv):
    return subprocess.Popen([sys.executable, "-c", HOOK, str(after), action, *map(str, argv), "--no-progress"],
                            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def cli(*argv, timeout=300):
    return subprocess.run([sys.executable, "-m", "infer.cli", *map(str, argv)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def one_line(r, rc=2):
    lines = r.stderr.strip().splitlines()
    assert r.returncode == rc and len(lines) == 1, (r.returncode, r.stderr)
    return lines[0]


def refuse(argv, capsys):
    assert prep_main([*map(str, argv), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("infer prep: "), err
    return err[0]


def snapshot(folder: Path):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())} if folder.exists() else None


def greedy_mlx(folder, n=10):
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, tok = load(str(folder))
    prompt = mx.array(tok.encode(PROMPT))
    return [int(t) for t, _ in generate_step(prompt, model, max_tokens=n)]


def greedy_streamed(prep_dir, monkeypatch, n=10):
    from mlx_lm.generate import generate_step
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from infer.runtime.client import IodClient
    from infer.runtime.loader import load_streaming
    from shared.fixtures import short_dir

    monkeypatch.setenv("IOD_RUN_DIR", str(short_dir("iodh-")))
    prompt = mx.array(load_tokenizer(Path(prep_dir)).encode(PROMPT))
    source = IodClient(prep_dir, iod="auto")
    try:
        model, _, _ = load_streaming(prep_dir, source, cache_bytes=1)
        return [int(t) for t, _ in generate_step(prompt, model, max_tokens=n)]
    finally:
        source.close()


def rewrite_header(path: Path, edit):
    """Rewrite a safetensors file's header with ``edit(header)``; the data stays."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


# --- 8: --resume keeps nothing made from another source ------------------------------------


def test_resume_of_another_checkpoint_keeps_nothing_and_runs_that_checkpoint(tmp_path, synth_model,
                                                                              monkeypatch, capsys):
    """Two checkpoints of one layout (seeds 0 and 1): resumed over the first's
    folder, the second once kept all 4 layers of the first's experts, verify
    passed, and runs gave neither model's tokens."""
    a, b = synth_model("qwen3_moe"), synth_model("qwen3_moe", seed=1)
    out = tmp_path / "out"
    assert prep_main(["--model", str(a), "--out", str(out), "--no-progress"]) == 0
    assert "kept by --resume" not in capsys.readouterr().out  # said only with --resume
    assert prep_main(["--model", str(b), "--out", str(out), "--resume", "--no-progress"]) == 0
    said = capsys.readouterr().out
    assert "(0 kept by --resume: its records were made from another source)" in said, said
    assert verify_main([str(out)]) == 0
    fresh = tmp_path / "fresh"
    assert prep_main(["--model", str(b), "--out", str(fresh), "--no-progress"]) == 0
    for layout in Manifest.load(fresh).layers:
        assert (out / layout.file).read_bytes() == (fresh / layout.file).read_bytes()
    want = greedy_mlx(b)
    assert want != greedy_mlx(a)
    assert greedy_streamed(out, monkeypatch) == want

    # the same source again: every layer is kept
    capsys.readouterr()
    assert prep_main(["--model", str(b), "--out", str(out), "--resume", "--no-progress"]) == 0
    assert "(4 kept by --resume)" in capsys.readouterr().out


def test_resume_after_the_source_folder_was_rewritten_in_place(tmp_path, synth_model, capsys):
    """The same path, other weights of the same size, even with the old
    modification times put back: nothing is kept. A folder whose manifest
    does not say where its records came from (an older prep) keeps nothing."""
    src = tmp_path / "src"
    shutil.copytree(synth_model("qwen3_moe"), src)
    out = tmp_path / "out"
    assert prep_main(["--model", str(src), "--out", str(out), "--no-progress"]) == 0
    weights = src / "model.safetensors"
    old = weights.stat()
    shutil.copyfile(synth_model("qwen3_moe", seed=2) / "model.safetensors", weights)
    assert weights.stat().st_size == old.st_size
    os.utime(weights, ns=(old.st_atime_ns, old.st_mtime_ns))
    capsys.readouterr()
    assert prep_main(["--model", str(src), "--out", str(out), "--resume", "--no-progress"]) == 0
    assert f"(0 kept by --resume: its records were made from {src.resolve()} as it was before it changed)" \
        in capsys.readouterr().out
    want = read_header(weights)[0]
    layout = Manifest.load(out).layers[0]
    seg = layout.segments[0]
    info = want[f"{layout.module}.{seg.projection}.{seg.tensor}"]
    with open(weights, "rb") as f:
        assert (out / layout.file).read_bytes()[seg.offset : seg.offset + seg.nbytes] == \
            os.pread(f.fileno(), seg.nbytes, info.start)

    m = json.loads((out / "manifest.json").read_text())
    del m["source"]
    (out / "manifest.json").write_text(json.dumps(m))
    assert prep_main(["--model", str(src), "--out", str(out), "--resume", "--no-progress"]) == 0
    assert "(0 kept by --resume: its manifest does not say what its records were made from" \
        in capsys.readouterr().out
    assert verify_main([str(out)]) == 0


# --- 9: verify checks the resident weights -------------------------------------------------


def flip_signs(path: Path, name: str):
    """Flip the sign bit of every float32 element of tensor ``name``."""
    info = read_header(path)[0][name]
    assert info.tag == "F32"
    with open(path, "r+b") as f:
        data = bytearray(os.pread(f.fileno(), info.nbytes, info.start))
        for i in range(3, len(data), 4):
            data[i] ^= 0x80
        os.pwrite(f.fileno(), bytes(data), info.start)


def test_verify_names_a_changed_resident_tensor_and_resume_repairs_it(tmp_path, synth_model, capsys):
    src = synth_model("qwen3_moe")
    out = tmp_path / "out"
    assert prep_main(["--model", str(src), "--out", str(out), "--no-progress"]) == 0
    good = snapshot(out)
    flip_signs(out / "model.safetensors", "model.norm.weight")
    capsys.readouterr()
    assert verify_main([str(out)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "model.safetensors: tensor model.norm.weight changed", lines
    m = Manifest.load(out)
    assert lines[-1] == (f"verified 4 layers, 128 records, {len(m.files)} files: 1 bad file; to repair: "
                         f"infer prep --model {src.resolve()} --out {out} --resume (rewrites what is damaged)")
    # config.json is checked too: a flipped top-k changes every token
    config = json.loads((out / "config.json").read_text())
    config["num_experts_per_tok"] = 1
    (out / "config.json").write_text(json.dumps(config))
    assert verify_main([str(out)]) == 1
    assert "config.json: " in capsys.readouterr().out
    # the fix named is the fix
    assert prep_main(["--model", str(src), "--out", str(out), "--resume", "--no-progress"]) == 0
    assert "(4 kept by --resume)" in capsys.readouterr().out
    assert snapshot(out) == good and verify_main([str(out)]) == 0


def test_a_folder_without_resident_checksums_still_verifies_its_experts(tmp_path, prep_model, capsys):
    out = tmp_path / "old"
    shutil.copytree(prep_model("qwen3_moe"), out)
    m = json.loads((out / "manifest.json").read_text())
    for key in ("files", "source"):  # a manifest written before either was recorded
        m.pop(key, None)
    (out / "manifest.json").write_text(json.dumps(m))
    flip_signs(out / "model.safetensors", "model.norm.weight")  # not seen: nothing to compare with
    assert verify_main([str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("resident weights: no checksums in this manifest (written before")
    assert lines[-1] == "verified 4 layers, 128 records: OK"
    layout = Manifest.load(out).layers[1]
    with open(out / layout.file, "r+b") as f:
        os.pwrite(f.fileno(), b"\xff", 5 * layout.stride + 3)
    assert verify_main([str(out)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("checksum mismatch: expert 5")
    assert lines[-1].endswith("1 bad; to repair: infer prep --model SRC --out "
                              f"{out} --resume (rewrites what is damaged)")


# --- 10: source files and configs that lie ---------------------------------------------------


def test_a_source_tensor_whose_shape_needs_more_bytes_than_it_has_is_refused(tmp_path, synth_model, capsys):
    """Its records were read from the next tensor's bytes: exit 0, and the
    folder ran."""
    src = tmp_path / "src"
    shutil.copytree(synth_model("qwen3_moe"), src)
    name = "model.layers.1.mlp.switch_mlp.gate_proj.weight"

    def double(h):
        h[name]["shape"][1] *= 2  # twice the bytes, the same data_offsets

    rewrite_header(src / "model.safetensors", double)
    out = tmp_path / "out"
    line = refuse(["--model", src, "--out", out], capsys)
    assert name in line and "bytes of data: the file is damaged" in line, line
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize("entry", [["F32", [1], [0, 4]], "F32", 7, None])
def test_a_header_entry_that_is_not_an_object_is_one_line(tmp_path, synth_model, capsys, entry):
    src = tmp_path / "src"
    shutil.copytree(synth_model("qwen3_moe"), src)
    rewrite_header(src / "model.safetensors", lambda h: h.__setitem__("model.norm.weight", entry))
    line = refuse(["--model", src, "--out", tmp_path / "out"], capsys)
    assert "model.norm.weight" in line and "not an object" in line, line
    assert not (tmp_path / "out").exists()


def test_a_config_that_does_not_fit_the_weights_is_refused_before_the_model_is_built(tmp_path, synth_model,
                                                                                    monkeypatch, capsys):
    """num_hidden_layers 1,000,000 grew prep past 1.5 GB building the model;
    fewer layers or experts than the weights have gave a folder that did
    not run."""
    src = tmp_path / "src"
    shutil.copytree(synth_model("qwen3_moe"), src)
    config = json.loads((src / "config.json").read_text())
    out = tmp_path / "out"

    def with_config(**kw):
        (src / "config.json").write_text(json.dumps({**config, **kw}))

    built = []
    real_build = prep_mod.build_model
    monkeypatch.setattr(prep_mod, "build_model", lambda c: built.append(c) or real_build(c))
    with_config(num_hidden_layers=1_000_000)
    line = refuse(["--model", src, "--out", out], capsys)
    assert line.endswith("names 1000000 layers (num_hidden_layers) but the weights have layers 0-3: "
                         "the config does not belong to these weights"), line
    assert built == []  # refused before mlx-lm built anything
    with_config(num_hidden_layers="4")
    assert "num_hidden_layers is '4', not a number of layers" in refuse(["--model", src, "--out", out], capsys)

    with_config(num_hidden_layers=2)
    line = refuse(["--model", src, "--out", out], capsys)
    assert "the weights have layers model.layers.2-3 that" in line and "does not name" in line, line
    with_config(num_experts=16)
    line = refuse(["--model", src, "--out", out], capsys)
    assert "has 32 experts, the model config.json builds has 16" in line, line
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    with_config()
    assert prep_main(["--model", str(src), "--out", str(out), "--no-progress"]) == 0


def test_config_names_a_layer_the_weights_lack(tmp_path, synth_model, capsys):
    """DeepSeek-V3's first layer is dense: without its tensors prep wrote a
    folder (exit 0) that mlx-lm could not load."""
    src = tmp_path / "src"
    shutil.copytree(synth_model("deepseek_v3"), src)
    files = sorted(src.glob("model*.safetensors"))
    for f in files:
        w = mx.load(str(f))
        mx.save_safetensors(str(f), {k: v for k, v in w.items() if not k.startswith("model.layers.0.")},
                            metadata={"format": "mlx"})
    line = refuse(["--model", src, "--out", tmp_path / "out"], capsys)
    assert line.endswith("names layers model.layers.0 that the weights do not have: the config does not "
                         "belong to these weights"), line
    assert not (tmp_path / "out").exists()


# --- 11: one prep at a time; killed preps are swept -----------------------------------------


def test_a_second_prep_into_the_same_out_is_refused_and_touches_nothing(tmp_path, synth_model):
    """Two preps into one --out: one failed, and in one of two runs the
    folder left had 32 bad records of 128."""
    src = synth_model("qwen3_moe")
    out = tmp_path / "out"
    first = hooked_prep(1, "pause", "--model", src, "--out", out)
    try:
        assert first.stdout.readline() == "paused\n", first.stderr.read()
        before, around = snapshot(out), sorted(p.name for p in tmp_path.iterdir())
        assert around == [".out.prep-lock", "out"]
        for extra in ([], ["--force"], ["--resume"]):
            line = one_line(cli("prep", "--model", src, "--out", out, "--no-progress", *extra))
            assert line == (f"infer prep: another infer prep (pid {first.pid}) is writing {out}; "
                            "wait for it to end, then run this again"), line
            assert snapshot(out) == before and sorted(p.name for p in tmp_path.iterdir()) == around
        first.stdin.write("\n")
        first.stdin.flush()
        assert first.wait(timeout=300) == 0, first.stderr.read()
    finally:
        first.kill()
        first.wait()
    r = cli("verify", out)
    files = len(Manifest.load(out).files)
    assert r.returncode == 0 and r.stdout.splitlines()[-1].endswith(f"128 records, {files} files: OK"), r.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the lock goes with its prep


def test_a_killed_force_prep_is_swept_by_the_next_prep_of_any_kind(tmp_path, synth_model, capsys):
    src = synth_model("qwen3_moe")
    out = tmp_path / "out"
    assert prep_main(["--model", str(src), "--out", str(out), "--no-progress"]) == 0
    good = snapshot(out)
    killed = hooked_prep(2, "pause", "--model", src, "--out", out, "--force")
    try:
        assert killed.stdout.readline() == "paused\n", killed.stderr.read()
        killed.kill()
        killed.wait()
    finally:
        killed.kill()
        killed.wait()
    staging = tmp_path / f".out.prep-{killed.pid}"
    assert (staging / "layer000.blob").exists() and (tmp_path / ".out.prep-lock").exists()
    assert snapshot(out) == good  # the folder being replaced is whole
    assert prep_main(["--model", str(src), "--out", str(out), "--resume", "--no-progress"]) == 0
    assert "(4 kept by --resume)" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert snapshot(out) == good


# --- 12: FIFOs are refused, never waited on -------------------------------------------------


def test_fifos_in_a_prep_folder_are_one_line_exit_2(tmp_path, prep_model):
    blob = tmp_path / "blob"
    shutil.copytree(prep_model("qwen3_moe"), blob)
    (blob / "layer000.blob").unlink()
    os.mkfifo(blob / "layer000.blob")
    line = one_line(cli("verify", blob, timeout=120))
    assert line == f"infer verify: {blob / 'layer000.blob'} is not a regular file", line

    weights = tmp_path / "weights"
    shutil.copytree(prep_model("qwen3_moe"), weights)
    (weights / "model.safetensors").unlink()
    os.mkfifo(weights / "model.safetensors")
    line = one_line(cli("verify", weights, timeout=120))
    assert line == f"infer verify: {weights / 'model.safetensors'} is not a regular file", line
    line = one_line(cli("run", "--model", weights, "--prompt", "hi", "--max-tokens", "2", timeout=120))
    assert line.startswith(f"infer run: {weights / 'model.safetensors'} is not a regular file"), line


def test_fifos_in_a_source_folder_are_one_line_exit_2(tmp_path, synth_model):
    src = tmp_path / "src"
    shutil.copytree(synth_model("qwen3_moe"), src)
    (src / "model.safetensors").unlink()
    os.mkfifo(src / "model.safetensors")
    out = tmp_path / "out"
    line = one_line(cli("prep", "--model", src, "--out", out, "--no-progress", timeout=120))
    assert line == f"infer prep: {src / 'model.safetensors'} is not a regular file", line
    fifo = tmp_path / "text"
    os.mkfifo(fifo)
    line = one_line(cli("prep", "--model", synth_model("qwen3_moe"), "--out", out, "--calibrate", fifo,
                        "--no-progress", timeout=120))
    assert line == f"infer prep: --calibrate {fifo} is not a file", line
    assert not out.exists()


# --- issue 50, item 9: interrupted preps ---------------------------------------------------


def test_a_prep_stopped_before_its_first_layer_leaves_nothing(tmp_path, synth_model):
    """SIGTERM before any layer was whole: the folder (and the folders above
    it that it made) is gone, not left empty."""
    out = tmp_path / "new" / "deeper" / "out"
    p = hooked_prep(0, "SIGTERM", "--model", synth_model("qwen3_moe"), "--out", out)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1] == "infer prep: terminated; nothing was written"
    assert list(tmp_path.iterdir()) == []


def test_an_interrupted_prep_leaves_a_folder_that_says_how_to_finish_it(tmp_path, synth_model, prep_model):
    src = synth_model("qwen3_moe")
    out = tmp_path / "out"
    p = hooked_prep(2, "SIGINT", "--model", src, "--out", out)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 130, err
    finish = f"infer prep --model {src} --out {out} --resume finishes it"
    assert err.strip().splitlines()[-1] == f"infer prep: interrupted; {out} is unfinished (2 MoE layers written): {finish}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    line = one_line(cli("verify", out))
    assert line == (f"infer verify: {out} is an unfinished prep (2 MoE layers written, no manifest.json): "
                    f"infer prep --model {src.resolve()} --out {out} --resume finishes it"), line
    r = cli(*finish.split()[1:-2])
    assert r.returncode == 0 and "(2 kept by --resume)" in r.stdout, r.stderr
    assert snapshot(out) == snapshot(prep_model("qwen3_moe"))  # as an uninterrupted prep's
    assert cli("verify", out).returncode == 0


def test_damage_found_at_load_names_the_next_step(tmp_path, synth_model, prep_model):
    from infer.runtime.loader import PrepFolderError, check_prep_folder

    out = tmp_path / "out"
    shutil.copytree(prep_model("qwen3_moe"), out)
    src = synth_model("qwen3_moe").resolve()
    os.truncate(out / "layer002.blob", 1000)
    with pytest.raises(PrepFolderError) as e:
        check_prep_folder(out)
    assert str(e.value) == (f"blob {out / 'layer002.blob'} is shorter than its manifest says (truncated): "
                            f"infer verify {out} lists what is damaged; infer prep --model {src} --out {out} "
                            "--resume rewrites it")
