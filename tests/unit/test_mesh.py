"""Which device a rank computes on: a GPU per local rank, or the CPU with gloo."""

from __future__ import annotations

import pytest
import torch

from engine import mesh


@pytest.fixture
def one_gpu(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_without_cuda_ranks_compute_on_the_cpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert not mesh._uses_cuda(None)


def test_asking_for_nccl_on_a_machine_without_cuda_is_refused_with_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"nccl needs CUDA.*gloo backend"):
        mesh._uses_cuda("nccl")


def test_a_gpu_for_every_local_rank_means_cuda(one_gpu: pytest.MonkeyPatch) -> None:
    one_gpu.setenv("LOCAL_WORLD_SIZE", "1")
    assert mesh._uses_cuda(None)


def test_more_local_ranks_than_gpus_run_on_the_cpu_and_say_why(
    one_gpu: pytest.MonkeyPatch,
) -> None:
    one_gpu.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.warns(UserWarning, match=r"4 ranks on this host but 1 CUDA device.*CPU with gloo"):
        assert not mesh._uses_cuda(None)


def test_the_deepspeed_launchers_local_size_counts_too(one_gpu: pytest.MonkeyPatch) -> None:
    one_gpu.setenv("LOCAL_SIZE", "2")
    with pytest.warns(UserWarning, match="2 ranks on this host"):
        assert not mesh._uses_cuda(None)


def test_a_local_rank_beyond_the_gpus_counts_without_a_launcher_size(
    one_gpu: pytest.MonkeyPatch,
) -> None:
    one_gpu.setenv("LOCAL_RANK", "1")
    assert not mesh._uses_cuda(None)  # silently: local rank 0 warns for the host


def test_asking_for_nccl_without_a_gpu_per_rank_is_refused_with_the_fix(
    one_gpu: pytest.MonkeyPatch,
) -> None:
    one_gpu.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"one rank per GPU \(1 per host\), or use the gloo"):
        mesh._uses_cuda("nccl")


def test_asking_for_gloo_keeps_ranks_on_the_cpu(one_gpu: pytest.MonkeyPatch) -> None:
    assert not mesh._uses_cuda("gloo")
