"""argparse value types of the `iod` commands: a value that parses but means
nothing (a count out of range, NaN, a negative rate) is one line and exit 2."""

import argparse
import math

from shared import units


def count(low: int, high: int = None, zero: str = ""):
    """An integer from ``low`` to ``high``; ``zero``, when given, says what 0
    means (allowed even below ``low``)."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if zero and v == 0:
            return v
        if v < low or (high is not None and v > high):
            span = f"from {low} to {high}" if high is not None else f"{low} or more"
            also = f" (or 0: {zero})" if zero else ""
            raise argparse.ArgumentTypeError(f"must be {span}{also}: {text!r}")
        return v

    return parse


def number(what: str, positive: bool = False, finite: bool = True):
    """A number >= 0 (> 0 when ``positive``; infinity only when not
    ``finite``); ``what`` names it in the error."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        ok = (v > 0 if positive else v >= 0) and (math.isfinite(v) or not finite)  # NaN fails both
        if not ok:
            raise argparse.ArgumentTypeError(f"must be {what}: {text!r}")
        return v

    return parse


def size(text: str) -> int:
    """ "2G", "512M", "64k", "1048576" -> bytes, more than 0."""
    try:  # shared.units refuses inf, nan and overflow too
        n = units.parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return n
