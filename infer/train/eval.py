"""Judging a trained model folder: MTP acceptance, greedy samples, routing.

``mtp_acceptance`` is the share of positions where the MTP head's argmax
equals the main model's greedy next-next token: teacher-forced on a text
(the head gets the true next token, as a drafter gets the committed one),
or end to end in greedy speculative decoding with one draft token.
"""

from pathlib import Path

import mlx.core as mx

PROMPTS = (
    "import os\nimport sys\n\n\ndef ",
    "class Queue:\n    \"\"\"",
    "The :mod:`json` module",
    "    def __init__(self, ",
)


def load_resident(folder):
    """(model, tokenizer, MTP head or None) of an mlx-lm folder, all in memory."""
    import mlx_lm

    from infer.spec.mtp import has_mtp, load_mtp

    model, tokenizer = mlx_lm.load(str(folder))
    head = load_mtp(folder, model) if has_mtp(folder) else None
    return model, tokenizer, head


def _hidden_and_logits(model, ids):
    h = model.model(mx.array(ids)[None])
    if getattr(model.args, "tie_word_embeddings", False):
        return h, model.model.embed_tokens.as_linear(h)
    return h, model.lm_head(h)


def mtp_acceptance(model, head, tokens) -> float:
    """Teacher-forced acceptance of one MTP draft over ``tokens``: at each
    position i, does head(h[i], token i+1) pick the main model's greedy
    choice at i+1?"""
    from mlx_lm.models.cache import KVCache

    h, logits = _hidden_and_logits(model, tokens)
    greedy = mx.argmax(logits[0], axis=-1)  # greedy[i]: the main model's choice for token i+1
    embeds = model.model.embed_tokens(mx.array(tokens[1:])[None])
    g = head(h[:, :-1], embeds, [KVCache() for _ in head.layers])
    draft = mx.argmax(_lm_head(model, g)[0], axis=-1)  # draft[i]: for token i+2
    hits = draft == greedy[1:]
    return float(mx.mean(hits.astype(mx.float32)))


def _lm_head(model, h):
    if getattr(model.args, "tie_word_embeddings", False):
        return model.model.embed_tokens.as_linear(h)
    return model.lm_head(h)


def speculative_acceptance(model, head, prompts, max_tokens=64) -> dict:
    """Accepted / drafted in greedy speculative decoding with one MTP draft."""
    from infer.spec.mtp import MTPDrafter
    from infer.spec.decoder import speculative_generate

    drafted = accepted = 0
    for ids in prompts:
        stats = None
        for _, stats in speculative_generate(model, ids, draft="mtp", num_draft=1, max_tokens=max_tokens,
                                             mtp=MTPDrafter(head, model), exact=False):
            pass
        drafted += stats.drafted
        accepted += stats.accepted
    return {"drafted": drafted, "accepted": accepted, "rate": accepted / max(drafted, 1)}


def greedy_samples(model, tokenizer, prompts=PROMPTS, max_tokens=48) -> list:
    """Greedy continuations of corpus-like prompts."""
    from mlx_lm.generate import generate_step

    out = []
    for p in prompts:
        ids = tokenizer.encode(p)
        toks = [t for t, _ in generate_step(mx.array(ids), model, max_tokens=max_tokens)]
        out.append({"prompt": p, "continuation": tokenizer.decode(toks)})
    return out


def evaluate(folder, text: str, routing_tokens=2048, mtp_tokens=1024) -> dict:
    """Routing summary, MTP acceptance and greedy samples of a model folder on a held-out text."""
    from infer.tools import routing

    folder = Path(folder)
    model, tokenizer, head = load_resident(folder)
    ids = tokenizer.encode(text)
    out = {"samples": greedy_samples(model, tokenizer)}
    if head is not None:
        out["mtp_acceptance"] = mtp_acceptance(model, head, ids[:mtp_tokens])
        prompts = [tokenizer.encode(p) for p in PROMPTS]
        out["mtp_speculative"] = speculative_acceptance(model, head, prompts)
    layers, counts = routing.route(model, ids[:routing_tokens])
    out["routing"] = routing.summarize(layers, counts)["summary"]
    return out


def plot_curves(reports: dict, path):
    """Held-out loss against tokens seen, one line per ``name -> train.json``
    (a dict), with each model's unigram loss dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for i, (name, rep) in enumerate(reports.items()):
        pts = rep["curve"]
        ax.plot([p["tokens"] / 1e6 for p in pts], [p["heldout_loss"] for p in pts], "o-", ms=3, color=f"C{i}",
                label=f"{name} held-out")
        if "mtp_heldout_loss" in pts[-1]:
            ax.plot([p["tokens"] / 1e6 for p in pts], [p["mtp_heldout_loss"] for p in pts], ":", color=f"C{i}",
                    label=f"{name} MTP (token i+2)")
        ax.axhline(rep["unigram_loss"], ls="--", lw=0.8, color=f"C{i}", alpha=0.6)
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("held-out loss (dashed: unigram model)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
