"""Range checks of user-given settings: one ``ValueError`` line per bad value.

Each message starts ``name=value:`` (the command line puts the recipe key in front of
``name``, see :func:`bb_lightning.cli.errors.explain_instantiation`), then says what is
accepted and gives an example, e.g. ``max_new_tokens=-3: must be an integer >= 1
(tokens generated per prompt), e.g. 64``.
"""

from __future__ import annotations

import math

__all__ = ["check_int", "check_number"]


def _show(value: object) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def check_int(
    name: str,
    value: object,
    *,
    low: int,
    what: str,
    example: int,
    none: str | None = None,
    high: int | None = None,
) -> None:
    """Raise ValueError unless ``value`` is an integer in ``[low, high]``.

    ``what`` names the unit (``"tokens per row"``); ``none``, when given, says what
    None means and lets it pass (``"the plan's"``).
    """
    if value is None and none is not None:
        return
    ok = isinstance(value, int) and not isinstance(value, bool)
    if ok and low <= value and (high is None or value <= high):  # type: ignore[operator]
        return
    accepted = f"an integer >= {low}" if high is None else f"an integer in {low}..{high}"
    alt = f", or null for {none}" if none is not None else ""
    raise ValueError(f"{name}={_show(value)}: must be {accepted} ({what}){alt}, e.g. {example}")


def check_number(
    name: str,
    value: object,
    *,
    low: float,
    what: str,
    example: float,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    none: str | None = None,
) -> None:
    """Raise ValueError unless ``value`` is a finite number in the interval from ``low`` to
    ``high`` (each end closed unless ``*_open``; no upper end when ``high`` is None)."""
    if value is None and none is not None:
        return
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if number and math.isfinite(value):  # type: ignore[arg-type]
        v = float(value)  # type: ignore[arg-type]
        above = v > low if low_open else v >= low
        below = high is None or (v < high if high_open else v <= high)
        if above and below:
            return
    if high is None:
        accepted = f"a number {'>' if low_open else '>='} {low:g}"
    else:
        left, right = "(" if low_open else "[", ")" if high_open else "]"
        accepted = f"a number in {left}{low:g}, {high:g}{right}"
    alt = f", or null for {none}" if none is not None else ""
    raise ValueError(f"{name}={_show(value)}: must be {accepted} ({what}){alt}, e.g. {example:g}")
