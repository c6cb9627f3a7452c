"""Recorded routing traces, read into one shape for the cache replay
(``infer routing --trace``, ``infer.tools.replay``).

Formats, told apart by their content:

- ``route_trace v1`` (CSV, BigMoeOnEdge's ``bmoe-cli --route-trace``): a
  ``# route_trace v1`` line, ``#`` lines with ``n_expert=``,
  ``n_expert_used=`` and each layer's ``expert_bytes=``, then rows
  ``turn,phase,step,layer,slot,expert,...``; ``phase`` 0 is prefill, 1 decode;
  ``step`` a token's position.
- Mixtral JSONL (speculative-moe): one object per (token, layer) with
  ``layer`` and ``experts``, and either ``token_idx`` (decode only, tokens
  numbered per layer) or ``token_pos`` (execution order: a forward ends where
  the layer decreases; one with several positions is a prefill). Records of
  one ``(dataset, problem_id)`` are one session.
- the project's own: JSON of ``ExpertStore.routing_trace()``, ``[[layer,
  [experts]], ...]`` in call order (a third item per call, the guesses
  ``scripts/bench_policies.py`` records, is ignored), or an object of such
  lists (``bench_policies.py --trace``), each a session. A forward ends where
  the layer does not increase; the first forward is the prompt, and so is a
  later one with a call wider than the trace's usual call (its top k).

A ``Trace`` is sessions, each from a cold cache; a session is calls, one
forward of the model each: per layer the experts the call needs (what the
cache sees) and, where the format has them, each token's experts in router
order. A prompt's tokens go as mlx-lm feeds them: in calls of
``PREFILL_STEP`` tokens, the rest in one.
"""

import csv
import hashlib
import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, FrozenSet, List, Optional, Tuple

from infer.runtime.budget import PREFILL_STEP

CSV_MAGIC = "# route_trace"


class TraceError(ValueError):
    """A trace that cannot be replayed (the message is one line)."""


@dataclass
class Call:
    """One forward of the model."""

    decode: bool
    wanted: Dict[int, FrozenSet[int]]  # layer -> the experts the call needs
    # each token's {layer: experts in router order} (none where not recorded)
    tokens: List[Dict[int, Tuple[int, ...]]] = field(default_factory=list)


@dataclass
class Trace:
    path: str
    format: str
    sessions: List[List[Call]]
    layers: List[int]
    num_experts: int
    top_k: int
    sha256: str = ""
    model: Optional[str] = None  # as the file names it
    record_bytes: Optional[float] = None  # the file's own expert size (its engine's format)
    prefill_tokens: Optional[int] = None  # None: not recorded per token
    layouts: Dict[int, object] = field(default_factory=dict)  # layer -> a model's LayerLayout, where given

    @property
    def decode_tokens(self) -> int:
        return sum(c.decode for s in self.sessions for c in s)

    @property
    def prefill_calls(self) -> int:
        return sum(not c.decode for s in self.sessions for c in s)


def _call(decode, tokens, wanted=None) -> Call:
    if wanted is None:
        wanted = defaultdict(set)
        for tok in tokens:
            for layer, experts in tok.items():
                wanted[layer].update(experts)
        wanted = {l: frozenset(e) for l, e in sorted(wanted.items())}
    return Call(decode, wanted, tokens)


def _prefill_calls(tokens: List[Dict[int, Tuple[int, ...]]]) -> List[Call]:
    """A prompt's tokens ({layer: experts} each) as mlx-lm's prefill calls."""
    calls, i = [], 0
    while len(tokens) - i > 0:
        n = PREFILL_STEP if len(tokens) - i > PREFILL_STEP else len(tokens) - i
        calls.append(_call(False, tokens[i:i + n]))
        i += n
    return calls


def _int(text, what, where):
    try:
        return int(text)
    except (TypeError, ValueError):
        raise TraceError(f"{where}: {what} {text!r} is not an integer") from None


