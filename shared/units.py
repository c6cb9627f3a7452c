"""Human byte sizes: "512M", "4G", "1.5GiB", "123456"."""

import math

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes in ``text``; binary units (K = 1024); raises ValueError."""
    s = str(text).strip().upper().replace("IB", "").rstrip("B")
    unit = s[-1] if s and s[-1] in _UNITS else ""
    number = s[: len(s) - len(unit)]
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (examples: 512M, 4G)") from None
    # "inf", "nan" and "1e400" parse as floats but are no number of bytes
    if not math.isfinite(value * _UNITS[unit]):
        raise ValueError(f"not a size: {text!r} (examples: 512M, 4G)")
    if value < 0:
        raise ValueError(f"negative size: {text!r}")
    if not unit and value != int(value):  # "2.5" meant 2.5G, not 2 bytes
        raise ValueError(f"not a whole number of bytes: {text!r} (give a unit: 2.5G, 512M)")
    return int(value * _UNITS[unit])


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"
