"""Layer-major prefill: a long prompt's chunks pass each streamed layer one
after another, so the layer's experts are read once per prompt, not once
per chunk.

mlx-lm prefills a prompt in chunks (``prefill_step_size``, 2,048 tokens),
each through the whole model before the next; a chunk that long routes to
nearly every expert of every layer, so a streamed session read each
layer's experts once per chunk. Here the chunks are the same (the same
boundaries, so the same arithmetic and mlx-lm's ids) but run as greenlets
on this thread (MLX's lazy arrays belong to one thread's streams), each up
to its next streamed call, in order: chunk c reaches a layer only after
chunk c - 1 has, so every cache it reads holds what it would hold in
mlx-lm's order. The experts a chunk's call read into a compact stack are
kept for the chunks behind it (``ExpertStore.kept``) until the last of
them has passed the layer: about one layer's experts at a time.

A chunk whose model reads a layer's cache before the chunk ahead has
written it (a mask made from a later layer's cache at the model's start)
meets a guard and starts again once that chunk has gone further; the
guard's error is raised only where a chunk had already changed a cache."""

from functools import partial

import mlx.core as mx
from greenlet import greenlet

from infer.runtime.distributed import group


class _NotYet(Exception):
    """A chunk read a cache the chunk ahead of it has not reached."""


class _Guard:
    """A cache entry the chunk ahead has not written yet: any use raises."""

    def __getattr__(self, name):
        raise _NotYet(name)

    def __bool__(self):
        raise _NotYet("bool")

    def __len__(self):
        raise _NotYet("len")


def chunks(n_tokens, step):
    """mlx-lm's prefill chunks of a prompt of ``n_tokens`` (generate_step):
    [(start, end)] of every token but the last, which the first decode step takes."""
    return spans(n_tokens - 1, step)


def spans(n_tokens, step):
    """[(start, end)] of ``n_tokens`` in calls of ``step``, as mlx-lm's batch
    generator cuts what it prefills (every token: its caller keeps the last)."""
    return [(a, min(a + step, n_tokens)) for a in range(0, n_tokens, step)]


def prefill(model, store, prompt, cache, step=2048):
    """Prefill ``prompt`` (token ids) into ``cache`` as mlx-lm's
    ``generate_step`` does, chunk by chunk; layer-major where the session
    streams and there are two chunks or more. Returns the tokens left for
    the first decode step (the prompt's last one). Over ranks (a pipeline
    whose sends and receives go chunk by chunk) chunk after chunk."""
    parts = chunks(len(prompt), step)
    tokens = mx.array(prompt)
    if len(parts) > 1 and store is not None and len(cache) == len(model.layers) and group() is None:
        Lockstep(model, store, [tokens[a:b] for a, b in parts], cache).run()
    else:
        for a, b in parts:
            model(tokens[a:b][None], cache=cache)
            mx.eval([c.state for c in cache])
            mx.clear_cache()
    return prompt[parts[-1][1]:] if parts else prompt


class _LayerMajorCalls:
    """A model whose calls of one row longer than ``_step`` tokens, on a
    cache of every layer, run as ``_step``-token chunks, layer-major; its
    output is theirs, joined (a prefill's, which nobody reads, stays lazy)."""

    def __call__(self, inputs, cache=None, **kwargs):
        store = self._store
        if (kwargs or cache is None or inputs.ndim != 2 or inputs.shape[0] != 1
                or inputs.shape[1] <= self._step or store.lockstep is not None
                or len(cache) != len(self.layers) or group() is not None):
            return super().__call__(inputs, cache=cache, **kwargs)
        parts = [inputs[0, a:b] for a, b in spans(inputs.shape[1], self._step)]
        run = Lockstep(self, store, parts, cache, outputs=True)
        run.run()
        return mx.concatenate(run.outputs, axis=1)


def layer_major_calls(model, store, step):
    """Make ``model`` (its instance: a subclass of its class) prefill a call
    of more than ``step`` tokens layer-major, in mlx-lm's chunks of ``step``:
    for a caller that hands the model a whole prompt at once (``infer
    serve``, whose mlx-lm batch generator then takes a prompt in one call)."""
    cls = type(model)
    model.__class__ = type(cls.__name__, (_LayerMajorCalls, cls), {})
    model._store, model._step = store, step
    return model


class Lockstep:
    """The chunks of one prefill, run in layer order (``prefill``)."""

    def __init__(self, model, store, parts, cache, outputs=False):
        self.model, self.store, self.parts, self.cache = model, store, parts, cache
        n = len(parts)
        # each chunk's cache list: the real entries where the chunk ahead has
        # passed the layer, guards beyond (a model takes its entries lazily)
        self.lists = [list(cache)] + [[_Guard()] * len(cache) for _ in range(n - 1)]
        self.at = [-1] * n  # the layer of each chunk's latest streamed call
        self.done = [False] * n
        self.glets = [None] * n  # each chunk's greenlet, once started
        self.outputs = [None] * n if outputs else None  # each chunk's output (lazy), if kept
        self.current = None
        self.left = {}  # layer -> chunks still to pass it, while its experts are kept

    def run(self):
        store = self.store
        store.lockstep, store.kept = self, {}
        try:
            while not all(self.done):
                moved = False
                for c in range(len(self.parts)):
                    # the first chunk one call a round; each other until it has
                    # caught up with the chunk ahead (at its layer, or done)
                    steps = 0
                    while not self.done[c] and (steps == 0 if c == 0 else
                                                self.done[c - 1] or self.at[c - 1] > self.at[c]):
                        if not self._step(c):
                            break
                        steps += 1
                    moved = moved or steps > 0
                if not moved:
                    raise RuntimeError("layer-major prefill: no chunk could go on")
            mx.eval([c.state for c in self.cache])
        finally:
            store.lockstep, store.kept = None, {}
            self.current = None
        mx.clear_cache()

    def _step(self, c):
        """Run chunk ``c`` to its next streamed call (or its end); False
        where it read a cache the chunk ahead has not written (started again
        later)."""
        self.current = c
        if self.glets[c] is None:
            self.glets[c] = greenlet(partial(self._chunk, c))
        try:
            self.glets[c].switch()
        except _NotYet:
            if self.at[c] >= 0:
                raise RuntimeError("layer-major prefill: the model read a layer's cache before "
                                   "the chunk ahead of it had written it") from None
            self.glets[c] = None  # (nothing changed yet)
            return False
        if self.glets[c].dead:
            self.done[c] = True
            if c + 1 < len(self.parts):
                self.lists[c + 1][:] = self.cache
        return True

    def _chunk(self, c):
        y = self.model(self.parts[c][None], cache=self.lists[c])
        if self.outputs is not None:
            self.outputs[c] = y

    def arrive(self, layer):
        """A chunk's streamed call of ``layer`` is about to route: the chunk
        behind may now read every cache up to this layer's; the next chunk
        in order runs until its own next call."""
        c = self.current
        self.at[c] = layer
        if c + 1 < len(self.parts):
            ahead = self.lists[c + 1]
            ahead[:layer + 1] = self.cache[:layer + 1]
        self.left.setdefault(layer, len(self.parts) - c)
        greenlet.getcurrent().parent.switch()

    def passed(self, layer):
        """A chunk's call of ``layer`` has its experts: the last chunk to
        pass the layer lets its kept experts go."""
        self.left[layer] -= 1
        if self.left[layer] <= 0:
            del self.left[layer]
            self.store.kept.pop(layer, None)
