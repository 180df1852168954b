"""Scenario schedules of an adaptive run, parsed without importing torch (the CLI checks them before
anything starts)."""

from __future__ import annotations

__all__ = ["parse_digits_schedule", "parse_schedule_items", "parse_pool_schedule"]


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


def parse_schedule_items(text: str) -> list[tuple[str, int, int]]:
    """``"3:-2,6:+1"`` → ``[("3:-2", 3, -2), ("6:+1", 6, 1)]``.

    Raises:
        ValueError: an item not of the form ``STEP:±N`` or a negative step.
    """
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        step, _, n = item.partition(":")
        try:
            k, dn = int(step), int(n)
        except ValueError:
            raise ValueError(f"--pool-schedule item {item!r} must look like 3:-2 or 5:+1") from None
        if k < 0:
            raise ValueError(f"--pool-schedule item {item!r}: step must be >= 0")
        if dn == 0:
            raise ValueError(f"--pool-schedule item {item!r}: N must be non-zero (-N leave, +N join)")
        out.append((item, k, dn))
    if not out:
        raise ValueError(f"--pool-schedule {text!r} lists no change; use e.g. 3:-2")
    return out


def parse_pool_schedule(text: str | None) -> dict[int, int]:
    """``"3:-2,6:+1"`` → ``{3: -2, 6: 1}`` (step → workers joining (+) or leaving (-) before it);
    an empty or None text is no change.

    Raises:
        ValueError: as :func:`parse_schedule_items`.
    """
    out: dict[int, int] = {}
    if not (text or "").strip():
        return out
    for _item, k, dn in parse_schedule_items(text):
        out[k] = out.get(k, 0) + dn
    return out
