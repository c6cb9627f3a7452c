"""Qwen3-Next's multi-token-prediction (MTP) head, as a drafter.

The head (as in the reference implementations of qwen3_next_mtp):
``fc(concat(pre_fc_norm_embedding(embed(t[i+1])), pre_fc_norm_hidden(h[i])))``,
one full-attention decoder layer with a sparse MoE block, then ``norm``; the
logits come from the main model's lm_head, the embedding is the main model's.
``h[i]`` is the main model's final hidden state at position i (after its final
norm, what the lm_head sees), and the head's output predicts token i+2.

The layer is mlx-lm's own ``Qwen3NextDecoderLayer``; its experts stream
through the main model's ExpertStore when the prep folder has a blob for them
(manifest module ``mtp.layers.{i}.mlp.switch_mlp``), else they are loaded
resident from ``mtp.safetensors``.
"""

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

MTP_FILE = "mtp.safetensors"


class MTPError(ValueError):
    pass


def has_mtp(model_dir) -> bool:
    """Whether a model folder carries an MTP head we can draft with."""
    model_dir = Path(model_dir)
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return config.get("model_type") == "qwen3_next" and (model_dir / MTP_FILE).exists()


def drafts_with_mtp(draft: str, model_dir) -> bool:
    """Whether ``--draft`` will call the folder's MTP head (mtp, or auto
    with a head): then its expert layers share the cache."""
    return draft in ("mtp", "auto") and has_mtp(model_dir)


class MTPHead(nn.Module):
    def __init__(self, args, num_layers=1):
        super().__init__()
        from mlx_lm.models.qwen3_next import Qwen3NextDecoderLayer

        h = args.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.norm = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.pre_fc_norm_embedding = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(h, eps=args.rms_norm_eps)
        # full attention: the layer index of a full-attention layer
        full = args.full_attention_interval - 1
        self.layers = [Qwen3NextDecoderLayer(args, full) for _ in range(num_layers)]

    def __call__(self, hidden, embeds, cache):
        x = mx.concatenate(
            [self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], axis=-1
        )
        x = self.fc(x)
        mask = create_attention_mask(x, cache[0])
        for layer, c in zip(self.layers, cache):
            x = layer(x, mask, c)
        return self.norm(x)


def _hf_norms(weights, metadata):
    """Whether the norm weights are in Hugging Face's zero-centred convention.

    Files written by mlx (``infer synth``, mlx-lm) say ``format: mlx`` and hold
    the weight itself; a Hugging Face checkpoint's Qwen3-Next norms hold
    weight - 1 (mlx-lm adds 1 when it converts the main model).
    """
    conv = metadata.get("norms") or ("mlx" if metadata.get("format") == "mlx" else "hf")
    return conv == "hf"


def load_mtp(model_dir, model, store=None, manifest=None, experts=None):
    """The MTP head of ``model`` (an mlx-lm qwen3_next Model) from ``model_dir``.

    Its experts stream through ``store`` when ``manifest`` has their blob;
    ``experts`` ({tensor name: array}, e.g. read from that blob) loads them
    resident instead.
    """
    from infer.runtime.streaming import patch_model

    model_dir = Path(model_dir)
    if not has_mtp(model_dir):
        raise MTPError(f"{model_dir} has no MTP head ({MTP_FILE} of a qwen3_next model)")
    config = json.loads((model_dir / "config.json").read_text())
    weights, metadata = mx.load(str(model_dir / MTP_FILE), return_metadata=True)
    if experts:
        weights = {**weights, **experts}
    ids = {int(k.split(".")[2]) for k in weights if k.startswith("mtp.layers.")}
    num_layers = config.get("mtp_num_hidden_layers", max(ids, default=0) + 1)

    root = nn.Module()
    root.mtp = MTPHead(model.args, num_layers)
    streamed = []
    if manifest is not None and store is not None:
        streamed = patch_model(model, manifest, store, root=root)

    quant = config.get("quantization") or config.get("quantization_config")
    if quant:
        default = {k: quant[k] for k in ("group_size", "bits", "mode") if k in quant}

        def predicate(path, module):
            if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
                return False
            override = quant.get(path)
            return {**default, **override} if isinstance(override, dict) else default

        nn.quantize(root, class_predicate=predicate)

    if _hf_norms(weights, metadata):
        weights = {
            k: (v + 1.0 if k.endswith("norm.weight") and v.ndim == 1 else v)
            for k, v in weights.items()
        }
    if any(".mlp.experts." in k for k in weights):
        raise MTPError(f"{MTP_FILE}: per-expert tensors are not supported, stack them")
    params = dict(tree_flatten(root.parameters()))
    unknown = sorted(set(weights) - set(params))
    if unknown:
        raise MTPError(f"{MTP_FILE}: unexpected tensors {unknown[:3]}")
    expert_tag = ".mlp.switch_mlp."
    missing = sorted(
        k for k in params
        if k not in weights and not (streamed and expert_tag in k)
    )
    if missing:
        raise MTPError(f"{MTP_FILE}: missing tensors {missing[:3]}")
    root.load_weights(list(weights.items()), strict=False)
    mx.eval(root.parameters())
    root.eval()
    return root.mtp


