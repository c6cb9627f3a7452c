"""Text corpora and token batches for `infer train`.

A corpus is one UTF-8 text file of documents separated by ``SEPARATOR``
lines, so it can be built once, hashed, carried to another machine and read
back identically. ``stdlib`` names a corpus built on the fly from the running
Python's standard library sources (always present, so tests need nothing
else). Every ``HELDOUT_EVERY``-th document is held out from training.
"""

import hashlib
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import List

import numpy as np

SEPARATOR = "\n<|endoftext|>\n"
HELDOUT_EVERY = 50  # documents 7, 57, 107, ... are held out
HELDOUT_OFFSET = 7
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "idlelib", "lib2to3"}
DOC_DIR = Path("/usr/share/doc/python3/html/_sources")  # Debian's python3-doc


class CorpusError(ValueError):
    pass


def stdlib_files(root=None) -> List[Path]:
    """The standard library's .py files (no tests, no installed packages), sorted."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).parts
        if not SKIP_DIRS.intersection(rel[:-1]):
            files.append(p)
    return files


def doc_files(root=DOC_DIR) -> List[Path]:
    """The reStructuredText sources of the Python documentation, sorted."""
    root = Path(root)
    return sorted(root.rglob("*.rst.txt")) if root.is_dir() else []


def read_documents(paths) -> List[str]:
    docs = []
    for p in paths:
        text = p.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n").strip()
        if text and SEPARATOR.strip() not in text:
            docs.append(text)
    return docs


def write_corpus(path, stdlib_root=None, doc_root=DOC_DIR) -> dict:
    """Write the stdlib sources and the Python docs as one corpus file; returns its info."""
    code, docs = stdlib_files(stdlib_root), doc_files(doc_root)
    if not docs:
        print(f"infer train: no Python documentation under {doc_root} "
              "(apt-get install python3-doc); the corpus is code only", file=sys.stderr)
    texts = read_documents(code) + read_documents(docs)
    Path(path).write_text(SEPARATOR.join(texts), encoding="utf-8")
    info = corpus_info(path, len(texts))
    root = stdlib_root or f"{sysconfig.get_paths()['stdlib']} (Python {sys.version.split()[0]})"
    info["origin"] = f"{len(code)} .py files of {root}, {len(docs)} .rst.txt files of {doc_root}"
    return info


def corpus_info(path, documents=None) -> dict:
    data = Path(path).read_bytes()
    if documents is None:
        documents = data.decode("utf-8").count(SEPARATOR) + 1
    return {"path": str(path), "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
            "documents": documents}


def load_documents(corpus: str) -> (List[str], dict):
    """(documents, info) of a corpus file, or of ``stdlib``."""
    if corpus == "stdlib":
        files = stdlib_files()
        docs = read_documents(files)
        data = SEPARATOR.join(docs).encode()
        info = {"path": "stdlib", "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
                "documents": len(docs),
                "origin": f"{len(files)} .py files of {sysconfig.get_paths()['stdlib']} (Python {sys.version.split()[0]})"}
        return docs, info
    path = Path(corpus)
    if not path.is_file():
        raise CorpusError(f"corpus {corpus} is not a file (give a corpus file or 'stdlib')")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise CorpusError(f"corpus {corpus} is not UTF-8 text") from None
    docs = [d for d in text.split(SEPARATOR) if d.strip()]
    if len(docs) < 2:
        raise CorpusError(f"corpus {corpus} has fewer than 2 documents (separated by {SEPARATOR.strip()!r} lines)")
    info = corpus_info(path, len(docs))
    return docs, info


def split(docs: List[str]):
    """(train, heldout) documents: every HELDOUT_EVERY-th one is held out
    (at least one when there are few)."""
    every = min(HELDOUT_EVERY, len(docs))
    offset = HELDOUT_OFFSET % every
    held = [d for i, d in enumerate(docs) if i % every == offset]
    train = [d for i, d in enumerate(docs) if i % every != offset]
    return train, held


def tokenize(tokenizer, docs: List[str], eos_id: int) -> np.ndarray:
    """All documents as one int32 stream, each followed by ``eos_id``."""
    out = []
    for enc in tokenizer.encode_batch(docs):
        out.append(np.asarray(enc.ids, dtype=np.int32))
        out.append(np.asarray([eos_id], dtype=np.int32))
    return np.concatenate(out)


@dataclass
class Batches:
    """Random windows of ``seq + extra`` tokens from a token stream, drawn
    from a seeded generator: the same seed gives the same batches."""

    tokens: np.ndarray
    batch: int
    seq: int
    seed: int
    extra: int = 1  # targets past the window: 1, or 2 with an MTP head

    def __post_init__(self):
        self.rng = np.random.default_rng(self.seed)
        if len(self.tokens) < self.seq + self.extra + 1:
            raise CorpusError(f"{len(self.tokens)} tokens are fewer than one window of {self.seq + self.extra}")

    def next(self) -> np.ndarray:
        hi = len(self.tokens) - self.seq - self.extra
        starts = self.rng.integers(0, hi + 1, size=self.batch)
        idx = starts[:, None] + np.arange(self.seq + self.extra)[None]
        return self.tokens[idx]


def eval_windows(tokens: np.ndarray, seq: int, extra: int, count: int) -> np.ndarray:
    """``count`` evenly spaced, fixed windows over a (held-out) stream."""
    hi = len(tokens) - seq - extra
    if hi < 0:
        raise CorpusError(f"held-out text has {len(tokens)} tokens, fewer than one window of {seq + extra}")
    starts = np.linspace(0, hi, num=max(1, count)).astype(np.int64)
    return tokens[starts[:, None] + np.arange(seq + extra)[None]]


def unigram_loss(train: np.ndarray, heldout: np.ndarray, vocab: int) -> float:
    """Held-out cross-entropy (nats/token) of the add-one unigram model of ``train``."""
    counts = np.bincount(train, minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[heldout].mean())


def heldout_sample(held: List[str], per_doc: int = 1000) -> str:
    """A text of the held-out documents for routing and drafting figures:
    the first ~``per_doc`` characters (whole lines) of each, taken from both
    ends of the list in turn (the corpus holds code first, then prose)."""
    order = []
    lo, hi = 0, len(held) - 1
    while lo <= hi:
        order.append(held[lo])
        if hi != lo:
            order.append(held[hi])
        lo, hi = lo + 1, hi - 1
    parts = []
    for doc in order:
        cut = doc.find("\n", per_doc)
        parts.append(doc if cut < 0 else doc[:cut])
    return SEPARATOR.join(parts) + "\n"
