"""scripts/profile_vs_run.py: a traced pipeline run's F + B beside the two profiles the
planner can price it by, stage by stage, and the same command's spread from run to run."""

from __future__ import annotations

from pathlib import Path

from scripts import profile_vs_run as script

_ARGS = ["--model", "gpt-tiny", "--rounds", "1", "--steps", "3", "--repeats", "1"]


def test_each_stage_is_priced_three_ways_beside_its_own_run(tmp_path: Path) -> None:
    prices = script.stage_prices(script.parse_args(_ARGS), tmp_path)
    assert [p.stage for p in prices] == [0, 1]
    for p in prices:
        assert p.layers > 0 and p.in_process > 0 and p.run > 0


def test_the_run_trains_the_stages_the_profiles_time() -> None:
    args = script.parse_args(_ARGS)
    bounds = script._bounds(args)
    command = script._command(args, bounds)
    assert command[command.index("--partition") + 1] == "boundaries:" + ",".join(map(str, bounds))
    assert command[command.index("--global-batch") + 1] == str(8 * 2)


def test_the_spread_runs_the_same_command_as_often_as_asked() -> None:
    tokens = script.spread(script.parse_args([*_ARGS, "--spread", "2"]))
    assert len(tokens) == 2 and min(tokens) > 0