class MTPDrafter:
    """Drafts with an MTP head over the main model's hidden states.

    ``observe(hidden, tokens)`` takes the main model's hidden states of the
    positions whose next token is now committed, and those next tokens; the
    pairs are fed to the head lazily, at the next ``propose``. Draft steps
    after the first feed the head its own output, and are trimmed from its
    KV cache at the next ``propose``. At most ``MAX_BACKLOG`` positions wait:
    beyond that (plain decoding under ``--draft auto``, which proposes only
    now and then) the oldest are dropped and the head starts a fresh cache,
    so a proposal never costs a pass over everything since the prefill.
    """

    needs_hidden = True
    MAX_BACKLOG = 8

    def __init__(self, head, model):
        self.head = head
        self.model = model
        self.cache = [KVCache() for _ in head.layers]
        self.pending = []  # (hidden, tokens) not yet fed
        self.speculative = 0  # entries of drafted positions in the head's cache
        self.last = None  # the head's output for the last real pair

    def _embed(self, tokens):
        return self.model.model.embed_tokens(mx.array(tokens)[None])

    def _logits(self, h):
        m = self.model
        if getattr(m.args, "tie_word_embeddings", False):
            return m.model.embed_tokens.as_linear(h)
        return m.lm_head(h)

    def observe(self, hidden, tokens):
        self.pending.append((hidden, [int(t) for t in tokens]))
        if self.backlog > self.MAX_BACKLOG and len(self.pending) > 1:
            # a gap in the head's context: restart it on the recent positions
            while self.backlog > self.MAX_BACKLOG and len(self.pending) > 1:
                self.pending.pop(0)
            self.cache = [KVCache() for _ in self.head.layers]
            self.speculative = 0
            self.last = None

    @property
    def backlog(self) -> int:
        """Positions observed and not yet fed to the head."""
        return sum(len(ts) for _, ts in self.pending)

    def propose(self, k):
        """Up to ``k`` draft tokens, as ints (one host sync for all)."""
        drafts = self.propose_lazy(k)
        if drafts is None:
            return []
        return [int(t) for t in drafts.tolist()]

    def propose_lazy(self, k):
        """``k`` draft tokens as an unevaluated array (None for k <= 0), so a
        verify pass can take them without a host sync in between."""
        if self.speculative:
            for c in self.cache:
                c.trim(self.speculative)
            self.speculative = 0
        if self.pending:
            hidden = mx.concatenate([h for h, _ in self.pending], axis=1)
            tokens = [t for _, ts in self.pending for t in ts]
            self.pending = []
            out = self.head(hidden, self._embed(tokens), self.cache)
            self.last = out[:, -1:, :]
        if k <= 0:
            if self.last is not None:
                mx.eval(self.last)  # the pending pairs are read now
            return None
        # a streamed head still syncs at its router, as any MoE layer
        drafts = []
        g = self.last
        for i in range(k):
            if i > 0:
                g = self.head(g, self.model.model.embed_tokens(drafts[-1].reshape(1, 1)), self.cache)
                self.speculative += 1
            drafts.append(mx.argmax(self._logits(g)[0, -1], axis=-1))
        return mx.stack(drafts)
