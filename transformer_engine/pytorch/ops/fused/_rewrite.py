"""The scan every fusion function runs: left to right over the operation list, replacing each
run a pattern matches by its fused operation.

A pattern is ``match(ops, i) -> (fused_op, count) | None``: at position ``i`` it either builds
the fused operation covering ``ops[i : i + count]`` or declines, and the scan keeps ``ops[i]``
and moves on by one. Runs never overlap: after a match the scan continues after the run.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["replace_matching_runs", "op_at"]


def op_at(ops, i: int):
    """``ops[i]``, or ``None`` past the end (patterns look ahead without bounds checks)."""
    return ops[i] if i < len(ops) else None


def replace_matching_runs(ops, match: Callable) -> list:
    """``ops`` with every run ``match`` accepts replaced by the fused operation it returns."""
    out, i = [], 0
    while i < len(ops):
        found = match(ops, i)
        if found is None:
            out.append(ops[i])
            i += 1
        else:
            fused, count = found
            out.append(fused)
            i += count
    return out
