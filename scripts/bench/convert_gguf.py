"""llama.cpp's convert_hf_to_gguf.py for `infer synth --layout hf` folders.

    python scripts/bench/convert_gguf.py LLAMA_CPP_DIR HF_FOLDER --outtype bf16 --outfile OUT.gguf

The synthetic tokenizer is a byte-level BPE with GPT-2's split regex, which
the converter does not know by its hash: it is named "gpt-2" here (the same
pre-tokenizer). Everything else is the converter as it is; run it with an
interpreter that has its requirements (torch, gguf, transformers).
"""

import runpy
import sys
from pathlib import Path

root = Path(sys.argv.pop(1)).resolve()
sys.path[:0] = [str(root), str(root / "gguf-py")]
sys.argv[0] = str(root / "convert_hf_to_gguf.py")
try:  # the converter's model classes live in conversion/ in recent llama.cpp
    from conversion import base
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
except ImportError:
    import convert_hf_to_gguf as base
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
runpy.run_path(sys.argv[0], run_name="__main__")
