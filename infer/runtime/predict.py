"""Expert prediction: which experts the next MoE layers will route to.

Predictors, each a guess for MoE layer L+d made at layer L's MoE block:

- ``router``: layer L+d's router applied to layer L's MoE-block input (what
  ``Prefetcher.predict`` does without a calibration);
- ``linear``: a least-squares linear map from layer L's MoE-block input to
  layer L+d's router logits, fitted on a calibration text (ridge regularized);
- ``temporal``: the experts layer L+d used for the previous token.

``fit`` runs a model over a calibration text: the first three quarters fit
the linear maps, the last quarter measures every predictor (how often the
guess at each rank is used), and per (layer, depth) the combined predictor
takes the best one there and a breadth: top k, widened while an extra guess
is used at least ``MIN_USE`` of the time and precision stays at least
``MIN_PRECISION``. ``infer prep --calibrate TEXT`` stores it beside the
manifest (``CALIBRATION_NAME``); ``ExpertStore`` loads it when present.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np

from infer.args import first_line

CALIBRATION_NAME = "predict.npz"
DEPTHS = (1, 2, 3)
NAMES = ("router", "linear", "temporal")
RIDGE = 1e-3  # of the mean feature energy: keeps the fit stable on short texts
MIN_USE = 0.15  # an extra guess is worth a read when it is used this often
# ... and one used at least SPARE_USE of the time when the disk would be idle:
# while the reads planned stay within SPARE of what it reads in time
SPARE_USE, SPARE = 0.03, 0.5
MIN_PRECISION = 0.5
CHUNK = 256
DEFAULT_TOKENS = 4096


class CalibrationError(ValueError):
    """A calibration file that cannot be used as one (the message is one line)."""


@dataclass
class Calibration:
    """Fitted maps, measured use per rank, and the combined predictor's choices.

    Keys are expert-module paths (as in the manifest), so a prep folder and
    its source folder share one calibration."""

    maps: Dict[Tuple[str, str], Tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    # (source module, depth, predictor) -> share of guesses at each rank that were used
    use: Dict[Tuple[str, int, str], np.ndarray] = field(default_factory=dict)
    # (source module, depth) -> (predictor, breadth)
    choice: Dict[Tuple[str, int], Tuple[str, int]] = field(default_factory=dict)
    text: dict = field(default_factory=dict)

    def save(self, folder) -> Path:
        modules = sorted({m for pair in self.maps for m in pair} | {s for s, _ in self.choice})
        idx = {m: i for i, m in enumerate(modules)}
        arrays, maps = {}, []
        for n, ((src, dst), (w, b)) in enumerate(sorted(self.maps.items())):
            arrays[f"w{n}"], arrays[f"b{n}"] = w.astype(np.float32), b.astype(np.float32)
            maps.append([idx[src], idx[dst]])
        meta = {
            "modules": modules, "maps": maps, "text": self.text,
            "use": [[idx[s], d, name, u.tolist()] for (s, d, name), u in sorted(self.use.items())],
            "choice": [[idx[s], d, name, b] for (s, d), (name, b) in sorted(self.choice.items())],
        }
        arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
        path = Path(folder) / CALIBRATION_NAME
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, **arrays)
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path) -> Optional["Calibration"]:
        """The calibration at ``path`` (a file, or a folder holding one), or None."""
        path = Path(path)
        if path.is_dir():
            path = path / CALIBRATION_NAME
        if not path.is_file():
            return None
        try:
            with np.load(path) as z:
                meta = json.loads(bytes(z["meta"]).decode())
                mods = meta["modules"]
                maps = {(mods[s], mods[d]): (z[f"w{n}"], z[f"b{n}"]) for n, (s, d) in enumerate(meta["maps"])}
            use = {(mods[s], d, name): np.array(u, dtype=np.float64) for s, d, name, u in meta["use"]}
            choice = {(mods[s], d): (name, b) for s, d, name, b in meta["choice"]}
            return cls(maps, use, choice, meta["text"])
        except Exception as e:  # noqa: BLE001 - numpy, zipfile and json raise many kinds on a file that is not one
            raise CalibrationError(f"{path} is not a calibration file "
                                   f"({type(e).__name__}: {first_line(e)})") from None

    def check(self, layouts, hidden=None, path=CALIBRATION_NAME):
        """CalibrationError unless every map joins two of ``layouts``' expert
        modules with the shapes their routers have (``hidden``: the model's
        hidden size, where known), and every choice names a predictor."""
        experts = {l.module: l.num_experts for l in layouts}
        for (src, dst), (w, b) in self.maps.items():
            if src not in experts or dst not in experts:
                raise CalibrationError(f"{path}: a map joins {src} and {dst}, not both expert modules of this folder")
            n = experts[dst]
            if w.ndim != 2 or w.shape[1] != n or b.shape != (n,) or (hidden and w.shape[0] != hidden):
                raise CalibrationError(f"{path}: the map {src} -> {dst} has shape {w.shape} + {b.shape}, "
                                       f"not ({hidden or 'hidden'}, {n}) + ({n},)")
        for (src, d), (name, breadth) in self.choice.items():
            if name not in NAMES or not isinstance(breadth, int) or breadth < 1 or src not in experts:
                raise CalibrationError(f"{path}: a choice of {src!r} at depth {d} is not one ({name!r}, {breadth!r})")


def ranked(scores, breadth: int) -> mx.array:
    """The ``breadth`` best-scored experts per row, best first."""
    return mx.argsort(-scores, axis=-1)[..., :breadth]


def linear_scores(x, w, b):
    """Router logits of a later layer, guessed from this layer's input ``x``."""
    return x.astype(mx.float32) @ w + b


