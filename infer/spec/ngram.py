"""Prompt-lookup drafting: propose what followed the last earlier match.

Works for every architecture and costs no model compute: the history of
prompt and committed tokens is indexed by n-gram, and the continuation of
the most recent earlier occurrence of the longest matching suffix is the
draft. A continuation that reaches the end of the history goes on with
the draft itself (an overlapping copy, as LZ77 copies): a match a few
tokens back is a repetition of that period, so the draft repeats it for
all ``k`` tokens instead of stopping at the last committed token.
"""


class NgramDrafter:
    """Drafts up to ``k`` tokens by matching the last ``max_n``..``min_n`` tokens."""

    needs_hidden = False
    # propose() is cheap, has no side effects, and returns nothing where no
    # n-gram matches: the decoder asks it before each pass
    may_abstain = True

    def __init__(self, max_n=3, min_n=1):
        self.max_n = max_n
        self.min_n = min_n
        self.tokens = []
        # n -> {n-gram: latest start whose continuation token exists}
        self._index = {n: {} for n in range(min_n, max_n + 1)}
        self._upto = {n: 0 for n in range(min_n, max_n + 1)}

    def extend(self, tokens):
        self.tokens.extend(int(t) for t in tokens)

    def observe(self, hidden, tokens):
        """Newly committed tokens (the hidden states are not used)."""
        self.extend(tokens)

    def _update(self):
        toks = self.tokens
        for n, index in self._index.items():
            # an n-gram starting at s is usable once toks[s + n] exists
            for s in range(self._upto[n], len(toks) - n):
                index[tuple(toks[s : s + n])] = s
            self._upto[n] = max(self._upto[n], len(toks) - n)

    def propose(self, k):
        """Up to ``k`` draft tokens (possibly none)."""
        if k <= 0:
            return []
        self._update()
        toks = self.tokens
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(toks) <= n:
                continue
            s = self._index[n].get(tuple(toks[-n:]))
            if s is not None:
                out = toks[s + n : s + n + k]
                end = len(toks)
                while len(out) < k:  # past the end: the repetition goes on
                    out.append(out[s + n + len(out) - end])
                return out
        return []
