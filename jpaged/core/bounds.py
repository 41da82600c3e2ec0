"""What a number a request or the config gives must be to reach the device: the
int32 / float32 bounds and the checks that JSON values are real integers and
finite numbers (used by the config and by SamplingParams)."""

from __future__ import annotations

import math
import numbers
from typing import Any

# Token counts, positions, block ids and top_k are int32 on the device.
INT32_MAX = 2**31 - 1
# temperature and top_p are float32 on the device.
FLOAT32_MAX = 3.4028234663852886e38


def is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)  # JSON true is not 1 here


def is_finite(value: Any) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False
