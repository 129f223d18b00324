"""Input checks shared by the partition value and the partitioning methods.

Every public entry point validates here, before any compute, so a bad layer count or cost vector
fails with one message that names the bad value and the fix instead of a wrong partition.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence

__all__ = ["check_costs", "check_int_tuple", "check_num_stages"]


def check_num_stages(num_layers: int, num_stages: int) -> None:
    """Reject layer/stage counts that admit no partition with a non-empty stage each."""
    if num_layers < 1:
        raise ValueError(f"num_layers = {num_layers}: a model needs at least one layer")
    if num_stages < 1:
        raise ValueError(f"num_stages = {num_stages}: use at least 1 stage")
    if num_stages > num_layers:
        raise ValueError(
            f"cannot split {num_layers} layers into {num_stages} stages: "
            f"use at most {num_layers} stages or a model with more layers"
        )


def check_costs(
    costs: Sequence[float], *, name: str = "costs", num_layers: int | None = None
) -> tuple[float, ...]:
    """Return ``costs`` as plain Python numbers after checking they are finite and ``>= 0``.

    Integers stay integers so that large parameter counts are never rounded.
    """
    if len(costs) == 0:
        raise ValueError(f"{name} is empty: give one non-negative cost per layer")
    if num_layers is not None and len(costs) != num_layers:
        raise ValueError(
            f"{name} has {len(costs)} entries but the model has {num_layers} layers: "
            "give one entry per layer"
        )
    values: list[float] = []
    for i, cost in enumerate(costs):
        values.append(_check_cost(cost, f"{name}[{i}]"))
    try:
        math.fsum(values)
    except OverflowError:
        raise ValueError(f"{name} sum beyond the largest float: rescale them") from None
    return tuple(values)


def _check_cost(cost: object, label: str) -> float:
    if isinstance(cost, bool) or not isinstance(cost, numbers.Real):
        raise TypeError(f"{label} = {cost!r} is not a real number: costs must be numbers >= 0")
    value: float = int(cost) if isinstance(cost, numbers.Integral) else float(cost)
    if not math.isfinite(value):
        raise ValueError(f"{label} = {cost!r} is not finite: costs must be finite numbers >= 0")
    if value < 0:
        raise ValueError(f"{label} = {cost!r} is negative: costs must be finite numbers >= 0")
    return value


def check_int_tuple(values: Sequence[int], name: str) -> tuple[int, ...]:
    """Return ``values`` as a tuple of ints, so partitions stay hashable and exact."""
    out: list[int] = []
    for i, value in enumerate(values):
        try:
            out.append(operator.index(value))
        except TypeError:
            raise TypeError(
                f"{name}[{i}] = {value!r} is not an integer: layer counts are whole numbers"
            ) from None
    return tuple(out)
