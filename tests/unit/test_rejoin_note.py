"""What a relaunched replica says when it rejoins: the steps it missed, or that it missed none."""

from __future__ import annotations

from types import SimpleNamespace

from engine.training.replica_loop import rejoin_note


def _rejoined(after: int, missed: int) -> SimpleNamespace:
    return SimpleNamespace(healed=(0, after), missed_steps=missed, place=SimpleNamespace(replica=1))


def test_a_replica_that_missed_steps_names_them() -> None:
    note = rejoin_note(_rejoined(7, 4))  # type: ignore[arg-type]
    assert note.startswith("replica 1 rejoined at step 8 with a live replica's weights")
    assert note.endswith("it missed 4 steps (4 to 7, trained without it)")


def test_a_replica_back_before_any_step_was_committed_without_it_says_it_missed_none() -> None:
    note = rejoin_note(_rejoined(2, 0))  # type: ignore[arg-type]
    assert note.endswith("it missed no step (the live replicas committed none without it)")