def read_route_csv(path: Path, text: str) -> Trace:
    lines = text.splitlines()
    if lines[0].strip() != "# route_trace v1":
        raise TraceError(f"{path}: {lines[0].strip()[:60]!r}: only route_trace v1 is known")
    meta, record = {}, {}
    body = []
    for n, line in enumerate(lines[1:], 2):
        if line.startswith("#"):
            kv = dict(p.split("=", 1) for p in line[1:].split() if "=" in p)
            if "layer" in kv and "expert_bytes" in kv:
                record[_int(kv["layer"], "layer", f"{path}:{n}")] = _int(kv["expert_bytes"], "expert_bytes",
                                                                         f"{path}:{n}")
            else:
                meta.update(kv)
        elif line.strip():
            body.append((n, line))
    if not body:
        raise TraceError(f"{path}: no column header and no rows")
    head = [h.strip() for h in body[0][1].split(",")]
    need = ("turn", "phase", "step", "layer", "slot", "expert")
    if any(h not in head for h in need):
        raise TraceError(f"{path}:{body[0][0]}: the columns must include {','.join(need)}")
    col = {h: head.index(h) for h in need}
    cells = defaultdict(dict)  # (turn, step) -> {layer: {slot: expert}}
    phase = {}
    for n, row in zip((b[0] for b in body[1:]), csv.reader(b[1] for b in body[1:])):
        where = f"{path}:{n}"
        if len(row) < len(head):
            raise TraceError(f"{where}: {len(row)} fields, the header has {len(head)}")
        v = {h: _int(row[i], h, where) for h, i in col.items()}
        if v["phase"] not in (0, 1) or v["layer"] < 0 or v["expert"] < 0 or v["slot"] < 0:
            raise TraceError(f"{where}: phase must be 0 or 1, layer, slot and expert non-negative")
        key = (v["turn"], v["step"])
        if phase.setdefault(key, v["phase"]) != v["phase"]:
            raise TraceError(f"{where}: step {v['step']} of turn {v['turn']} is both prefill and decode")
        cells[key].setdefault(v["layer"], {})[v["slot"]] = v["expert"]
    if not cells:
        raise TraceError(f"{path}: no rows")
    num_experts = _int(meta["n_expert"], "n_expert", path) if "n_expert" in meta else None
    top_k = _int(meta["n_expert_used"], "n_expert_used", path) if "n_expert_used" in meta else None
    calls, prompt = [], []
    for key in sorted(cells):
        token = {l: tuple(s[i] for i in sorted(s)) for l, s in sorted(cells[key].items())}
        if phase[key] == 0:
            prompt.append(token)
            continue
        calls += _prefill_calls(prompt)
        prompt = []
        calls.append(_call(True, [token]))
    calls += _prefill_calls(prompt)
    sizes = [record[l] for l in record]
    return _finish(Trace(str(path), "route_trace v1", [calls], [], num_experts or 0, top_k or 0,
                         model=Path(meta["model"]).name if "model" in meta else None,
                         record_bytes=sum(sizes) / len(sizes) if sizes else None,
                         prefill_tokens=sum(phase[k] == 0 for k in cells)))


def read_jsonl(path: Path, records: List[dict]) -> Trace:
    by_session = defaultdict(list)
    for n, r in records:
        where = f"{path}:{n}"
        experts = r.get("experts")
        if not isinstance(experts, list) or not experts:
            raise TraceError(f"{where}: 'experts' is not a list of expert ids")
        layer = _int(r.get("layer"), "layer", where)
        experts = tuple(_int(e, "expert", where) for e in experts)
        if layer < 0 or min(experts) < 0:
            raise TraceError(f"{where}: a negative layer or expert")
        if "token_idx" in r:
            pos, kind = _int(r["token_idx"], "token_idx", where), "idx"
        elif "token_pos" in r:
            pos, kind = _int(r["token_pos"], "token_pos", where), "pos"
        else:
            raise TraceError(f"{where}: neither token_idx nor token_pos")
        by_session[(str(r.get("dataset", "")), str(r.get("problem_id", "")))].append((kind, layer, pos, experts))
    sessions, prefill_tokens = [], 0
    for items in by_session.values():
        if len({k for k, *_ in items}) > 1:
            raise TraceError(f"{path}: a session mixes token_idx and token_pos records")
        if items[0][0] == "idx":
            # decode only; each layer's tokens numbered on their own
            steps = defaultdict(dict)
            for _, layer, pos, experts in items:
                steps[pos][layer] = experts
            sessions.append([_call(True, [dict(sorted(steps[p].items()))]) for p in sorted(steps)])
            continue
        forwards, cur, last = [], None, None
        for _, layer, pos, experts in items:
            # execution order: a forward ends where the layer decreases, or
            # repeats a position (a step that lost its first layers' records)
            if cur is None or layer < last or pos in cur[layer]:
                cur = defaultdict(dict)
                forwards.append(cur)
            cur[layer][pos] = experts
            last = layer
        calls = []
        for fwd in forwards:
            positions = sorted({p for rows in fwd.values() for p in rows})
            if len(positions) > 1:
                prefill_tokens += len(positions)
                calls += _prefill_calls([{l: fwd[l][p] for l in sorted(fwd) if p in fwd[l]} for p in positions])
            else:
                calls.append(_call(True, [{l: rows[positions[0]] for l, rows in sorted(fwd.items())}]))
        sessions.append(calls)
    return _finish(Trace(str(path), "mixtral jsonl", sessions, [], 0, 0, prefill_tokens=prefill_tokens))


