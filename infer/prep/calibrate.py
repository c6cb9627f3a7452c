"""Calibrations written beside a prep folder's manifest by `infer prep --calibrate TEXT`.

- ``predict.npz`` (``calibrate_folder``): ``fit`` runs the model over the
  text; the first three quarters fit linear maps from each MoE layer's input
  to the next layers' router logits, the last quarter measures every
  predictor, and per (layer, depth) the combined predictor takes the best
  one and a breadth (``infer.runtime.predict``).
- ``usage.json`` (``count_usage``): how many of the text's tokens each
  expert of each layer served, so a session loads the most used first
  (``infer.runtime.coldstart``).
"""

import hashlib
from pathlib import Path
from typing import List

import mlx.core as mx
import numpy as np

from infer.runtime.coldstart import CALIBRATION_TOKENS, count_trace, write_usage
from infer.runtime.predict import (CHUNK, DEFAULT_TOKENS, DEPTHS, NAMES, RIDGE, Calibration, choose,
                                   linear_scores, previous, ranked)
from infer.runtime.source import make_source
from infer.runtime.taps import install


def _rank_use(guess: np.ndarray, actual: np.ndarray) -> np.ndarray:
    """Per rank: how many rows used the guess at that rank."""
    return (guess[:, :, None] == actual[:, None, :]).any(-1).sum(0)


def fit(model, layers, tokens: List[int], depths=DEPTHS) -> Calibration:
    """Fit and measure the predictors over ``tokens`` (``layers``: from
    ``infer.runtime.taps.install`` on ``model``)."""
    from mlx_lm.models.cache import make_prompt_cache

    n = len(tokens)
    chunk = max(1, min(CHUNK, n // 4))
    starts = list(range(0, n, chunk))
    n_fit = max(1, (3 * len(starts)) // 4)
    pairs = [(s, s.index + d, d) for s in layers for d in depths if s.index + d < len(layers)]
    gram, cross = {}, {}
    maps, counts, rows = {}, {}, {}
    cache = make_prompt_cache(model)
    for layer in layers:
        layer.ids = []
    for c, i in enumerate(starts):
        for layer in layers:
            layer.x = layer.residual = None
        mx.eval(model(mx.array([tokens[i : i + chunk]]), cache=cache))
        for layer in layers:
            layer.ids[-1] = np.array(layer.ids[-1])
        if c < n_fit:
            _accumulate(layers, pairs, gram, cross)
            if c == n_fit - 1:
                maps = _solve(layers, pairs, gram, cross)
                gram.clear(), cross.clear()
        if c >= n_fit or len(starts) == 1:
            _measure(layers, pairs, maps, counts, rows)
    for layer in layers:
        layer.x = layer.residual = None
    cal = Calibration(text={"tokens": n, "fit_tokens": min(n, n_fit * chunk)})
    for (src, dst, d), (w, b) in maps.items():
        cal.maps[(layers[src].module, layers[dst].module)] = (w, b)
    for (src, d, name), used in counts.items():
        cal.use[(layers[src].module, d, name)] = used / max(rows[(src, d)], 1)
    for src, dst, d in pairs:
        use = {name: cal.use[(src.module, d, name)] for name in NAMES if (src.module, d, name) in cal.use}
        if use:
            cal.choice[(src.module, d)] = choose(use, _k(layers[dst]))
    return cal


def _k(layer) -> int:
    return layer.top_k or int(layer.ids[-1].shape[-1])


def _features(x):
    x = x.astype(mx.float32)
    return mx.concatenate([x, mx.ones((x.shape[0], 1))], axis=1)


def _logits(layer, x):
    out = layer.router(x)
    return None if isinstance(out, tuple) else out.astype(mx.float32)


def _accumulate(layers, pairs, gram, cross):
    for src in {s.index for s, _, _ in pairs}:
        f = _features(layers[src].x)
        gram[src] = gram.get(src, 0) + f.T @ f
    for s, dst, d in pairs:
        y = _logits(layers[dst], layers[dst].x)
        if y is not None:
            cross[(s.index, dst, d)] = cross.get((s.index, dst, d), 0) + _features(s.x).T @ y
    mx.eval(list(gram.values()), list(cross.values()))


def _solve(layers, pairs, gram, cross):
    maps = {}
    for (src, dst, d), xy in cross.items():
        a = np.array(gram[src], dtype=np.float64)
        a += RIDGE * np.trace(a) / len(a) * np.eye(len(a))
        wb = np.linalg.solve(a, np.array(xy, dtype=np.float64)).astype(np.float32)
        maps[(src, dst, d)] = (wb[:-1], wb[-1])
    return maps


def _measure(layers, pairs, maps, counts, rows):
    for s, dst, d in pairs:
        t = layers[dst]
        k = _k(t)
        actual = t.ids[-1]
        width = 2 * k
        guesses = {}
        scores = t.router(s.x)
        if not isinstance(scores, tuple):
            guesses["router"] = ranked(scores, width)
        if (s.index, dst, d) in maps:
            w, b = maps[(s.index, dst, d)]
            guesses["linear"] = ranked(linear_scores(s.x, mx.array(w), mx.array(b)), width)
        guesses["temporal"] = previous(t.ids)
        for name, g in guesses.items():
            used = _rank_use(np.array(g), actual)
            key = (s.index, d, name)
            counts[key] = counts.get(key, 0) + np.pad(used, (0, width - len(used)))
        rows[(s.index, d)] = rows.get((s.index, d), 0) + len(actual)


def calibrate_folder(folder, text_path, n_tokens=DEFAULT_TOKENS) -> Calibration:
    """Fit on a prep folder (its experts read in this process) and store the
    calibration beside its manifest."""
    from infer.runtime.loader import load_streaming

    folder = Path(folder)
    data = Path(text_path).read_bytes()
    source = make_source(folder, "inproc")
    try:
        model, tokenizer, store = load_streaming(folder, source)
        store.prefetcher.depth = 0
        experts = {l.module: l.num_experts for l in store.manifest.layers if not l.module.startswith("mtp.")}
        tokens = tokenizer.encode(data.decode("utf-8"))[:n_tokens]
        if len(tokens) < 8:
            raise ValueError(f"{text_path} gives {len(tokens)} tokens; a calibration needs at least 8")
        cal = fit(model, install(model, experts), tokens)
    finally:
        source.close()
    cal.text.update({"path": str(text_path), "sha256": hashlib.sha256(data).hexdigest()})
    cal.save(folder)
    return cal


def count_usage(folder, text, max_tokens=CALIBRATION_TOKENS):
    """Route ``text`` (its first ``max_tokens`` tokens, one token a step as
    in decode) through the prep ``folder``'s model (the default cache: the
    trace is the routing whatever the cache holds), count the experts each
    layer uses, and write ``usage.json``."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from infer.runtime.loader import load_streaming

    source = make_source(folder, "inproc")
    try:
        model, tok, store = load_streaming(folder, source, dtype=mx.float32, preload=False)
        store.prefetcher.depth = 0
        store.trace = []
        ids = tok.encode(text, add_special_tokens=False)[:max_tokens]
        cache = make_prompt_cache(model)
        for t in ids:
            mx.eval(model(mx.array([[t]]), cache=cache))
    finally:
        source.close()
    counts = count_trace(store.routing_trace())
    write_usage(folder, counts, len(ids))
    return counts
