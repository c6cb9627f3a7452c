"""Cold start: load first the experts a calibration text uses most.

``usage.json`` beside a prep folder's manifest holds, per MoE layer, how
many calibration tokens were routed to each expert. When it exists,
``infer.runtime.loader.load_streaming`` fills each layer's stack with that layer's
most used experts before the first token (``ExpertStore.preload``), as far
as the cache has room, so the first tokens do not pay a miss for every
expert they need.

    from infer.prep.calibrate import count_usage
    count_usage(prep_folder, text)  # e.g. from `infer prep --calibrate TEXT`
"""

import json
from collections import Counter
from pathlib import Path

from infer.args import first_line

USAGE_NAME = "usage.json"
CALIBRATION_TOKENS = 512  # enough for the popular experts of a layer to stand out


def count_trace(trace):
    """{layer: Counter(expert -> calls)} of an ``ExpertStore.trace``; a
    decode trace has one call per token, so these are token counts."""
    counts = {}
    for call in trace:
        counts.setdefault(int(call[0]), Counter()).update(int(e) for e in call[1])
    return counts


def usage_order(counts):
    """{layer: [experts, most used first]} (ties by expert id)."""
    return {layer: sorted(c, key=lambda e: (-c[e], e)) for layer, c in counts.items()}


def write_usage(folder, counts, tokens):
    """Write ``usage.json`` into the prep ``folder``."""
    data = {"tokens": tokens,
            "layers": {str(l): {str(e): n for e, n in sorted(c.items())} for l, c in sorted(counts.items())}}
    path = Path(folder) / USAGE_NAME
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


class UsageError(ValueError):
    """A ``usage.json`` that cannot be used as one (the message is one line)."""


def read_usage(folder):
    """{layer: Counter} from the folder's ``usage.json``, or None without one."""
    path = Path(folder) / USAGE_NAME
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        return {int(l): Counter({int(e): int(n) for e, n in c.items()}) for l, c in data["layers"].items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise UsageError(f"{path} is not a usage file ({type(e).__name__}: {first_line(e)})") from None


def check_usage(counts, layouts, path=USAGE_NAME):
    """UsageError unless ``counts`` name only ``layouts``' layers and experts, counted from 0 up."""
    experts = {l.layer: l.num_experts for l in layouts}
    for layer, c in counts.items():
        if layer not in experts:
            raise UsageError(f"{path}: layer {layer} is not an expert layer of this folder")
        bad = [e for e, n in c.items() if not 0 <= e < experts[layer] or n < 0]
        if bad:
            raise UsageError(f"{path}: layer {layer} counts expert {bad[0]} ({c[bad[0]]} uses); "
                             f"the layer has experts 0..{experts[layer] - 1}")


def preload(store, folder):
    """Fill ``store``'s stacks before the first token: with the folder's
    ``usage.json``, each layer's most used experts; without one, the stacks
    that hold their whole layer only (every expert: such a layer runs
    without a sync from its first call, where filled on demand it syncs
    until each of its experts has been used once). Returns the experts
    loaded."""
    if store.cache_bytes <= 0:
        return 0
    counts = read_usage(folder)
    return store.preload(usage_order(counts) if counts else {})