def read_project(path: Path, data) -> Trace:
    named = data if isinstance(data, dict) else {"": data}
    sessions = []
    for name, calls in named.items():
        where = f"{path}{'[' + repr(name) + ']' if name else ''}"
        if not isinstance(calls, list):
            raise TraceError(f"{where}: not a list of [layer, [experts]] calls")
        forwards, last = [], None
        for i, c in enumerate(calls):
            if not isinstance(c, (list, tuple)) or len(c) < 2 or not isinstance(c[1], (list, tuple)):
                raise TraceError(f"{where}, call {i}: not [layer, [experts]]")
            layer = _int(c[0], "layer", f"{where}, call {i}")
            experts = frozenset(_int(e, "expert", f"{where}, call {i}") for e in c[1])
            if layer < 0 or (experts and min(experts) < 0):
                raise TraceError(f"{where}, call {i}: a negative layer or expert")
            if last is None or layer <= last:
                forwards.append({})
            forwards[-1][layer] = experts
            last = layer
        sessions.append(forwards)
    widths = Counter(len(e) for s in sessions for f in s for e in f.values() if e)
    k = widths.most_common(1)[0][0] if widths else 0
    out = []
    for forwards in sessions:
        calls = []
        for i, f in enumerate(forwards):
            decode = i > 0 and all(len(e) <= k for e in f.values())
            # a decode call's one token (its experts as the store lists them, by id)
            calls.append(_call(decode, [{l: tuple(sorted(e)) for l, e in f.items()}] if decode else [], f))
        out.append(calls)
    return _finish(Trace(str(path), "routing_trace json", out, [], 0, k))


def _finish(t: Trace) -> Trace:
    """Layers, experts and top k where the file did not say; refuses an empty trace."""
    if not any(t.sessions):
        raise TraceError(f"{t.path}: the trace has no calls")
    if not any(w for s in t.sessions for c in s if c.decode for w in c.wanted.values()):
        raise TraceError(f"{t.path}: the trace has no decode steps")
    seen = {e for s in t.sessions for c in s for w in c.wanted.values() for e in w}
    if not seen:
        raise TraceError(f"{t.path}: the trace routes to no expert")
    t.layers = sorted({l for s in t.sessions for c in s for l in c.wanted})
    top = max(e for e in seen)
    if t.num_experts and top >= t.num_experts:
        raise TraceError(f"{t.path}: expert {top} out of range (the file says {t.num_experts} experts)")
    t.num_experts = t.num_experts or top + 1
    t.top_k = t.top_k or max(len(r) for s in t.sessions for c in s if c.decode
                             for tok in c.tokens for r in tok.values())
    return t


def read(path) -> Trace:
    """The trace in ``path``, whichever of the formats it is in (TraceError otherwise)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise TraceError(f"{path}: {e.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise TraceError(f"{path}: unknown trace format (not UTF-8 text)") from None
    if not text.strip():
        raise TraceError(f"{path}: the trace is empty")
    if text.startswith(CSV_MAGIC):
        t = read_route_csv(path, text)
    else:
        t = _read_json(path, text)
    t.sha256 = hashlib.sha256(raw).hexdigest()
    return t


def _read_json(path: Path, text: str) -> Trace:
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    else:
        if isinstance(data, dict) and "experts" in data and "layer" in data:
            return read_jsonl(path, [(1, data)])
        if isinstance(data, (list, dict)):
            return read_project(path, data)
    records = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except ValueError:
            r = None
        if not isinstance(r, dict) or "experts" not in r or "layer" not in r:
            raise TraceError(f"{path}: unknown trace format (line {n} is neither route_trace v1 CSV, "
                             "a JSON routing record nor part of a routing_trace JSON)")
        records.append((n, r))
    return read_jsonl(path, records)
