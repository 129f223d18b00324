"""Partition: the stage boundaries ``(0, b1, ..., L)`` of a layer list, as one frozen value.

Schedules, the memory model and the runtime all read stage ranges from this value, so it checks
itself once on construction and offers the few lookups they need.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from partitioners._checks import check_costs, check_int_tuple

__all__ = ["Partition"]


@dataclass(frozen=True, kw_only=True)
class Partition:
    """Stage ``s`` holds the contiguous layers ``[boundaries[s], boundaries[s + 1])``."""

    boundaries: tuple[int, ...]
    """``(0, b1, ..., L)``, strictly increasing so that every stage holds at least one layer."""

    def __post_init__(self) -> None:
        bounds = check_int_tuple(self.boundaries, "boundaries")
        # Coerce lists to a tuple so the value is hashable and cannot change under us.
        object.__setattr__(self, "boundaries", bounds)
        if len(bounds) < 2:
            raise ValueError(
                f"boundaries {bounds} need at least 2 entries: give (0, ..., num_layers)"
            )
        if bounds[0] != 0:
            raise ValueError(f"boundaries {bounds} start at {bounds[0]}: start them at 0")
        for i in range(1, len(bounds)):
            if bounds[i] <= bounds[i - 1]:
                raise ValueError(
                    f"boundaries {bounds} are not strictly increasing at index {i} "
                    f"({bounds[i - 1]} -> {bounds[i]}): every stage needs at least one layer"
                )

    @classmethod
    def from_boundaries(cls, boundaries: Sequence[int]) -> Partition:
        """Build from ``(0, b1, ..., L)`` (torch pipelining's split points plus both ends)."""
        return cls(boundaries=tuple(boundaries))

    @classmethod
    def from_balance(cls, balance: Sequence[int]) -> Partition:
        """Build from fairscale/torchgpipe's ``balance=[n0, n1, ...]`` layers per stage."""
        counts = check_int_tuple(balance, "balance")
        if not counts:
            raise ValueError("balance is empty: give the number of layers of each stage")
        for i, count in enumerate(counts):
            if count < 1:
                raise ValueError(
                    f"balance[{i}] = {count} in {list(counts)}: every stage needs at least 1 layer"
                )
        bounds = [0]
        for count in counts:
            bounds.append(bounds[-1] + count)
        return cls(boundaries=tuple(bounds))

    @property
    def num_stages(self) -> int:
        return len(self.boundaries) - 1

    @property
    def num_layers(self) -> int:
        return self.boundaries[-1]

    @property
    def sizes(self) -> tuple[int, ...]:
        """Layers per stage."""
        return tuple(b - a for a, b in pairwise(self.boundaries))

    def to_balance(self) -> list[int]:
        """The fairscale/torchgpipe ``balance`` list (layers per stage)."""
        return list(self.sizes)

    def stage_of(self, layer: int) -> int:
        """The stage that holds global layer index ``layer``."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(
                f"layer {layer} is out of range: this partition holds layers "
                f"0..{self.num_layers - 1}"
            )
        return bisect_right(self.boundaries, layer) - 1

    def layers_of(self, stage: int) -> range:
        """The global layer indices of ``stage``."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(
                f"stage {stage} is out of range: this partition has stages 0..{self.num_stages - 1}"
            )
        return range(self.boundaries[stage], self.boundaries[stage + 1])

    def stage_costs(self, costs: Sequence[float]) -> tuple[float, ...]:
        """Sum of per-layer ``costs`` in each stage.

        ``math.fsum`` rounds the exact sum once, so the result does not depend on summation
        order: the optimum found by ``balanced`` (exact arithmetic) is also optimal here.
        """
        values = check_costs(costs, num_layers=self.num_layers)
        return tuple(math.fsum(values[a:b]) for a, b in pairwise(self.boundaries))

    def describe(
        self,
        *,
        costs: Sequence[float] | None = None,
        params: Sequence[int] | None = None,
        names: Sequence[str] | None = None,
    ) -> str:
        """A per-stage table plus the max/mean imbalance, for logs and ``meshpipe plan``.

        The imbalance is measured on ``costs`` if given, else ``params``, else layer counts.
        """
        stage_costs = self.stage_costs(costs) if costs is not None else None
        stage_params = self.stage_costs(params) if params is not None else None
        if names is not None and len(names) != self.num_layers:
            raise ValueError(
                f"names has {len(names)} entries but the partition has {self.num_layers} "
                "layers: give one name per layer"
            )
        header = ["stage", "layers", "#layers", "params", "cost share"]
        if names is not None:
            header.append("kinds")
        rows = [header]
        for s, (a, b) in enumerate(pairwise(self.boundaries)):
            row = [str(s), f"[{a}, {b})", str(b - a)]
            row.append(_human(stage_params[s]) if stage_params is not None else "-")
            row.append(_share(stage_costs, s) if stage_costs is not None else "-")
            if names is not None:
                row.append(_span_names(names[a:b]))
            rows.append(row)
        basis, loads = _imbalance_basis(stage_costs, stage_params, self.sizes)
        return _table(rows) + f"\nimbalance max/mean ({basis}): {_imbalance(loads)}"


def _human(count: float) -> str:
    """Short human form of a count: 950, 12.5K, 1.2M, 3.4B."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            return f"{count / scale:.1f}{suffix}"
    return f"{count:g}"


def _share(loads: Sequence[float], stage: int) -> str:
    total = math.fsum(loads)
    return f"{100 * loads[stage] / total:.1f}%" if total > 0 else "-"


def _span_names(names: Sequence[str]) -> str:
    return names[0] if names[0] == names[-1] else f"{names[0]}..{names[-1]}"


def _imbalance_basis(
    costs: Sequence[float] | None, params: Sequence[float] | None, sizes: Sequence[int]
) -> tuple[str, Sequence[float]]:
    if costs is not None:
        return "cost", costs
    if params is not None:
        return "params", params
    return "layers", sizes


def _imbalance(loads: Sequence[float]) -> str:
    mean = math.fsum(loads) / len(loads)
    return f"{max(loads) / mean:.3f}" if mean > 0 else "n/a (all loads are zero)"


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )
