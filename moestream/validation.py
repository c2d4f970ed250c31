"""Type checks shared by the argument validators (bools are not numbers here)."""

import math
import numbers


def is_int(x: object) -> bool:
    """An integer that is not a bool (numpy integers count)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_number(x: object) -> bool:
    """A finite real number that is not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)
