"""Checks and conversions of the Python arguments before they reach the C++ binding.

Every function raises :class:`attnkit.Error` naming the argument (in the caller's words) and what
is accepted: a wrong type, a value outside the C++ type (int32 counts, uint64 streams), a list
that does not hold integers. Values inside the type are checked by the C++ validation, whose
messages the binding renames into the Python arguments (python/src/python_names.h).
"""

from __future__ import annotations

import operator
from typing import Any, Optional

from ._attnkit import Error

INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)
UINT64 = (0, 2**64 - 1)

_ARRAY_KINDS = "a DLPack or buffer-protocol tensor: torch, numpy, cupy, jax, ..."


def describe(value: Any) -> str:
    """'a str ('x')', 'an int (3)': the type and a short repr of a rejected value."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    kind = type(value).__name__
    return f"{'an' if kind[0] in 'aeiouAEIOU' else 'a'} {kind} ({text})"


def _range(bounds: tuple) -> str:
    lo, hi = bounds
    return f"[{lo}, {hi}]"


def int_arg(value: Any, name: str, bounds: tuple = INT32) -> int:
    """An integer (Python int, NumPy integer, 0-d integer tensor) inside ``bounds``; bool and
    float are rejected (a float count is a mistake, not a conversion)."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        raise Error(f"{name}: expected an integer in {_range(bounds)}, got {describe(value)}")
    try:
        result = operator.index(value)
    except TypeError:
        raise Error(
            f"{name}: expected an integer in {_range(bounds)}, got {describe(value)}"
        ) from None
    if not bounds[0] <= result <= bounds[1]:
        raise Error(f"{name}: expected an integer in {_range(bounds)}, got {result}")
    return result


def opt_int_arg(value: Any, name: str, bounds: tuple = INT32) -> Optional[int]:
    return None if value is None else int_arg(value, name, bounds)


def float_arg(value: Any, name: str) -> float:
    """A real number (int, float, NumPy scalar, 0-d tensor); str and bool are rejected."""
    if isinstance(value, (str, bytes, bool)) or type(value).__name__ == "bool_":
        raise Error(f"{name}: expected a number, got {describe(value)}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise Error(f"{name}: expected a number, got {describe(value)}") from None


def opt_float_arg(value: Any, name: str) -> Optional[float]:
    return None if value is None else float_arg(value, name)


def bool_arg(value: Any, name: str) -> bool:
    """True or False (NumPy's bool_ too); anything else, None included, is rejected."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    raise Error(f"{name}: expected True or False, got {describe(value)}")


def str_arg(value: Any, name: str) -> str:
    """A str; which strings are accepted is checked where they are parsed (it lists them)."""
    if not isinstance(value, str):
        raise Error(f"{name}: expected a str, got {describe(value)}")
    return value


def opt_str_arg(value: Any, name: str) -> Optional[str]:
    return None if value is None else str_arg(value, name)


def dict_arg(value: Any, name: str, accepted: str) -> Optional[dict]:
    """None or a dict (its keys are checked where it is parsed)."""
    if value is None or isinstance(value, dict):
        return value
    raise Error(f"{name}: expected None or {accepted}, got {describe(value)}")


def int_list(value: Any, name: str, bounds: tuple = INT32) -> list:
    """A sequence of integers (list, tuple, range, 1-D integer array) as a list of ints."""
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise Error(f"{name}: expected a sequence of integers, got {describe(value)}")
    items = list(value.tolist() if hasattr(value, "tolist") else value)
    return [int_arg(item, f"{name}[{i}]", bounds) for i, item in enumerate(items)]


def float_list(value: Any, name: str) -> list:
    """A sequence of numbers as a list of floats."""
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise Error(f"{name}: expected a sequence of numbers, got {describe(value)}")
    items = list(value.tolist() if hasattr(value, "tolist") else value)
    return [float_arg(item, f"{name}[{i}]") for i, item in enumerate(items)]


def shape_of(x: Any, name: str, ndim: int) -> tuple:
    """The shape of array argument ``x``, which must have ``ndim`` dimensions."""
    shape = getattr(x, "shape", None)
    if shape is None or isinstance(x, type):
        raise Error(f"{name}: expected an array ({_ARRAY_KINDS}), got {describe(x)}")
    shape = tuple(int(s) for s in shape)
    if len(shape) != ndim:
        raise Error(f"{name}: expected {ndim} dimensions, got shape {list(shape)}")
    return shape


def int32_values(x: Any, name: str) -> Any:
    """A host int64 NumPy array of integer argument ``x`` (list, tuple, range, NumPy or torch CPU
    integer array), every value checked to fit in int32. Floats, bools and ragged nesting are
    rejected instead of being truncated."""
    import numpy as np

    if _library(x) == "torch":
        x = x.cpu()
    try:
        host = np.asarray(x)
    except (TypeError, ValueError):
        raise Error(
            f"{name}: expected integers (a list or an int32 array), got {describe(x)}"
        ) from None
    if host.size == 0 and host.dtype.kind == "f" and not hasattr(x, "dtype"):
        host = host.astype(np.int64)  # [] (or [[]]): NumPy's default dtype is float64
    if host.dtype == object and all(
        isinstance(v, int) and not isinstance(v, bool) for v in host.reshape(-1).tolist()
    ):
        raise Error(f"{name}: values must fit in int32")
    if host.dtype.kind not in "iu":
        raise Error(
            f"{name}: expected integers (a list or an int32 array), got "
            f"{'dtype ' + str(host.dtype) if hasattr(x, 'dtype') else describe(x)}"
        )
    if host.size and (host.min() < INT32[0] or host.max() > INT32[1]):
        raise Error(f"{name}: values must fit in int32")
    return host.astype(np.int64)


def _library(x: Any) -> str:
    return type(x).__module__.split(".")[0]
