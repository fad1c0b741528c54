"""The pure core of askonce: state machines and codecs with no I/O, no clock reads and no sleeping.

Everything here takes time (``now``, monotonic seconds) and randomness as inputs, so the sync and
async shells, the integrations and the simulator all drive the very same objects.
"""

from typing import TypeGuard

_REAL = (int, float)  # a tuple: ``int | float`` would build a union object on every call


def is_int(value: object) -> TypeGuard[int]:
    """An option that must be a whole number: an ``int`` (an ``IntEnum`` too), never a ``bool``
    (``attempts=True`` is a bug, not one attempt)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: object) -> TypeGuard[int | float]:
    """An option that must be a number (seconds, a rate): an ``int`` or a ``float``, never a
    ``bool``. NaN passes here; the range check that follows refuses it."""
    return isinstance(value, _REAL) and not isinstance(value, bool)