def breadth_of(use: np.ndarray, k: int) -> int:
    """Top k, widened while the next guess is used at least MIN_USE of the
    time and the precision stays at least MIN_PRECISION."""
    b = k
    while b < len(use) and use[b] >= MIN_USE and use[: b + 1].sum() / (b + 1) >= MIN_PRECISION:
        b += 1
    return b


def choose(use: Dict[str, np.ndarray], k: int) -> Tuple[str, int]:
    """(predictor, breadth): the best recall at top k; ties to the earlier in NAMES."""
    best = max(use, key=lambda n: (round(float(use[n][:k].sum()), 6), -NAMES.index(n)))
    return best, breadth_of(use[best], k) if best != "temporal" else k


def previous(ids: List[np.ndarray]) -> np.ndarray:
    """Per token of the last chunk, the experts the previous token used (the
    first token of the text, with none before it, gets the first k experts)."""
    cur = ids[-1]
    first = ids[-2][-1:] if len(ids) > 1 else np.arange(cur.shape[1])[None]
    return np.concatenate([first, cur[:-1]])


def plan(candidates, reads_in, record_bytes, pending=0):
    """The guesses worth a read, from ``candidates`` [(use, depth, layer,
    expert)]: those used at least MIN_USE of the time, most likely first, as
    many as the source reads in time: at most ``reads_in(D, record_bytes)``
    records (``pending`` hints still outstanding included) due within D
    layer calls, for every D. Deeper guesses (less precise) are read only
    when the next layer's guesses do not fit in one layer's compute. Then,
    where the disk would otherwise sit idle, the guesses used less often
    (down to SPARE_USE) of the depths chosen, while every depth's reads stay
    within SPARE of what the disk reads in time (a measured rate and
    compute time: never while either is unknown)."""
    wanted = [c for c in candidates if c[0] >= MIN_USE]
    if not wanted:
        return []
    depths = sorted({c[1] for c in candidates})
    cap = {d: reads_in(d, record_bytes) for d in depths}
    sure = sorted({c[1] for c in wanted})
    need = sum(1 for c in wanted if c[1] == sure[0])
    deepest = next((d for d in sure if cap[d] >= need + pending), sure[-1])
    chosen, due = [], {d: pending for d in depths}  # records due within d calls
    later = {d: [D for D in depths if D >= d] for d in depths}

    def take(pool, limit):
        for c in sorted(pool, key=lambda c: (-c[0], c[1])):
            d = c[1]
            if d > deepest:
                continue
            if all(due[D] + 1 <= limit * cap[D] for D in later[d]):
                for D in later[d]:
                    due[D] += 1
                chosen.append(c)

    take(wanted, 1.0)
    if all(cap[d] < float("inf") for d in depths):
        take([c for c in candidates if SPARE_USE <= c[0] < MIN_USE], SPARE)
    return chosen
