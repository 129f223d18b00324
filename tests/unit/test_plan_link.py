"""The link between this host's ranks, measured for `meshpipe plan --profile`: fitted to the cost
model's ring all-reduce, measured over real gloo processes, used unless the flags give it, and
named in the plan's output."""

import argparse
import math
from dataclasses import replace

import pytest

import engine.cli.plan
from engine.cli.main import build_parser, main
from engine.cli.plan import request_from_args
from engine.plan import (
    Hardware,
    Link,
    PlanRequest,
    fitted_link,
    measured_device_flops,
    measured_link,
)
from engine.plan.hardware import all_gather_time, all_reduce_time, reduce_scatter_time
from engine.plan.link import LINK_SIZES
from engine.plan.timing import dp_tail

_RUN = ["--model", "gpt-tiny", "--devices", "2", "--global-batch", "4", "--device-memory", "1GB"]
_QUICK = ["--seq-len", "16", "--micro-batch-sizes", "1"]


def _request(*flags: str) -> PlanRequest:
    argv = ["plan", *_RUN, *_QUICK, *flags]
    args: argparse.Namespace = build_parser().parse_args(argv)
    return request_from_args(args, argv[1:])


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_the_fit_gives_back_the_link_whose_all_reduces_it_was_given(ranks: int) -> None:
    latency, bandwidth = 1.5e-3, 2e9
    small, large = (all_reduce_time(n, ranks, bandwidth, latency) for n in LINK_SIZES)
    fitted = fitted_link(small, large, ranks)
    assert fitted == pytest.approx((latency, bandwidth), rel=1e-9)


def test_a_fit_never_prices_a_negative_latency() -> None:
    small = all_reduce_time(LINK_SIZES[0], 2, 1e9, 0.0) * 0.5  # faster than bandwidth allows
    large = all_reduce_time(LINK_SIZES[1], 2, 1e9, 0.0)
    assert fitted_link(small, large, 2)[0] == 0.0


def test_a_large_all_reduce_no_slower_than_a_small_one_is_refused_with_the_flags() -> None:
    with pytest.raises(ValueError, match="the larger must take longer.*--link-bandwidth"):
        fitted_link(2e-3, 1e-3, 2)


def test_the_link_between_two_gloo_processes_of_this_host_is_measured() -> None:
    link = measured_link(2, samples=20)  # few enough to be quick, enough that the 8 MiB
    # mean stays above the 64 KiB one (a small all-reduce's tail reaches 5-8 ms)
    assert link.latency >= 0 and 0 < link.bandwidth < math.inf
    assert 0 < link.reduce_scatter_factor < math.inf and 0 < link.all_gather_factor < math.inf


def test_profile_prices_gloos_reduce_scatter_and_all_gather_as_measured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    link = Link(latency=2e-3, bandwidth=1.5e9, reduce_scatter_factor=2.5, all_gather_factor=1.2)
    monkeypatch.setattr(engine.cli.plan, "measured_link", lambda: link)
    hardware = _request("--profile").hardware
    assert (hardware.reduce_scatter_factor, hardware.all_gather_factor) == (2.5, 1.2)
    given = _request("--profile", "--reduce-scatter-factor", "3").hardware
    assert (given.reduce_scatter_factor, given.all_gather_factor) == (3.0, 1.2)


def test_profile_prices_the_links_measured_here_not_nvlinks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        engine.cli.plan, "measured_link", lambda: Link(latency=2e-3, bandwidth=1.5e9)
    )
    hardware = _request("--profile").hardware
    assert (hardware.latency, hardware.link_bandwidth) == (2e-3, 1.5e9)
    assert hardware.inter_node_bandwidth == 1.5e9  # one host: no other node's NIC
    assert _request().hardware == Hardware()  # without --profile, the defaults


def test_link_flags_given_win_over_the_measured_link(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        engine.cli.plan, "measured_link", lambda: Link(latency=2e-3, bandwidth=1.5e9)
    )
    hardware = _request("--profile", "--latency", "5e-5").hardware
    assert (hardware.latency, hardware.link_bandwidth) == (5e-5, 1.5e9)

    def unasked() -> Link:
        raise AssertionError("measured although every link flag was given")

    monkeypatch.setattr(engine.cli.plan, "measured_link", unasked)
    flags = ["--latency", "5e-5", "--link-bandwidth", "3e9", "--inter-node-bandwidth", "1e9"]
    flags += ["--reduce-scatter-factor", "1", "--all-gather-factor", "1"]
    hardware = _request("--profile", *flags).hardware
    assert (hardware.latency, hardware.link_bandwidth, hardware.inter_node_bandwidth) == (
        5e-5,
        3e9,
        1e9,
    )


