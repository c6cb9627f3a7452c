"""`infer train`: the training pieces, same seed same bytes, the folder loads in
stock mlx-lm and goes through `infer prep`, refusals."""

import json

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from infer.train import train

from infer.train import data as train_data
from infer.train.train import main as train_main

# the files whose bytes a seed fixes (train.json holds timings)
MODEL_FILES = ("model.safetensors", "mtp.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json")
QUICK = dict(preset="tiny", steps=3, batch=2, seq=16, judge=False, eval_windows=4)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small corpus file: 20 standard-library modules (always present)."""
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    docs = train_data.read_documents(train_data.stdlib_files()[:20])
    path.write_text(train_data.SEPARATOR.join(docs), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    """A few seconds of training (``train.train``, as the command calls it)."""
    root = tmp_path_factory.mktemp("trained")
    done = {}

    def make(arch, seed=0, name=""):
        key = (arch, seed, name)
        if key not in done:
            out = root / f"{arch}-{seed}{name}"
            out.mkdir()
            train.train(arch, out=out, corpus=str(corpus), seed=seed, log=lambda s: None, **QUICK)
            done[key] = out
        return done[key]

    return make


def test_grouped_experts_equal_switch_glu():
    from mlx_lm.models.switch_layers import SwitchGLU

    mx.random.seed(3)
    glu = SwitchGLU(64, 32, 16)
    x = mx.random.normal((2, 40, 64))
    idx = mx.random.randint(0, 16, (2, 40, 4))
    grouped = train.GroupedGLU(glu)
    assert np.array_equal(np.array(glu(x, idx)), np.array(grouped(x, idx)))
    assert grouped.dropped == 0.0


def test_balance_loss_is_one_when_uniform():
    tape = train._Tape()
    tape.logits.append(mx.zeros((2, 10, 8)))
    aux, z, shares = train.router_losses(tape, 2)
    assert float(aux) == pytest.approx(1.0)
    assert float(z) == pytest.approx(np.log(8) ** 2, rel=1e-5)
    assert float(shares[0].sum()) == pytest.approx(1.0)
    # global-batch balance: what the recent steps sent to expert 0 counts too
    recent = [mx.array([1.0] + [0.0] * 7)]
    aux, _, _ = train.router_losses(tape, 2, recent, keep=0.5)
    assert float(aux) == pytest.approx(1.0)  # uniform probabilities: E * sum f / E


def test_schedule_warms_up_and_decays():
    r = train.Recipe(seq=8, batch=1, steps=100, lr=1.0, eval_every=10)
    t = train.Trainer.__new__(train.Trainer)
    t.recipe = r
    lrs = [t.lr(s, 100) for s in range(100)]
    assert lrs[0] == pytest.approx(1 / 5) and lrs[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:])) and lrs[-1] == pytest.approx(0.1, abs=1e-3)


def test_heldout_split_and_sample():
    docs = [f"doc {i}\n" + "x = 1\n" * 50 for i in range(120)]
    tr, held = train_data.split(docs)
    assert [d.split("\n")[0] for d in held] == ["doc 7", "doc 57", "doc 107"]
    assert len(tr) + len(held) == 120 and not set(tr) & set(held)
    sample = train_data.heldout_sample(held, per_doc=20)
    assert sample.split(train_data.SEPARATOR)[1].startswith("doc 107")


def test_same_seed_same_bytes(trained):
    a, b = trained("qwen3_next"), trained("qwen3_next", name="again")
    for name in MODEL_FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    info = json.loads((a / "train.json").read_text())
    for key in ("heldout_loss", "unigram_loss", "tokens_seen", "minutes"):
        assert key in info
    assert info["tokens_seen"] == 3 * 2 * 16 and info["steps"] == 3
    assert len(info["corpus"]["sha256"]) == 64 and info["curve"][0]["step"] == 0
    assert (a / train.HELDOUT_FILE).stat().st_size > 1000


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
def test_folder_loads_in_mlx_lm_and_preps(arch, trained, corpus, tmp_path):
    from infer.spec.mtp import has_mtp, load_mtp
    from infer.prep.prep import prep
    from shared.blob import Manifest

    if arch == "qwen3_moe":  # through the command line
        src = tmp_path / "cli"
        argv = ["--steps", "3", "--batch", "2", "--seq", "16", "--no-judge", "--seed", "1"]
        assert train_main(["--arch", arch, "--corpus", str(corpus), "--out", str(src), *argv]) == 0
    else:
        src = trained(arch)
    model, tok = mlx_lm.load(str(src))
    text = mlx_lm.generate(model, tok, "import os\n", max_tokens=4, verbose=False)
    assert isinstance(text, str)
    cfg = json.loads((src / "config.json").read_text())
    assert cfg["model_type"] == arch and cfg["quantization"]["bits"] == 4
    assert cfg["quantization"]["model.layers.0.mlp.gate"]["bits"] == 8  # mlx-lm's own predicate
    if arch == "qwen3_next":
        assert has_mtp(src)
        head = load_mtp(src, model)
        assert head.layers[0].mlp.gate.bits == 8
    dst = tmp_path / "prep"
    prep(src, dst, progress=False)
    layers = Manifest.load(dst).layers
    assert len(layers) == cfg["num_hidden_layers"] + (1 if arch == "qwen3_next" else 0)


def test_refusals(corpus, tmp_path, capsys):
    out = str(tmp_path / "m")
    assert train_main(["--arch", "llama", "--out", out]) == 2
    assert train_main(["--arch", "qwen3_moe", "--preset", "huge", "--out", out]) == 2
    assert train_main(["--arch", "qwen3_moe", "--out", out, "--corpus", str(tmp_path / "none.txt")]) == 2
    assert train_main(["--arch", "qwen3_moe", "--out", out, "--minutes", "0"]) == 2
    assert train_main(["--arch", "qwen3_next", "--out", out, "--layers", "2"]) == 2
    assert train_main(["--arch", "qwen3_moe", "--out", out, "--aux-coef", "-1"]) == 2
    assert train_main(["--arch", "qwen3_moe", "--out", out, "--delta", "chunks"]) == 2
    assert train_main(["--arch", "qwen3_moe"]) == 2
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert train_main(["--arch", "qwen3_moe", "--out", str(tmp_path / "full")]) == 2
    bad = tmp_path / "one.txt"
    bad.write_text("only one document")
    assert train_main(["--arch", "qwen3_moe", "--out", out, "--corpus", str(bad), "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert all(line.startswith("infer train: ") for line in err if "note:" not in line), err
    assert not (tmp_path / "m").exists()


def test_plan_fits_the_minutes():
    import time

    t0 = time.time()
    plan = train.Plan(100, minutes=1.0, t0=t0 - 30)  # half of the minute is gone
    # 1 s a step, evaluations of 2 s every 10 steps, 5 s kept at the end
    plan.replan(10, 1.0, 2.0, lambda a, b: b // 10 - a // 10 + 1, 5.0)
    assert 25 <= plan.total <= 32
    assert not plan.over(5.0) and plan.over(40.0) and plan.stopped_early
    capped = train.Plan(1000, minutes=60, t0=t0, cap=50)
    capped.replan(10, 0.01, 0.0, lambda a, b: 0, 0.0)
    assert capped.total == 50
    untimed = train.Plan(100, minutes=None, t0=t0)
    untimed.replan(10, 100.0, 0.0, lambda a, b: 0, 0.0)
    assert untimed.total == 100 and not untimed.over(1e9)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
def test_gather_experts_and_compiled_step_train_like_grouped(arch):
    """The GPU path (mlx-lm's gather_mm, whole step compiled) takes the same
    optimizer steps as the CPU path (GroupedGLU), balance average included."""
    cfg = train.make_config(arch, "tiny", layers=4 if arch == "qwen3_next" else 2)
    windows = np.random.default_rng(0).integers(0, cfg["vocab_size"], (3, 2, 34)).astype(np.int32)
    losses = {}
    for experts, compiled in (("grouped", False), ("gather", True)):
        mx.random.seed(0)
        trainee = train.Trainee(cfg, experts)
        train.init_weights(trainee, cfg["num_hidden_layers"])
        recipe = train.Recipe(seq=32, batch=2, steps=3, lr=1e-3, eval_every=3, balance_window=4)
        trainer = train.Trainer(trainee, recipe, mx.float32, compiled)
        steps = [trainer.step(w, 1e-3) for w in windows]
        losses[experts] = [loss for loss, _ in steps] + [parts[2] for _, parts in steps]  # and the balance loss
    # gather_mm and a batched matmul round differently: equal to 1e-5, not bit-equal
    assert losses["gather"] == pytest.approx(losses["grouped"], rel=1e-5)
    assert losses["grouped"][0] != pytest.approx(losses["grouped"][2], rel=1e-3)  # it did learn something


def test_chunked_delta_rule_equals_mlx_lm_steps():
    """infer.train.delta: the gated delta rule in chunks gives mlx-lm's
    token-by-token outputs, final state and gradients (a length that is not a
    multiple of the chunk, grouped key heads, a non-zero initial state)."""
    from mlx_lm.models import gated_delta

    from infer.train import delta as train_delta

    mx.random.seed(0)
    B, T, Hk, Hv, Dk, Dv = 2, 37, 2, 4, 32, 24
    q, k = gated_delta.normalize_qk(mx.random.normal((B, T, Hk, Dk)), mx.random.normal((B, T, Hk, Dk)),
                                    inv_scale=Dk**-0.5, eps=1e-6)
    v = mx.random.normal((B, T, Hv, Dv))
    a, b = mx.random.normal((B, T, Hv)), 2 * mx.random.normal((B, T, Hv))
    A_log, dt_bias = 0.5 * mx.random.normal((Hv,)), mx.random.normal((Hv,))
    state = 0.1 * mx.random.normal((B, Hv, Dv, Dk))
    weights = mx.random.normal((B, T, Hv, Dv))

    def steps(q, k, v, a, b):
        return gated_delta.gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, use_kernel=False)

    def chunks(q, k, v, a, b):
        return train_delta.update(q, k, v, a, b, A_log, dt_bias, state)

    (y1, s1), (y2, s2) = steps(q, k, v, a, b), chunks(q, k, v, a, b)
    assert y2.shape == y1.shape and s2.shape == s1.shape
    assert mx.allclose(y2, y1, atol=1e-5).item() and mx.allclose(s2, s1, atol=1e-5).item()
    assert train_delta.CHUNK < T and T % train_delta.CHUNK  # several chunks, the last padded
    grads = [mx.grad(lambda *x, f=f: (f(*x)[0] * weights).sum(), argnums=(0, 1, 2, 3, 4))(q, k, v, a, b)
             for f in (steps, chunks)]
    for g1, g2 in zip(*grads):
        assert mx.allclose(g2, g1, atol=1e-4).item()


def test_chunked_delta_trains_like_steps(corpus, tmp_path, monkeypatch):
    """qwen3_next's training step with the rule in chunks (the GPU default)
    takes the steps mlx-lm's token-by-token rule takes; the choice is kept in
    train.json and its reproduce line."""
    from infer.train import delta as train_delta

    calls = []
    chunked = train_delta.update
    monkeypatch.setattr(train_delta, "update", lambda *a, **k: calls.append(1) or chunked(*a, **k))
    cfg = train.make_config("qwen3_next", "tiny", layers=4)
    windows = np.random.default_rng(0).integers(0, cfg["vocab_size"], (3, 2, 34)).astype(np.int32)
    losses = {}
    for delta, compiled in (("steps", False), ("chunks", False), ("chunks", True)):
        calls.clear()
        mx.random.seed(0)
        trainee = train.Trainee(cfg, "gather", delta)
        train.init_weights(trainee, cfg["num_hidden_layers"])
        recipe = train.Recipe(seq=32, batch=2, steps=3, lr=1e-3, eval_every=3)
        trainer = train.Trainer(trainee, recipe, mx.float32, compiled)
        losses[(delta, compiled)] = [trainer.step(w, 1e-3)[0] for w in windows]
        assert bool(calls) == (delta == "chunks")  # the linear-attention layers ran it
    for key in (("chunks", False), ("chunks", True)):
        assert losses[key] == pytest.approx(losses[("steps", False)], rel=1e-5)
    out = tmp_path / "next"
    out.mkdir()
    report = train.train("qwen3_next", out=out, corpus=str(corpus), log=lambda s: None, delta="chunks", **QUICK)
    assert report["delta"] == "chunks" and "--delta chunks" in report["reproduce"]


def test_plan_is_not_cut_short_by_the_first_evaluations_compile(monkeypatch):
    """The step-0 evaluation holds the kernels' compile (55 s on the H200,
    later ones 2 s): a plan for 4.5 minutes fitted to that figure ran 47
    steps in 2.2 minutes. The loop's own clock is faked: steps 0.5 s."""
    from types import SimpleNamespace

    clock = [1000.0]
    monkeypatch.setattr(train.time, "time", lambda: clock[0])
    evals = []

    def evaluate(held, n):
        clock[0] += 55.0 if not evals else 2.0
        evals.append(clock[0])
        return 5.0, 5.0

    def step(window, lr):
        clock[0] += 0.5
        return 5.0, (5.0, 5.0, 1.0, 20.0)

    recipe = SimpleNamespace(batch=16, seq=512, eval_every=100)
    trainer = SimpleNamespace(recipe=recipe, trainee=SimpleNamespace(num_mtp=0), evaluate=evaluate,
                              step=step, lr=lambda s, total: 1e-3)
    plan = train.Plan(4000, minutes=4.5, t0=clock[0])
    t_start = clock[0]
    curve, steps = train.run(trainer, SimpleNamespace(next=lambda: None), None, plan, lambda m: None,
                             judge=False)
    used = clock[0] - t_start
    # 270 s less the compile, the reserve (30 s) and the evaluations: ~340 steps fit
    assert steps > 250, (steps, used)
    assert used <= 4.5 * 60
