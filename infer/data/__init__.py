"""Text shipped with the package: the corpus synthetic tokenizers, calibrations and benchmarks read."""

from pathlib import Path

CORPUS = Path(__file__).with_name("corpus.txt")