def test_the_plan_says_what_it_was_priced_with(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(
        engine.cli.plan, "measured_link", lambda: Link(latency=2e-3, bandwidth=1.5e9)
    )
    given = ["--memory-bandwidth", "4e10", "--device-flops", "8e10"]
    assert main(["plan", *_RUN, *_QUICK, "--profile", *given]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == (
        "priced with: layers timed on this CPU, MFU against its 80 GFLOP/s GEMM peak; links "
        "1.5 GB/s within a node, 1.5 GB/s across, 2 ms latency; memory 40 GB/s"
    )
    assert main(["plan", *_RUN, *_QUICK]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "priced with: 989 TFLOP/s × 0.5 per device; links 50 GB/s within a node, 25 GB/s "
        "across, 10 µs latency; memory 3.35 TB/s"
    )


def test_the_plan_names_the_reduce_scatter_and_all_gather_factors_it_priced(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    link = Link(latency=2e-3, bandwidth=1.5e9, reduce_scatter_factor=2.5, all_gather_factor=1.2)
    monkeypatch.setattr(engine.cli.plan, "measured_link", lambda: link)
    given = ["--memory-bandwidth", "4e10", "--device-flops", "8e10"]
    assert main(["plan", *_RUN, *_QUICK, "--profile", *given]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "priced with: layers timed on this CPU, MFU against its 80 GFLOP/s GEMM peak; links "
        "1.5 GB/s within a node, 1.5 GB/s across, 2 ms latency, reduce-scatter 2.5× and "
        "all-gather 1.2× a ring's; memory 40 GB/s"
    )


def test_profile_reports_mfu_against_the_gemm_peak_measured_here(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The layers are timed on this CPU, so an H100's 989 TFLOP/s would put every plan's MFU
    at 0.0 %: the peak is a matrix product's rate here, unless --device-flops is given."""
    monkeypatch.setattr(
        engine.cli.plan, "measured_link", lambda: Link(latency=2e-3, bandwidth=1.5e9)
    )
    monkeypatch.setattr(engine.cli.plan, "measured_device_flops", lambda precision: 5e10)
    assert _request("--profile").hardware.device_flops == 5e10
    assert _request("--profile", "--device-flops", "7e10").hardware.device_flops == 7e10


def test_a_matrix_products_rate_is_measured_in_the_plans_precision() -> None:
    for precision in ("fp32", "bf16", "fp16"):
        assert 0 < measured_device_flops(precision, largest=64, repeats=1) < math.inf


def test_zeros_reduce_scatter_and_all_gather_are_priced_at_the_backends_factors() -> None:
    ring = Hardware(link_bandwidth=1e9, latency=1e-3)
    gloo = replace(ring, reduce_scatter_factor=2.5, all_gather_factor=1.2)
    params, dp = 1e6, 2
    scatter = reduce_scatter_time(4 * params, dp, 1e9, 1e-3)
    gather = all_gather_time(4 * params, dp, 1e9, 1e-3)

    def tail(hardware: Hardware, zero: int, reshard: str = "step") -> float:
        return dp_tail(
            params, size=4, dp=dp, zero=zero, reshard=reshard, hardware=hardware, width=2
        )

    assert tail(gloo, 0) == tail(ring, 0) == all_reduce_time(4 * params, dp, 1e9, 1e-3)
    assert tail(gloo, 1) == all_reduce_time(4 * params, dp, 1e9, 1e-3) + 1.2 * gather
    assert tail(gloo, 2) == tail(gloo, 3) == 2.5 * scatter + 1.2 * gather
    assert tail(ring, 2) == scatter + gather
    assert tail(gloo, 3, "micro-batch") == 0.0  # gathered and scattered in each micro-batch


def test_profile_prices_the_ranks_sharing_this_hosts_cores_unless_told(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--profile plans a run of this host's processes: four ranks on two cores share them."""
    monkeypatch.setattr(
        engine.cli.plan, "measured_link", lambda: Link(latency=2e-3, bandwidth=1.5e9)
    )
    monkeypatch.setattr(engine.cli.plan, "available_cores", lambda: 2)
    assert _request("--profile").hardware.host_cores == 2
    assert _request("--profile", "--host-cores", "4").hardware.host_cores == 4
    assert _request().hardware.host_cores == 0  # devices of their own


def test_the_plan_says_its_ranks_share_the_hosts_cores(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["plan", "--model", "gpt-tiny", "--devices", "4", "--global-batch", "4"]
    argv += ["--device-memory", "1GB", *_QUICK, "--host-cores", "2"]
    assert main(argv) == 0
    assert "the 4 ranks sharing this host's 2 cores" in capsys.readouterr().out
