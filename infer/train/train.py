"""`infer train`: small MoE language models of real mlx-lm architectures, trained here.

The model is mlx-lm's own class built from a config (as `infer synth` builds
it), trained the way MoE models are: next-token cross-entropy, a Switch-style
load-balancing loss and the router z-loss on every MoE layer, AdamW with
decoupled weight decay on matrices, linear warm-up then cosine decay, gradient
clipping, held-out evaluation. qwen3_next trains its MTP head jointly on the
next-next token. The output is a plain mlx-lm folder (4-bit through mlx-lm's
``quantize_model``, tokenizer, ``mtp.safetensors`` for qwen3_next) plus
``train.json`` with the losses, the loss curve and the corpus' hash.

mlx-lm's MoE blocks do not return router logits: during training each
block's ``gate`` is a ``_TapLinear`` that records its output on a tape read
by the loss in the same traced call, so the gradients flow through it.
"""

import argparse
import json
import math
import os
import platform
import shutil
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map

from infer.synth import presets as synth_presets

from infer.synth import tokenizer as synth_tokenizer

from infer.train import data as train_data

from infer.train import delta as train_delta
from infer.spec.mtp import MTP_FILE, MTPHead

ARCHS = ("qwen3_moe", "qwen3_next")
HELDOUT_FILE = "heldout.txt"  # a sample of the held-out documents, for figures
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16}

# Model sizes (as in infer.synth.presets) and their training recipe.
# tiny: trains on a 2-core CPU in ~10 minutes; experts/top_k = 16 as in
# Qwen3-30B-A3B. small: the dimensions of synth's `small`, for a GPU.
PRESETS = {
    "tiny": dict(
        hidden=128, layers=4, experts=64, top_k=8, moe_inter=64, inter=256,
        heads=4, kv_heads=2, head_dim=32, vocab=2048,
        seq=128, batch=16, steps=300, lr=3e-3, eval_every=30,
    ),
    "small": dict(
        hidden=1024, layers=16, experts=128, top_k=8, moe_inter=384, inter=2048,
        heads=16, kv_heads=4, head_dim=64, vocab=4096,
        seq=512, batch=16, steps=4000, lr=1e-3, eval_every=100,
    ),
}


@dataclass
class Recipe:
    seq: int
    batch: int
    steps: int
    lr: float
    eval_every: int
    warmup: float = 0.05  # of the steps
    min_lr: float = 0.1  # of lr, at the end of the cosine
    weight_decay: float = 0.1
    betas: tuple = (0.9, 0.95)
    clip: float = 1.0
    aux_coef: float = 0.05  # load balancing: 0.01 (Switch) left one hot expert per layer in tiny
    balance_window: int = 64  # steps the balance counts loads over (1: each batch alone)
    z_coef: float = 1e-3  # router z-loss (ST-MoE's value)
    mtp_coef: float = 0.3  # next-next-token loss (DeepSeek-V3's first value)
    eval_windows: int = 32


def fail(msg: str) -> int:
    print(f"infer train: {msg}", file=sys.stderr)
    return 2


def make_config(arch: str, preset: str, layers=None) -> dict:
    """config.json of the model to train (without quantization)."""
    sizes = {k: v for k, v in PRESETS[preset].items() if k in synth_presets.SIZES["tiny"]}
    if layers:
        sizes["layers"] = layers
    c = getattr(synth_presets, f"_{arch}")(sizes)
    if arch == "qwen3_moe":
        c["max_window_layers"] = c["num_hidden_layers"]
    c["bos_token_id"] = None
    c["eos_token_id"] = 2  # <|im_end|>, as synth_tokenizer's EOS_TOKEN
    return c


# --- the model in training ----------------------------------------------------------------------


class _Tape:
    """Router logits of one forward pass, in call order."""

    def __init__(self):
        self.logits = []


class _TapLinear(nn.Linear):
    """An MoE block's router that also records its output."""

    def __init__(self, linear: nn.Linear, tape: _Tape):
        super().__init__(linear.weight.shape[1], linear.weight.shape[0], bias=False)
        self.weight = linear.weight
        self._tape = tape

    def __call__(self, x):
        y = super().__call__(x)
        self._tape.logits.append(y)
        return y


