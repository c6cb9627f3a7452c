#!/usr/bin/env python3
"""Whether streamed decoding computes the resident model's logits bit for bit.

usage: scripts/bench/stream_bits.py PREP BUDGET TOKENS [PROMPT]

The resident model decodes TOKENS greedy tokens from PROMPT (default @code)
one token a step; the streamed model (an in-process source, the budget's
cache) is fed the same ids, one a step, under each setting of hits-first
(on, off) and prediction depth (0, 3), step by step and pipelined (the
next step queued before a step's logits are read). Each step's logits are compared bit
for bit with the resident step's: rows that differ, the first that does,
the largest difference, and whether the greedy id differs. The model runs
in the dtype it is stored in.
"""
import sys

import mlx.core as mx
import numpy as np

from infer.runtime.source import make_source
from infer.tools import bench_draft as bd
from infer.tools.bench import cache_bytes_of
from infer.tools.resident import load_resident
from infer.runtime.gate import PredictionGate
from infer.runtime.loader import load_streaming
from infer.run import encode_prompt
from mlx_lm.models.cache import make_prompt_cache
from shared.blob import Manifest


def steps(model, prompt, feed, pipelined=False):
    """Logits (float32, numpy) of the prompt's last token and of each id of
    ``feed`` (None: the greedy ids), one token a step; ``pipelined``: each
    step's graph built and queued before the previous step's logits are
    read, as mlx-lm's generate_step does."""
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt)[None], cache=cache)[:, -1, :].astype(mx.float32)
    out, ids = [], []
    n = len(feed) if feed is not None else TOKENS
    for i in range(n):
        if pipelined:  # the fed id computed from the logits, as a sampled token is
            y = mx.argmax(logits, axis=-1) * 0 + feed[i]
            nxt = model(y[None], cache=cache)[:, -1, :].astype(mx.float32)
            mx.async_eval(nxt)
            out.append(np.array(logits))
        else:
            out.append(np.array(logits))
            y = feed[i] if feed is not None else int(out[-1].argmax())
            ids.append(y)
            nxt = model(mx.array([[y]]), cache=cache)[:, -1, :].astype(mx.float32)
        logits = nxt
    out.append(np.array(logits))
    return ids, out


def main(argv):
    global TOKENS
    if len(argv) not in (3, 4):
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    prep, budget, TOKENS = argv[0], argv[1], int(argv[2])
    prompt = argv[3] if len(argv) == 4 else "@code"
    resident, tok = load_resident(prep)
    ids = encode_prompt(tok, bd.resolve_prompt(prompt), True)
    ref_ids, ref = steps(resident, ids, None)
    del resident
    print("device", mx.default_device(), "prompt", len(ids), "tokens", TOKENS)
    manifest = Manifest.load(prep)
    model, _, store = load_streaming(prep, None, cache_bytes_of(budget, manifest))
    store.prefetcher.gate = PredictionGate("on")  # depth 3 predicts on every call (kept by store.reset)
    for hits_first, depth, pipelined in ((True, 0, False), (True, 3, False), (False, 0, False),
                                         (False, 3, False), (True, 3, True), (False, 0, True)):
        store.use(make_source(prep, "inproc", arena=256 << 20, workers=1))
        store.reset()
        store.hits_first, store.prefetcher.depth = hits_first, depth
        _, got = steps(model, ids, ref_ids, pipelined)
        differ = [i for i, (a, b) in enumerate(zip(ref, got)) if not np.array_equal(a, b)]
        argmax = sum(int(a.argmax() != b.argmax()) for a, b in zip(ref, got))
        diff = max(float(np.abs(a - b).max()) for a, b in zip(ref, got))
        print(f"budget {budget} hits-first {'on ' if hits_first else 'off'} depth {depth} "
              f"{'pipelined' if pipelined else 'step by step'}: "
              f"{len(differ)} of {len(ref)} steps differ (first {differ[0] if differ else None}), "
              f"max |diff| {diff:.3g}, greedy ids differ at {argmax}; "
              f"hits {store.stats['hits']} misses {store.stats['misses']} "
              f"aside calls {store.stats['aside_calls']} hits-first calls {store.stats['hits_first']}")
        store.source.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
