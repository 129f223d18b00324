"""`meshpipe memory` as a script sees it: the exit code, the JSON, and the flags it refuses."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine.cli.main import main
from engine.cli.memory import DOES_NOT_FIT

LAYOUT = ["memory", "--model", "gpt-tiny", "--pp", "2", "--micro-batch-size", "2"]
"""gpt-tiny peaks at a few MiB per rank: over 1KB, under 1GB."""


def _memory(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main([*LAYOUT, *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _estimate(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    code, out, _ = _memory(capsys, "--json", *argv)
    return code, json.loads(out)[0]


# --- does it fit ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [[], ["--json"]], ids=["text", "json"])
def test_a_layout_over_the_device_memory_exits_3(
    capsys: pytest.CaptureFixture[str], mode: list[str]
) -> None:
    code, _, _ = _memory(capsys, "--device-memory", "1KB", *mode)
    assert code == DOES_NOT_FIT == 3


@pytest.mark.parametrize("mode", [[], ["--json"]], ids=["text", "json"])
def test_a_layout_that_fits_exits_0(capsys: pytest.CaptureFixture[str], mode: list[str]) -> None:
    code, _, _ = _memory(capsys, "--device-memory", "1GB", *mode)
    assert code == 0


def test_the_help_documents_the_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["memory", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "3 when a rank's peak exceeds --device-memory" in help_text
    assert "2 on bad input" in help_text


def test_json_carries_the_verdict_the_text_prints(capsys: pytest.CaptureFixture[str]) -> None:
    _, estimate = _estimate(capsys, "--device-memory", "1KB")
    assert estimate["device_memory"] == 1000
    assert estimate["fits"] is False
    assert estimate["ranks_over"] == [0, 1]


def test_json_carries_the_alternatives_the_text_prints(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Same flags, same peaks, as bytes: a script picks one without parsing the text."""
    _, estimate = _estimate(capsys, "--device-memory", "1KB")
    _, text, _ = _memory(capsys, "--device-memory", "1KB")
    suggestions = estimate["suggestions"]
    assert suggestions
    for s in suggestions:
        assert set(s) == {"change", "peak", "fits", "note"}
        assert f"  {s['change']}\n" in text
        assert s["fits"] == (s["peak"] <= 1000)


def test_json_of_a_layout_that_fits_has_no_alternatives(
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, estimate = _estimate(capsys, "--device-memory", "1GB")
    assert estimate["fits"] is True and estimate["ranks_over"] == []
    assert estimate["suggestions"] == []


def test_json_without_a_device_memory_keeps_only_the_report(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, estimate = _estimate(capsys)
    assert code == 0
    assert list(estimate) == [
        "config",
        "partition",
        "stages",
        "rank_peaks",
        "source",
        "allocator_peaks",
    ]


# --- flags it refuses -------------------------------------------------------------------------


def test_recompute_stages_without_a_policy_names_the_flag_to_add(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = _memory(capsys, "--recompute-stages", "1")
    assert code == 2 and out == ""
    assert "--recompute-stages 1 has nothing to apply" in err
    assert "add --recompute full" in err


def test_recompute_stages_restrict_a_given_policy(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _memory(capsys, "--recompute", "full", "--recompute-stages", "1")
    assert code == 0 and "recompute full on (1,)" in out


def test_zero_reshard_stages_reshard_only_those_stages(capsys: pytest.CaptureFixture[str]) -> None:
    """Stage 1 holds its gradients sharded over the step, stage 0 whole: 2 replicas halve it."""
    zero3 = ["--dp", "2", "--zero", "3", "--optimizer-impl", "per_tensor"]
    flags = [*zero3, "--zero-reshard", "micro-batch", "--zero-reshard-stages", "1"]
    code, out, _ = _memory(capsys, *flags)
    assert code == 0 and "ZeRO-3 resharded per micro-batch on stage 1 " in out
    _, kept = _estimate(capsys, *zero3, "--zero-reshard", "step")
    _, mixed = _estimate(capsys, *flags)
    gradients = [[s["gradients"] for s in e["stages"]] for e in (kept, mixed)]
    assert gradients[1][0] == gradients[0][0] and gradients[1][1] < gradients[0][1]


def test_an_unknown_cost_model_is_named_unknown_with_the_usable_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Worded as `meshpipe plan` words it, less `time`, which the memory model refuses."""
    code, _, err = _memory(capsys, "--cost-model", "bogus")
    assert code == 2
    assert (
        "unknown cost model 'bogus': choose one of parameters, flops, activations, or time" in err
    )