class GroupedGLU(nn.Module):
    """SwitchGLU's function for training: each expert's tokens are gathered
    into one padded row block and all experts run as one batched matmul
    (gather_mm does a small matmul per token, ~8x slower on a CPU). The
    routed ids are read on the host. An expert takes at most
    ``capacity_factor`` times its fair share of a batch's slots; the rest is
    dropped (zero output), which happens only while routing is far from
    balanced early in training."""

    def __init__(self, glu, capacity_factor: float = 4.0):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = glu.gate_proj, glu.up_proj, glu.down_proj
        self.capacity_factor = capacity_factor
        self.dropped = 0.0  # share of the last call's slots beyond capacity

    def __call__(self, x, indices):
        E = self.gate_proj.weight.shape[0]
        H = x.shape[-1]
        k = indices.shape[-1]
        xf = x.reshape(-1, H)
        n = xf.shape[0]
        flat = np.array(indices).reshape(-1)
        order = np.argsort(flat, kind="stable")
        counts = np.bincount(flat, minlength=E)
        cap = max(1, min(int(counts.max()), math.ceil(self.capacity_factor * flat.size / E)))
        cap = -(-cap // 8) * 8  # fewer distinct shapes
        starts = np.cumsum(counts) - counts
        experts = flat[order]
        pos = np.arange(flat.size) - starts[experts]
        keep = pos < cap
        self.dropped = 1.0 - float(keep.mean())
        slot = experts * cap + pos  # padded slot of each sorted (token, choice)
        src = np.full(E * cap, n, dtype=np.int32)  # row n is zeros (padding)
        src[slot[keep]] = (order[keep] // k).astype(np.int32)
        xe = mx.concatenate([xf, mx.zeros((1, H), xf.dtype)])[mx.array(src)].reshape(E, cap, H)
        w = lambda proj: proj.weight.swapaxes(-1, -2)
        h = nn.silu(xe @ w(self.gate_proj)) * (xe @ w(self.up_proj))
        y = (h @ w(self.down_proj)).reshape(E * cap, H)
        y = mx.concatenate([y, mx.zeros((1, H), y.dtype)])
        back = np.full(flat.size, E * cap, dtype=np.int32)  # dropped: the zero row
        back[order[keep]] = slot[keep].astype(np.int32)
        return y[mx.array(back)].reshape(*indices.shape, H)


def moe_blocks(module):
    """(path, block) of every MoE block: a module with a ``gate`` and a ``switch_mlp``."""
    return [(p, m) for p, m in module.named_modules() if "gate" in m and "switch_mlp" in m]


class Trainee(nn.Module):
    """The mlx-lm model, and for qwen3_next its MTP head, with tapped routers.

    ``experts``: "grouped" runs each MoE layer as GroupedGLU (fast on a CPU,
    but it reads the routing on the host, so a step cannot be compiled);
    "gather" keeps mlx-lm's SwitchGLU (sorted ``gather_mm``, no host sync).
    ``delta``: qwen3_next's gated delta rule token by token as mlx-lm runs
    it ("steps") or in chunks (``infer.train.delta``: far less memory and
    fewer sequential steps for the backward)."""

    def __init__(self, config, experts="grouped", delta="steps"):
        super().__init__()
        from infer.synth.synth import build_model

        self.model, self.args = build_model(config)
        self.delta = delta  # qwen3_next's linear attention: "steps" (mlx-lm's) or "chunks"
        self.top_k = config["num_experts_per_tok"]
        self.num_mtp = config.get("mtp_num_hidden_layers", 0) if config["model_type"] == "qwen3_next" else 0
        if self.num_mtp:
            self.mtp = MTPHead(self.args, self.num_mtp)
        self.tape = _Tape()
        for _, block in moe_blocks(self):
            block.gate = _TapLinear(block.gate, self.tape)
            if experts == "grouped":
                block.switch_mlp = GroupedGLU(block.switch_mlp)

    def logits(self, h):
        if self.args.tie_word_embeddings:
            return self.model.model.embed_tokens.as_linear(h)
        return self.model.lm_head(h)


def init_weights(trainee: Trainee, n_layers: int):
    """GPT-2 style: matrices N(0, 0.02), the projections that write into the
    residual stream scaled by 1/sqrt(2 * layers); norms and the linear
    attention's constants keep mlx-lm's own initialisation."""
    out_std = 0.02 / math.sqrt(2 * n_layers)
    new = []
    for name, p in tree_flatten(trainee.parameters()):
        leaf = name.rsplit(".", 2)
        if not name.endswith(".weight") or p.ndim < 2 or "conv1d" in name:
            continue
        std = out_std if leaf[-2] in ("o_proj", "down_proj", "out_proj") else 0.02
        new.append((name, mx.random.normal(p.shape) * std))
    trainee.load_weights(new, strict=False)


def cross_entropy(logits, targets):
    return nn.losses.cross_entropy(logits.astype(mx.float32), targets, reduction="mean")


def router_losses(tape: _Tape, top_k: int, shares=None, keep: float = 0.0):
    """(load-balancing loss, z-loss, this batch's shares), the losses means
    over the MoE layers.

    Balance (Switch Transformer, per layer): E * sum_e f_e * P_e, f_e the
    share of routed slots that go to expert e, P_e its mean router
    probability over the batch; 1.0 when perfectly balanced. With ``shares``
    (each layer's f over the recent steps) f is ``keep * shares + (1 - keep)
    * f_batch``: global-batch balance (Qiu et al. 2025, as Qwen3 is trained),
    which lets a batch's context favour some experts as long as the load
    evens out over many batches."""
    aux, z, batch_shares = [], [], []
    for i, logits in enumerate(tape.logits):
        logits = logits.astype(mx.float32).reshape(-1, logits.shape[-1])
        n_exp = logits.shape[-1]
        probs = mx.softmax(logits, axis=-1)
        top = mx.stop_gradient(mx.argpartition(-logits, kth=top_k - 1, axis=-1)[:, :top_k])
        f = mx.zeros((n_exp,)).at[top.reshape(-1)].add(1.0) / top.size
        batch_shares.append(f)
        if shares is not None:
            f = keep * shares[i] + (1 - keep) * f
        aux.append(n_exp * mx.sum(f * probs.mean(axis=0)))
        z.append(mx.mean(mx.logsumexp(logits, axis=-1) ** 2))
    if not aux:
        return mx.array(0.0), mx.array(0.0), []
    return mx.mean(mx.stack(aux)), mx.mean(mx.stack(z)), batch_shares


def forward_losses(trainee: Trainee, window, seq: int, shares=None, keep=0.0):
    """(next-token CE, next-next-token CE of the MTP head or 0, aux, z, the
    batch's expert shares) of a batch of windows of ``seq + 1`` (``seq + 2``
    with an MTP head) tokens."""
    trainee.tape.logits.clear()
    inputs, targets = window[:, :seq], window[:, 1 : seq + 1]
    with train_delta.in_chunks() if trainee.delta == "chunks" else nullcontext():
        h = trainee.model.model(inputs)
        ce = cross_entropy(trainee.logits(h), targets)
        mtp_ce = mx.array(0.0)
        if trainee.num_mtp:
            # the head sees h[i] (after the final norm) and the true token i+1; predicts i+2
            embeds = trainee.model.model.embed_tokens(targets)
            g = trainee.mtp(h, embeds, [None] * trainee.num_mtp)
            mtp_ce = cross_entropy(trainee.logits(g), window[:, 2 : seq + 2])
    aux, z, batch_shares = router_losses(trainee.tape, trainee.top_k, shares, keep)
    return ce, mtp_ce, aux, z, batch_shares


def cast(params, dtype):
    return tree_map(lambda p: p.astype(dtype) if mx.issubdtype(p.dtype, mx.floating) and p.dtype != dtype else p, params)


class Trainer:
    """One optimizer step at a time over float32 master weights; the forward
    and backward run in ``dtype`` (bfloat16 on a GPU, float32 on a CPU).
    ``compiled`` traces the loss and its gradient once with ``mx.compile``
    (only without GroupedGLU's host reads)."""

    def __init__(self, trainee: Trainee, recipe: Recipe, dtype, compiled=False):
        self.trainee = trainee
        self.recipe = recipe
        self.dtype = dtype
        self.params = trainee.trainable_parameters()
        self.opt = optim.Adam(learning_rate=recipe.lr, betas=list(recipe.betas), eps=1e-8)
        self.opt.init(self.params)
        # each MoE layer's expert shares over the recent steps; the first step
        # keeps none of them (its own batch's shares start the average)
        self.shares = [mx.zeros((b.gate.weight.shape[0],)) for _, b in moe_blocks(trainee)]
        self.started = False
        r = recipe
        self.keep = 1.0 - 1.0 / r.balance_window if r.balance_window > 1 else 0.0

        def loss_of(params, window, shares, keep):
            self.trainee.update(cast(params, self.dtype))
            ce, mtp_ce, aux, z, batch_shares = forward_losses(self.trainee, window, r.seq, shares, keep)
            loss = ce + r.mtp_coef * mtp_ce + r.aux_coef * aux + r.z_coef * z
            return loss, ((ce, mtp_ce, aux, z), batch_shares)

        self._value_and_grad = mx.value_and_grad(loss_of)
        if compiled:
            self._value_and_grad = mx.compile(self._value_and_grad)

    def lr(self, step: int, total: int) -> float:
        r = self.recipe
        warm = max(1, int(r.warmup * total))
        if step < warm:
            return r.lr * (step + 1) / warm
        t = min(1.0, (step - warm) / max(1, total - warm))
        return r.lr * (r.min_lr + (1 - r.min_lr) * 0.5 * (1 + math.cos(math.pi * t)))

    def step(self, window: np.ndarray, lr: float):
        k = self.keep if self.started else 0.0
        (loss, (parts, batch)), grads = self._value_and_grad(self.params, mx.array(window), self.shares,
                                                             mx.array(k))
        if self.keep:
            self.shares = [k * s + (1 - k) * b for s, b in zip(self.shares, batch)]
        self.started = True
        grads, _ = optim.clip_grad_norm(grads, self.recipe.clip)
        self.opt.learning_rate = mx.array(lr)
        wd = 1.0 - lr * self.recipe.weight_decay
        # decoupled weight decay on matrices only (not norms, gains, biases)
        decayed = tree_map(lambda p: p * wd if p.ndim >= 2 else p, self.params)
        self.params = self.opt.apply_gradients(grads, decayed)
        mx.eval(self.params, self.opt.state, loss, parts, self.shares)
        return float(loss), [float(p) for p in parts]

    def evaluate(self, windows: np.ndarray, batch: int):
        """Mean held-out (next-token CE, MTP CE) over fixed windows."""
        self.trainee.update(cast(self.params, self.dtype))
        ce = mtp = 0.0
        n = 0
        for i in range(0, len(windows), batch):
            w = mx.array(windows[i : i + batch])
            c, m, *_ = forward_losses(self.trainee, w, self.recipe.seq)
            mx.eval(c, m)
            ce += float(c) * len(w)
            mtp += float(m) * len(w)
            n += len(w)
        return ce / n, mtp / n


# --- the loop -----------------------------------------------------------------------------------


def _clock(s):
    s = int(s)
    return f"{s // 60}:{s % 60:02d}"


class Plan:
    """How many steps to run: ``steps``, or with ``minutes`` as many as fit
    that much wall time (training and evaluations; at most ``steps`` when
    given), re-estimated from the measured pace while the run is young. Past
    the deadline the run stops early."""

    REPLAN_AT = (10, 30, 100)

    def __init__(self, steps, minutes, t0, cap=None):
        self.total = steps
        self.minutes = minutes
        self.deadline = t0 + minutes * 60 if minutes else None
        self.cap = cap
        self.stopped_early = False

    def replan(self, step, step_s, eval_s, evals_between, reserve_s):
        if self.deadline is None or step not in self.REPLAN_AT or step >= self.total // 2:
            return
        left = self.deadline - time.time() - reserve_s
        fit = int(left / step_s)
        for _ in range(3):  # the evaluations still to come take their share
            fit = int((left - evals_between(step, step + fit) * eval_s) / step_s)
        total = step + max(1, fit)
        self.total = min(total, self.cap) if self.cap else total

    def over(self, reserve_s):
        if self.deadline is not None and time.time() + reserve_s > self.deadline:
            self.stopped_early = True
            return True
        return False


@dataclass
class Data:
    tokenizer: object
    train_ids: np.ndarray
    held_ids: np.ndarray
    held_docs: list
    corpus: dict
    unigram: float


def prepare_data(corpus: str, vocab_size: int, log) -> Data:
    """Read and split the corpus, train the tokenizer on the training
    documents, tokenize both parts."""
    t = time.time()
    docs, info = train_data.load_documents(corpus)
    train_docs, held_docs = train_data.split(docs)
    tok = synth_tokenizer.train(vocab_size, train_docs)
    eos = tok.token_to_id("<|endoftext|>")
    train_ids = train_data.tokenize(tok, train_docs, eos)
    held_ids = train_data.tokenize(tok, held_docs, eos)
    unigram = train_data.unigram_loss(train_ids, held_ids, vocab_size)
    log(f"corpus {info['path']}: {info['bytes'] / 1e6:.1f} MB, {len(train_docs)}+{len(held_docs)} documents, "
        f"{len(train_ids)} training and {len(held_ids)} held-out tokens (vocab {tok.get_vocab_size()}); "
        f"unigram held-out loss {unigram:.3f}; ready in {time.time() - t:.0f}s")
    return Data(tok, train_ids, held_ids, held_docs, info, unigram)


def _point(step, tokens, t0, ce, mtp, with_mtp, **more):
    p = {"step": step, "tokens": tokens, "seconds": round(time.time() - t0, 1), "heldout_loss": round(ce, 4)}
    if with_mtp:
        p["mtp_heldout_loss"] = round(mtp, 4)
    return {**p, **{k: round(v, 4) for k, v in more.items()}}


def judge_reserve(eval_s: float, judge: bool = True) -> float:
    """Seconds kept for writing the folder and, when it is judged, a few
    evaluations' worth and on a GPU the first use of the quantized kernels
    (compiled then)."""
    if not judge:
        return 30
    gpu = mx.default_device().type == mx.DeviceType.gpu
    return 45 + 3 * eval_s + (120 if gpu else 0)


def run(trainer: Trainer, batches, held, plan: Plan, log, judge=True) -> (list, int):
    """The training loop: (loss curve, steps run)."""
    r = trainer.recipe
    with_mtp = bool(trainer.trainee.num_mtp)
    per_step = r.batch * r.seq
    t0 = time.time()
    te = time.time()
    curve = [_point(0, 0, t0, *trainer.evaluate(held, max(r.batch, 16)), with_mtp)]
    eval_s = time.time() - te
    log(f"held-out loss {curve[0]['heldout_loss']:.3f} at step 0 ({eval_s:.0f}s)")
    step, times, ema, last_eval = 0, [], None, 0
    while step < plan.total:
        reserve = judge_reserve(eval_s, judge) + (times[-1] if times else 0)
        if step and plan.over(reserve):
            log(f"time is up at step {step}: stopping {plan.total - step} steps early")
            break
        ts = time.time()
        loss, (ce, mtp_ce, aux, z) = trainer.step(batches.next(), trainer.lr(step, plan.total))
        step += 1
        times.append(time.time() - ts)
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at step {step}")
        ema = ce if ema is None else 0.95 * ema + 0.05 * ce
        every = min(r.eval_every, max(10, plan.total // 10))
        # the step-0 evaluation's time holds the kernels' compile (55 s on
        # the H200, later ones 2 s): the first replan times one of its own
        if step % every == 0 or step == plan.total or step == Plan.REPLAN_AT[0]:
            te = time.time()
            hce, hmtp = trainer.evaluate(held, max(r.batch, 16))
            eval_s = time.time() - te
            last_eval = step
            curve.append(_point(step, step * per_step, t0, hce, hmtp, with_mtp, train_loss=ema, aux=aux, z=z))
        plan.replan(step, float(np.median(times[2:] or times)), eval_s,
                    lambda a, b: b // every - a // every + 1, reserve)
        if step % 10 == 0 or step == last_eval:
            el = time.time() - t0
            eta = (plan.total - step) * float(np.median(times[-20:]))
            held_s = f"  held-out {curve[-1]['heldout_loss']:.3f}" if last_eval == step else ""
            mtp_s = f"  mtp {mtp_ce:.3f}" if with_mtp else ""
            log(f"step {step}/{plan.total}  loss {ema:.3f}{mtp_s}  aux {aux:.3f}  z {z:.2f}{held_s}  "
                f"{step * per_step / el:.0f} tok/s  {_clock(el)} elapsed  eta {_clock(eta)}")
    if last_eval != step:
        curve.append(_point(step, step * per_step, t0, *trainer.evaluate(held, max(r.batch, 16)), with_mtp, train_loss=ema or 0))
    return curve, step


def default_experts() -> str:
    """GroupedGLU on a CPU (~8x faster than gather_mm there); on a GPU
    mlx-lm's own sorted gather_mm, which needs no host sync."""
    return "gather" if mx.default_device().type == mx.DeviceType.gpu else "grouped"


def default_delta() -> str:
    """qwen3_next's recurrence in chunks on a GPU, where mlx-lm's token-by-token
    ops ran the H200 out of memory at the small preset; on a CPU mlx-lm's own
    (the committed tiny checkpoints were trained so)."""
    return "chunks" if mx.default_device().type == mx.DeviceType.gpu else "steps"


def train(arch, preset, out: Path, corpus="stdlib", minutes=None, seed=0, steps=None, dtype="float32",
          layers=None, batch=None, seq=None, quant="affine4", judge=True, log=print, experts=None,
          compiled=False, delta=None, **recipe_overrides) -> dict:
    """Train, write the model folder into ``out`` (which must exist) and
    judge it; returns what it also writes as ``train.json``."""
    t_start = time.time()
    p = PRESETS[preset]
    recipe = Recipe(seq=seq or p["seq"], batch=batch or p["batch"], steps=steps or p["steps"],
                    lr=p["lr"], eval_every=p["eval_every"], **recipe_overrides)
    config = make_config(arch, preset, layers)
    # timed: start from the preset's count until the pace is measured
    plan = Plan(min(recipe.steps, p["steps"]) if minutes else recipe.steps, minutes, t_start, cap=steps)
    hint = blas_hint()
    if hint:
        log(hint)
    data = prepare_data(corpus, config["vocab_size"], log)

    mx.random.seed(seed)
    experts = experts or default_experts()
    delta = delta or default_delta()
    trainee = Trainee(config, experts, delta)
    init_weights(trainee, config["num_hidden_layers"])
    extra = 2 if trainee.num_mtp else 1
    batches = train_data.Batches(data.train_ids, recipe.batch, recipe.seq, seed, extra)
    held = train_data.eval_windows(data.held_ids, recipe.seq, extra, recipe.eval_windows)
    trainer = Trainer(trainee, recipe, DTYPES[dtype], compiled)
    n_params = sum(v.size for _, v in tree_flatten(trainer.params))
    log(f"{arch} {preset}: {n_params / 1e6:.1f}M parameters, {recipe.batch}x{recipe.seq} tokens a step, "
        f"{recipe.steps} steps{f' or {minutes} minutes' if minutes else ''}, {dtype} on {mx.default_device()}, "
        f"experts {experts}{' (compiled step)' if compiled else ''}"
        + (f", linear attention in {delta}" if arch == "qwen3_next" else ""))
    t0 = time.time()
    curve, step = run(trainer, batches, held, plan, log, judge)
    train_s = time.time() - t0

    files = write_folder(out, trainer, config, data.tokenizer, quant, DTYPES[dtype])
    sample = train_data.heldout_sample(data.held_docs)
    (out / HELDOUT_FILE).write_text(sample, encoding="utf-8")
    judged = {}
    if judge:
        from infer.train.eval import evaluate

        te = time.time()
        judged = evaluate(out, sample)
        log(summary_line(judged) + f" ({time.time() - te:.0f}s)")
    final = curve[-1]
    report = {
        "arch": arch, "preset": preset, "seed": seed,
        "heldout_loss": final["heldout_loss"], "unigram_loss": round(data.unigram, 4),
        "train_loss": final.get("train_loss"),
        **({"mtp_heldout_loss": final["mtp_heldout_loss"]} if trainee.num_mtp else {}),
        "tokens_seen": step * recipe.batch * recipe.seq, "steps": step, "planned_steps": plan.total,
        "stopped_early": plan.stopped_early,
        "minutes": round((time.time() - t_start) / 60, 2), "train_minutes": round(train_s / 60, 2),
        "cpu_minutes": round(time.process_time() / 60, 2),  # this process' CPU time: the figure a shared machine keeps
        "minutes_limit": minutes,
        "parameters": n_params, "dtype": dtype, "quantization": quant, "experts": experts, "compiled": compiled,
        **({"delta": delta} if arch == "qwen3_next" else {}),
        "recipe": vars(recipe),
        "corpus": data.corpus, "train_tokens": int(len(data.train_ids)), "heldout_tokens": int(len(data.held_ids)),
        "tokenizer_vocab": data.tokenizer.get_vocab_size(),
        "device": str(mx.default_device()), "machine": platform.machine(),
        "mlx": mx.__version__, "mlx_lm": _mlx_lm_version(),
        "reproduce": f"infer train --arch {arch} --preset {preset} --seed {seed} --steps {step} --dtype {dtype}"
                     + (f" --corpus {corpus}" if corpus != "stdlib" else "")
                     + (f" --layers {layers}" if layers else "") + (f" --batch {batch}" if batch else "")
                     + (f" --seq {seq}" if seq else "") + (f" --experts {experts}" if experts != default_experts() else "")
                     + (" --compile" if compiled else "")
                     + (f" --delta {delta}" if arch == "qwen3_next" and delta != default_delta() else "")
                     + (f" --aux-coef {recipe.aux_coef:g}" if recipe.aux_coef != Recipe.aux_coef else ""),
        "curve": curve,
        "files": files + [HELDOUT_FILE, "train.json"],
        **({"eval": {"text": HELDOUT_FILE, **judged}} if judged else {}),
    }
    (out / "train.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def blas_hint():
    """A line saying how to get fast float32 matmuls on Linux, when they are slow.

    The mlx[cpu] wheel bundles the reference BLAS, ~15x slower than
    OpenBLAS at the matmuls of training; a preloaded OpenBLAS takes over."""
    if mx.default_device().type != mx.DeviceType.cpu or not Path("/proc/self/maps").exists():
        return None
    libs = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "blas" in line}
    # numpy's own OpenBLAS has prefixed symbols: it does not take over
    others = [p for p in libs if "mlx_cpu.libs" not in p and "scipy_openblas" not in p]
    if any("mlx_cpu.libs/libblas" in p for p in libs) and not others:
        return ("note: MLX runs on the reference BLAS bundled with mlx[cpu]; for ~5x faster training preload "
                "OpenBLAS (Debian: apt-get install libopenblas0-pthread; "
                "LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 OPENBLAS_NUM_THREADS=1)")
    return None


def summary_line(judged: dict) -> str:
    r = judged["routing"]
    rec = " ".join(f"{v:.2f}" for v in r["lookahead_recall"].values())
    line = (f"quantized model on held-out text: lookahead recall@1..3 {rec}, next-token reuse {r['next_token_reuse']:.2f}, "
            f"max load {r['max_load_ratio']:.2f}x, LRU@1/8 {r['lru_hit']['0.125']:.2f}")
    if "mtp_acceptance" in judged:
        line += (f", MTP acceptance {judged['mtp_acceptance']:.2f} (teacher-forced), "
                 f"{judged['mtp_speculative']['rate']:.2f} (greedy decoding)")
    return line


def _mlx_lm_version():
    import mlx_lm

    return mlx_lm.__version__


# --- writing the folder -------------------------------------------------------------------------


def write_folder(out: Path, trainer: Trainer, config: dict, tok, quant: str, dtype) -> dict:
    """Weights (quantized by mlx-lm), config, tokenizer and the MTP head."""
    from mlx_lm.utils import quantize_model, save_config, save_model

    from infer.synth.synth import QUANTS, build_model

    params = dict(tree_flatten(trainer.params))
    model, _ = build_model(config)
    model.load_weights([(k[len("model."):], v) for k, v in params.items() if k.startswith("model.")])
    model.update(cast(model.parameters(), dtype))
    q = QUANTS[quant] if quant != "none" else None
    cfg = dict(config)
    cfg["torch_dtype"] = str(dtype).split(".")[-1]
    with _quiet():
        if q:
            model, cfg = quantize_model(model, cfg, q["group_size"], q["bits"], mode=q["mode"])
        mx.eval(model.parameters())
        save_model(out, model)
    files = ["model.safetensors"]
    mtp_keys = {k: v for k, v in params.items() if k.startswith("mtp.")}
    if mtp_keys:
        from mlx_lm.models.qwen3_next import Model as NextModel

        root = nn.Module()
        root.mtp = MTPHead(trainer.trainee.args, config["mtp_num_hidden_layers"])
        root.load_weights(list(mtp_keys.items()))
        root.update(cast(root.parameters(), dtype))
        if q:
            with _quiet():
                _, mcfg = quantize_model(root, {}, q["group_size"], q["bits"], mode=q["mode"],
                                         quant_predicate=NextModel.quant_predicate.fget(None))
            # the head's per-path overrides (8-bit routers) join the model's
            for path, v in mcfg["quantization"].items():
                if isinstance(v, dict):
                    cfg["quantization"][path] = v
        mx.save_safetensors(str(out / MTP_FILE), dict(tree_flatten(root.parameters())), metadata={"format": "mlx"})
        files.append(MTP_FILE)
    synth_tokenizer.save(out, config["vocab_size"], tok)
    save_config(cfg, out / "config.json")
    return files + ["model.safetensors.index.json", "config.json", "tokenizer.json", "tokenizer_config.json"]


class _quiet:
    """mlx-lm's quantize_model prints its bits per weight on stdout."""

    def __enter__(self):
        self._old = sys.stdout
        sys.stdout = open(os.devnull, "w")

    def __exit__(self, *exc):
        sys.stdout.close()
        sys.stdout = self._old


# --- command line -------------------------------------------------------------------------------


def parse(argv):
    ap = argparse.ArgumentParser(prog="infer train", description="train a small MoE language model (mlx-lm format)")
    ap.add_argument("--arch", help=f"one of {', '.join(ARCHS)}")
    ap.add_argument("--preset", default="tiny", help=f"one of {', '.join(PRESETS)}")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--corpus", default="stdlib",
                    help="corpus file (documents separated by <|endoftext|> lines), or 'stdlib' (default)")
    ap.add_argument("--minutes", type=float, help="wall-time limit for training with its evaluations")
    ap.add_argument("--steps", type=int, help="optimizer steps (the preset's by default; an upper bound with --minutes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", help="float32 | bfloat16 (compute and saved weights)")
    ap.add_argument("--quant", default="affine4", help="affine4 | affine8 | none")
    ap.add_argument("--layers", type=int, help="override the preset's number of layers")
    ap.add_argument("--batch", type=int, help="override the preset's sequences per step")
    ap.add_argument("--seq", type=int, help="override the preset's tokens per sequence")
    ap.add_argument("--aux-coef", type=float, default=Recipe.aux_coef,
                    help="weight of the load-balancing loss")
    ap.add_argument("--experts", choices=("grouped", "gather"),
                    help="MoE layer kernel: grouped (default on a CPU) or mlx-lm's gather_mm (default on a GPU)")
    ap.add_argument("--delta", choices=("steps", "chunks"),
                    help="qwen3_next's linear attention in training: mlx-lm's token-by-token ops "
                         "(default on a CPU) or in chunks (default on a GPU; far less memory)")
    ap.add_argument("--compile", action="store_true",
                    help="compile the loss and gradient once (mx.compile); needs --experts gather")
    ap.add_argument("--make-corpus", type=Path, metavar="FILE",
                    help="write the corpus file (this Python's stdlib + Debian's python3-doc) and exit")
    ap.add_argument("--force", action="store_true", help="replace a non-empty --out")
    ap.add_argument("--no-judge", action="store_true",
                    help="skip the final figures of the written model (routing, MTP acceptance, samples)")
    return ap.parse_args(argv)


def main(argv) -> int:
    a = parse(argv)
    if a.make_corpus:
        info = train_data.write_corpus(a.make_corpus)
        print(json.dumps(info, indent=1))
        return 0
    if a.arch not in ARCHS:
        return fail(f"--arch must be one of {', '.join(ARCHS)}")
    if a.preset not in PRESETS:
        return fail(f"unknown preset {a.preset!r} (choose from {', '.join(PRESETS)})")
    if a.dtype not in DTYPES:
        return fail(f"unknown dtype {a.dtype!r} (choose from {', '.join(DTYPES)})")
    if a.quant not in ("affine4", "affine8", "none"):
        return fail(f"unknown quantization {a.quant!r} (choose from affine4, affine8, none)")
    for name in ("minutes", "steps", "layers", "batch", "seq"):
        v = getattr(a, name)
        if v is not None and v <= 0:
            return fail(f"--{name} must be positive")
    experts = a.experts or default_experts()
    if a.compile and experts != "gather":
        return fail("--compile needs --experts gather (grouped experts read the routing on the host)")
    if a.aux_coef < 0:
        return fail("--aux-coef must be >= 0")
    if a.delta and a.arch != "qwen3_next":
        return fail("--delta applies to qwen3_next (its linear attention) only")
    if a.arch == "qwen3_next" and a.layers is not None and a.layers < 4:
        return fail("qwen3_next needs --layers >= 4 (one full-attention layer every 4)")
    if a.out is None:
        return fail("--out DIR is required")
    out = a.out
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not a.force:
        return fail(f"{out} exists and is not empty (use --force to replace it)")
    if a.corpus != "stdlib" and not Path(a.corpus).is_file():
        return fail(f"corpus {a.corpus} is not a file")

    # Build beside the destination and rename at the end: a failed run leaves nothing.
    tmp = out.parent / f".{out.name}.train-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        report = train(a.arch, a.preset, tmp, a.corpus, a.minutes, a.seed, a.steps, a.dtype, a.layers,
                       a.batch, a.seq, a.quant, judge=not a.no_judge, experts=experts, compiled=a.compile,
                       delta=a.delta, aux_coef=a.aux_coef,
                       log=lambda s: print(s, file=sys.stderr, flush=True))
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        os.replace(tmp, out)
    except train_data.CorpusError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        return fail(str(e))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(f"wrote {out}: {a.arch} {a.preset}, held-out loss {report['heldout_loss']:.3f} "
          f"(unigram {report['unigram_loss']:.3f}), {report['tokens_seen']} tokens in {report['minutes']:.1f} min, "
          f"{size / 1e6:.1f} MB")
    return 0
