"""Schedule files, timeline plots, traces and the `meshpipe schedule` command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.cli.main import main
from engine.schedule.actions import format_actions
from engine.schedule.generators import (
    gpipe,
    interleaved_1f1b,
    make_schedule,
    one_f_one_b,
    zb_h1,
)
from engine.schedule.passes import add_communication
from engine.schedule.plots import TraceSlice, chrome_trace, plot_timeline, timeline_figure
from engine.schedule.resolve import schedule_for
from engine.schedule.simulate import ActionCosts, SimResult, simulate
from engine.schedule.text import load_schedule, save_schedule
from engine.schedule.validate import ScheduleError
from engine.training.config import TrainConfig
from engine.training.loop import train
from models import layer_specs
from partitioners import Partition, partition_model

PROFILED = ActionCosts(forward=0.002, backward=0.004, input_grad=0.002, weight_grad=0.002)
"""What the fake profiler measures, in seconds like the real one."""


@pytest.fixture
def profiled(monkeypatch: pytest.MonkeyPatch) -> list[Partition]:
    """`profile:` costs without timing real stages: returns `PROFILED`, records each partition."""
    partitions: list[Partition] = []

    def fake(specs: object, partition: Partition, **kwargs: object) -> ActionCosts:
        partitions.append(partition)
        return PROFILED

    monkeypatch.setattr("engine.plan.profile.profile_stage_costs", fake)
    return partitions


def _trace_span_us(path: Path) -> float:
    events = json.loads(path.read_text())["traceEvents"]
    return max(e["ts"] + e["dur"] for e in events if e["ph"] == "X")


@pytest.mark.parametrize("fmt", ["csv", "text"])
def test_saved_schedule_loads_back_equal(fmt: str, tmp_path: Path) -> None:
    schedule = interleaved_1f1b(2, 4, 2)
    save_schedule(schedule, tmp_path / "s", fmt=fmt)
    assert load_schedule(tmp_path / "s") == schedule


def test_lowered_schedule_round_trips(tmp_path: Path) -> None:
    schedule = add_communication(zb_h1(2, 3))
    save_schedule(schedule, tmp_path / "s.csv")
    assert load_schedule(tmp_path / "s.csv") == schedule


def test_plain_rows_without_header_load_with_loop_placement(tmp_path: Path) -> None:
    (tmp_path / "mine.txt").write_text("0F0 0F1 0B0 0B1\n1F0 1B0 1F1 1B1\n")
    schedule = load_schedule(tmp_path / "mine.txt")
    assert (schedule.num_stages, schedule.micro_batches, schedule.placement) == (2, 2, (0, 1))


def test_trailing_blank_lines_of_plain_rows_are_not_ranks(tmp_path: Path) -> None:
    (tmp_path / "mine.txt").write_text("0F0 0F1 0B0 0B1\n1F0 1B0 1F1 1B1\n\n\n")
    assert load_schedule(tmp_path / "mine.txt").num_ranks == 2


def test_trailing_blank_lines_beyond_the_headers_ranks_are_not_ranks(tmp_path: Path) -> None:
    schedule = zb_h1(2, 3)
    save_schedule(schedule, tmp_path / "s.csv")
    with (tmp_path / "s.csv").open("a", encoding="utf-8") as file:
        file.write("\n\n")
    assert load_schedule(tmp_path / "s.csv") == schedule


def test_a_broken_custom_schedule_is_rejected_on_load(tmp_path: Path) -> None:
    (tmp_path / "bad.txt").write_text("0B0 0F0\n1F0 1B0\n")
    with pytest.raises(ScheduleError, match="0B0 at index 0 comes before its 0F0"):
        load_schedule(tmp_path / "bad.txt")


def test_empty_schedule_file_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_text("# nothing\n")
    with pytest.raises(ValueError, match="holds no actions"):
        load_schedule(tmp_path / "empty.txt")


def test_timeline_plot_is_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    plot_timeline(simulate(zb_h1(2, 4)), tmp_path / "t.png", title="zb_h1")
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def _figure_labels(result: SimResult) -> tuple[list[str], list[str]]:
    """The texts on the bars and the legend's entries of a schedule's timeline figure."""
    import matplotlib.pyplot as plt

    fig = timeline_figure(result, title="t")
    ax = fig.axes[0]
    texts, legend = [t.get_text() for t in ax.texts], [t.get_text() for t in ax.get_legend().texts]
    plt.close(fig)
    return texts, legend


def test_interleaved_plot_labels_each_action_with_its_stage_chunk() -> None:
    pytest.importorskip("matplotlib")
    result = simulate(interleaved_1f1b(2, 4), ActionCosts(forward=2, backward=4))
    texts, _ = _figure_labels(result)
    chunk_of = {0: 0, 1: 0, 2: 1, 3: 1}  # stages 0, 2 on rank 0 and 1, 3 on rank 1
    expected = [
        f"{t.action.kind.value}{t.action.micro_batch}·c{chunk_of[t.action.stage]}"
        for row in result.timeline
        for t in row
        if t.action.is_compute
    ]
    assert texts == expected
    assert {"F3·c0", "F3·c1", "B0·c1"} <= set(texts)


def test_interleaved_plot_legend_lists_only_the_kinds_it_draws() -> None:
    pytest.importorskip("matplotlib")
    _, legend = _figure_labels(simulate(interleaved_1f1b(2, 4)))
    assert legend == ["F", "B"]


def test_a_one_stage_per_rank_plot_keeps_stage_kind_micro_batch_labels() -> None:
    pytest.importorskip("matplotlib")
    result = simulate(one_f_one_b(2, 2), ActionCosts(forward=2, backward=4))
    texts, legend = _figure_labels(result)
    assert texts == ["0F0", "0F1", "0B0", "0B1", "1F0", "1B0", "1F1", "1B1"]
    assert legend == ["F", "B"]


def test_a_zero_bubble_plot_legend_lists_its_split_backwards() -> None:
    pytest.importorskip("matplotlib")
    assert _figure_labels(simulate(zb_h1(2, 4)))[1] == ["F", "B", "I", "W"]


def test_chrome_trace_has_a_track_per_rank_and_a_slice_per_action(tmp_path: Path) -> None:
    timelines = [
        [TraceSlice("0F0", 0.0, 0.5)],
        [TraceSlice("1F0", 0.5, 1.0), TraceSlice("1B0", 1.0, 2.0)],
    ]
    chrome_trace(timelines, tmp_path / "t.json")
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert [(e["name"], e["tid"], e["dur"], e["args"]) for e in slices] == [
        ("0F0", 0, 500000.0, {"step": 0}),
        ("1F0", 1, 500000.0, {"step": 0}),
        ("1B0", 1, 1000000.0, {"step": 0}),
    ]


def test_chrome_trace_puts_communication_on_a_track_below_its_rank(tmp_path: Path) -> None:
    timelines = [
        [TraceSlice("0B1", 1.0, 2.0, step=3)],
        [
            TraceSlice("0B1", 1.0, 2.0, step=3),
            TraceSlice("dp all-reduce", 1.5, 2.5, step=3, track="communication"),
        ],
    ]
    chrome_trace(timelines, tmp_path / "t.json")
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    order = {e["tid"]: e["args"]["sort_index"] for e in events if e["name"] == "thread_sort_index"}
    slices = [(e["name"], names[e["tid"]], e["args"]["step"]) for e in events if e["ph"] == "X"]
    assert slices == [
        ("0B1", "rank 0", 3),
        ("0B1", "rank 1", 3),
        ("dp all-reduce", "rank 1 communication", 3),
    ]
    assert sorted(names, key=order.__getitem__) == [0, 1, 3]


def test_schedule_trace_keeps_profiled_costs_in_seconds(
    tmp_path: Path, profiled: list[Partition]
) -> None:
    trace = tmp_path / "t.json"
    argv = ["schedule", "--schedule", "gpipe", "--pp", "2", "--micro-batches", "2"]
    assert main([*argv, "--costs", "profile:gpt-tiny", "--trace", str(trace)]) == 0
    step_s = simulate(gpipe(2, 2), PROFILED).step_time
    assert _trace_span_us(trace) == pytest.approx(step_s * 1e6)


def test_profiled_costs_partition_at_the_given_micro_batch_size_and_seq_len(
    profiled: list[Partition],
) -> None:
    argv = ["schedule", "--pp", "3", "--micro-batches", "3", "--costs", "profile:gpt2"]
    assert main([*argv, "--micro-batch-size", "8", "--seq-len", "1024"]) == 0
    specs = layer_specs("gpt2")
    at_shape = partition_model(specs, method="balanced", num_stages=3, batch_size=8, seq_len=1024)
    assert at_shape != partition_model(specs, method="balanced", num_stages=3)
    assert profiled == [at_shape]


def test_schedule_trace_reads_abstract_unit_costs_as_milliseconds(tmp_path: Path) -> None:
    trace = tmp_path / "t.json"
    argv = ["schedule", "--schedule", "gpipe", "--pp", "2", "--micro-batches", "2"]
    assert main([*argv, "--costs", "1,2,1,1", "--trace", str(trace)]) == 0
    step_units = simulate(gpipe(2, 2), ActionCosts()).step_time
    assert _trace_span_us(trace) == pytest.approx(step_units * 1e3)


def test_schedule_command_prints_grid_bubble_and_peaks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "s.csv"
    argv = ["schedule", "--schedule", "zb_h1", "--pp", "2", "--micro-batches", "3"]
    assert main([*argv, "--format", "csv", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert format_actions(zb_h1(2, 3).rows[0]) in text
    assert "bubble" in text and "activation peak per stage:  [2, 2]" in text
    assert load_schedule(out) == make_schedule("zb_h1", num_ranks=2, micro_batches=3)


def test_schedule_command_rejects_unparsable_costs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["schedule", "--costs", "fast,slow"])
    assert "give F,B,I,W or F,B,I,W,comm" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ({"num_ranks": 3, "micro_batches": 4}, "has 2 rank rows but the run has 3 .*--pp 2"),
        ({"num_ranks": 2, "micro_batches": 8}, "runs 4 micro-batches but the run has 8"),
        (
            {"num_ranks": 2, "micro_batches": 4, "stages_per_rank": 2},
            "places 2 stages on 2 ranks .* --stages-per-rank 1",
        ),
    ],
)
def test_a_schedule_file_for_another_layout_is_refused_naming_the_fix(
    tmp_path: Path, layout: dict[str, int], message: str
) -> None:
    save_schedule(zb_h1(2, 4), tmp_path / "s.csv")
    with pytest.raises(ValueError, match=message):
        schedule_for(str(tmp_path / "s.csv"), **layout)


def test_a_schedule_file_with_communication_is_refused(tmp_path: Path) -> None:
    save_schedule(add_communication(zb_h1(2, 4)), tmp_path / "s.csv")
    with pytest.raises(ValueError, match="holds SEND/RECV actions"):
        schedule_for(str(tmp_path / "s.csv"), num_ranks=2, micro_batches=4)


def test_a_schedule_file_that_deadlocks_is_refused_before_any_rank_starts(tmp_path: Path) -> None:
    (tmp_path / "s.csv").write_text("0F0,0B0,0F1,0B1\n1F0,1F1,1B0,1B1\n")
    with pytest.raises(ScheduleError, match=r"(?s)schedule file .*s\.csv: deadlock"):
        TrainConfig.of(
            model="gpt-tiny",
            pp=2,
            micro_batches=2,
            global_batch=4,
            schedule=str(tmp_path / "s.csv"),
        )


def test_a_schedule_file_that_does_not_exist_is_named_as_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"schedule file .*nothere\.csv does not exist"):
        schedule_for(str(tmp_path / "nothere.csv"), num_ranks=2, micro_batches=4)


def test_a_schedule_file_gives_the_schedule_it_holds(tmp_path: Path) -> None:
    save_schedule(zb_h1(2, 4), tmp_path / "s.txt", fmt="text")
    assert schedule_for(str(tmp_path / "s.txt"), num_ranks=2, micro_batches=4) == zb_h1(2, 4)


def test_a_one_rank_run_trains_from_a_schedule_file_as_from_its_name(tmp_path: Path) -> None:
    save_schedule(make_schedule("1f1b", num_ranks=1, micro_batches=2), tmp_path / "s.csv")
    run = {"model": "gpt-tiny", "steps": 2, "global_batch": 4, "micro_batches": 2, "seq_len": 32}
    by_name = train(TrainConfig.of(**run, threads=1), progress=False).losses
    from_file = train(
        TrainConfig.of(**run, threads=1, schedule=str(tmp_path / "s.csv")), progress=False
    )
    assert from_file.losses == by_name


def test_schedule_out_writes_csv_for_a_csv_name(tmp_path: Path) -> None:
    out = tmp_path / "new" / "s.csv"
    assert main(["schedule", "--pp", "2", "--micro-batches", "2", "--out", str(out)]) == 0
    assert "0F0,0F1" in out.read_text()
    assert load_schedule(out) == make_schedule("1f1b", num_ranks=2, micro_batches=2)


def test_schedule_load_refuses_generator_flags_it_would_ignore(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save_schedule(zb_h1(2, 3), tmp_path / "s.csv")
    with pytest.raises(SystemExit):
        main(["schedule", "--load", str(tmp_path / "s.csv"), "--schedule", "gpipe", "--pp", "2"])
    assert "drop --schedule, --pp" in capsys.readouterr().err


def test_a_bar_narrower_than_its_label_goes_unlabelled() -> None:
    """Forwards a hundredth of a backward: their labels would print over each other."""
    pytest.importorskip("matplotlib")
    result = simulate(one_f_one_b(2, 8), ActionCosts(forward=0.01, backward=4))
    texts, _ = _figure_labels(result)
    assert texts and all("B" in text for text in texts)
