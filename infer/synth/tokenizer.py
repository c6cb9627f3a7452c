"""A small byte-level BPE tokenizer trained on the packaged corpus (no network)."""

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from infer.data import CORPUS

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|im_end|>"

# ChatML, as Qwen models use it.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def corpus_text() -> str:
    return CORPUS.read_text(encoding="utf-8")


def train(vocab_size: int, texts=None) -> Tokenizer:
    """Byte-level BPE with at most ``vocab_size`` tokens (fewer if the corpus
    runs out of merges), trained on ``texts`` (default: the packaged corpus)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    if texts is None:
        texts = [p for p in corpus_text().split("\n\n") if p.strip()]
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save(folder, vocab_size: int, tok: Tokenizer = None) -> int:
    """Write tokenizer.json and tokenizer_config.json (of ``tok``, else of a
    tokenizer trained on the packaged corpus); returns its vocab size."""
    folder = Path(folder)
    tok = tok or train(vocab_size)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "model_max_length": 32768,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tok.get_vocab_size()
