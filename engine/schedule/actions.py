"""Actions, the unit of a pipeline schedule, and their one-token text form.

An action is `(stage, kind, micro_batch)`: `1F0` is stage 1's forward of micro-batch 0,
`0B3` stage 0's backward of micro-batch 3. Compute kinds are F, B, I (input-gradient half of a
split backward) and W (weight-gradient half); lowering adds the communication kinds
SEND_F / RECV_F (activations) and SEND_B / RECV_B (activation gradients), written `1SEND_F0`.
A SEND_F/SEND_B names the stage that sends; a RECV_F/RECV_B the stage that receives.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from enum import Enum
from typing import NamedTuple

__all__ = [
    "COMM_KINDS",
    "COMPUTE_KINDS",
    "Action",
    "ActionKind",
    "format_actions",
    "parse_action",
    "parse_actions",
    "split_units",
]


class ActionKind(str, Enum):
    """What an action does."""

    F = "F"
    B = "B"
    I = "I"  # noqa: E741 - the name the Zero Bubble paper uses
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    __hash__ = str.__hash__
    """Hashed as its text, in C: `Enum`'s own hash runs Python code, and schedules of tens of
    thousands of actions are hashed and compared by the planner and the replay."""


COMPUTE_KINDS = frozenset({ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W})
COMM_KINDS = frozenset({ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B})

_TOKEN = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")


class Action(NamedTuple):
    """One step of one rank's schedule.

    A named tuple, not a dataclass: the planner builds millions of them, and a tuple is
    made, hashed and compared in C (a frozen dataclass's constructor runs Python code)."""

    stage: int
    kind: ActionKind
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.micro_batch}"

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS


def parse_action(token: str) -> Action:
    """Parse the text form (`"1F0"`, `"0SEND_B2"`)."""
    match = _TOKEN.match(token.strip())
    if match is None:
        raise ValueError(
            f"cannot parse action {token!r}: write <stage><kind><micro_batch> with kind one of "
            + ", ".join(k.value for k in ActionKind)
            + " (for example 1F0 or 0SEND_B2)"
        )
    stage, kind, micro_batch = match.groups()
    return Action(int(stage), ActionKind(kind), int(micro_batch))


def split_units(actions: Iterable[Action]) -> frozenset[tuple[int, int]]:
    """The (stage, micro-batch) pairs whose backward is split: an I runs for them (their
    forward records what W needs); every other backward is a fused B."""
    return frozenset((a.stage, a.micro_batch) for a in actions if a.kind is ActionKind.I)


def format_actions(actions: Iterable[Action]) -> str:
    """Space-separated tokens of one rank's actions."""
    return " ".join(str(a) for a in actions)


def parse_actions(text: str | Sequence[str]) -> list[Action]:
    """Parse a whitespace- or comma-separated row of tokens (empty cells are skipped)."""
    tokens = re.split(r"[\s,]+", text) if isinstance(text, str) else list(text)
    return [parse_action(t) for t in tokens if t.strip()]
