"""One number rule the argument checks share (config.py, sampling_params.py, layers/rope_scaling.py)."""
import math


def is_finite(value) -> bool:
    """math.isfinite(value) for any real number, False where it is too large for a float.

    math.isfinite(10**400) raises OverflowError (the int is converted to a float first); a check that names
    the argument must say "must be a finite number" for it instead, as it does for 1e400 (inf) and NaN.
    """
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def shown(value, limit: int = 40) -> str:
    """value's repr for an error message, cut short past `limit` characters (10**400 has 401 digits)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:20]}... ({len(text)} characters)"
