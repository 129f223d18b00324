"""`meshpipe plan --accelerator NAME`: an accelerator's datasheet rates instead of typing them, the
flags given still winning, and an unknown name refused with the known ones."""

import argparse

import pytest

from engine.cli.main import build_parser
from engine.cli.plan import request_from_args
from engine.plan import ACCELERATORS, Hardware, PlanRequest
from tests.unit.cli_error import cli_error

_RUN = ["--model", "gpt-tiny", "--devices", "2", "--global-batch", "4", "--device-memory", "1GB"]


def _request(*flags: str) -> PlanRequest:
    argv = ["plan", *_RUN, *flags]
    args: argparse.Namespace = build_parser().parse_args(argv)
    return request_from_args(args, argv[1:])


def test_a_named_accelerator_sets_its_peak_and_memory_bandwidth() -> None:
    hardware = _request("--accelerator", "mi300x").hardware
    assert (hardware.device_flops, hardware.memory_bandwidth) == (1307e12, 5.3e12)
    assert hardware.link_bandwidth == Hardware().link_bandwidth  # links are the system's


def test_the_default_rates_are_an_h100_sxms() -> None:
    assert _request("--accelerator", "h100-sxm").hardware == _request().hardware


def test_a_rate_given_as_a_flag_wins_over_the_accelerators() -> None:
    hardware = _request("--accelerator", "a100-80gb", "--device-flops", "2e14").hardware
    assert (hardware.device_flops, hardware.memory_bandwidth) == (2e14, 2.039e12)


def test_names_are_read_case_blind() -> None:
    assert _request("--accelerator", "H200-SXM").hardware.memory_bandwidth == 4.8e12


def test_every_accelerator_is_faster_than_a_cpu_and_holds_its_datasheets_memory() -> None:
    for name, chip in ACCELERATORS.items():
        assert chip.device_flops >= 1e14 and chip.memory_bandwidth >= 1e12, name
        assert chip.memory_gb in (40, 80, 141, 192), name


def test_an_unknown_accelerator_is_refused_with_the_known_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, err = cli_error(["plan", *_RUN, "--accelerator", "h200x"], capsys)
    assert code == 2
    assert "--accelerator 'h200x': not an accelerator meshpipe knows" in err
    assert "h100-sxm" in err and "--device-flops" in err


def test_without_a_budget_the_accelerators_memory_is_named(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["plan", "--model", "gpt-tiny", "--devices", "2", "--global-batch", "4"]
    code, err = cli_error([*argv, "--accelerator", "h200-sxm"], capsys)
    assert code == 2
    assert "give --device-memory: an h200-sxm holds 141 GB" in err


def test_accelerator_without_devices_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = cli_error(["plan", "--model", "gpt-tiny", "--accelerator", "h100-sxm"], capsys)
    assert code == 2
    assert "--accelerator: the planner's, which runs with --devices N" in err


def test_an_accelerator_with_the_cpu_profile_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, err = cli_error(["plan", *_RUN, "--accelerator", "h100-sxm", "--profile"], capsys)
    assert code == 2
    assert "--accelerator h100-sxm with --profile" in err
