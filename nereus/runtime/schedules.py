"""Scenario schedules of an adaptive run, parsed without importing torch (the CLI checks them before
anything starts)."""

from __future__ import annotations

__all__ = ["parse_digits_schedule"]


def parse_digits_schedule(text: str | None) -> dict[int, int]:
    """``"4:5,8:7"`` → ``{4: 5, 8: 7}`` (step → digits per operand of the task from that step on).

    Raises:
        ValueError: an item not of the form ``STEP:DIGITS``, a negative step or digits outside 1..8.
    """
    out: dict[int, int] = {}
    for item in filter(None, (x.strip() for x in (text or "").split(","))):
        step, _, n = item.partition(":")
        try:
            k, dg = int(step), int(n)
        except ValueError:
            raise ValueError(f"--digits-schedule item {item!r} must look like 4:5 (step:digits)") from None
        if k < 0 or not 1 <= dg <= 8:
            raise ValueError(f"--digits-schedule item {item!r}: step must be >= 0 and digits in 1..8")
        out[k] = dg
    return out
