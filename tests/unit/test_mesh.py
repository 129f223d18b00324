"""Where a rank computes and over which backend: a GPU per local rank with NCCL, GPUs shared
over gloo when asked, or the CPU with gloo."""

from __future__ import annotations

import pytest
import torch

from engine.comm import mesh

CPU = torch.device("cpu")


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
    assert mesh.placement(None, "auto") == (CPU, "gloo")


def test_asking_for_nccl_on_a_machine_without_cuda_is_refused_with_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"nccl needs CUDA.*--device cpu, gloo"):
        mesh.placement("nccl", "auto")


def test_asking_for_cuda_on_a_machine_without_cuda_is_refused_with_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"--device cuda needs CUDA.*--device cpu"):
        mesh.placement(None, "cuda")


def test_a_gpu_for_every_local_rank_means_cuda_and_nccl(one_gpu: pytest.MonkeyPatch) -> None:
    one_gpu.setenv("LOCAL_WORLD_SIZE", "1")
    assert mesh.placement(None, "auto") == (torch.device("cuda", 0), "nccl")


def test_more_local_ranks_than_gpus_run_on_the_cpu_and_say_why(
    one_gpu: pytest.MonkeyPatch,
) -> None:
    one_gpu.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.warns(UserWarning, match=r"4 ranks on this host but 1 CUDA device.*CPU with gloo"):
        assert mesh.placement(None, "auto") == (CPU, "gloo")


def test_the_warning_names_the_flag_that_shares_the_gpus(one_gpu: pytest.MonkeyPatch) -> None:
    one_gpu.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.warns(UserWarning, match=r"--device cuda shares the GPUs"):
        mesh.placement(None, "auto")


def test_ranks_asked_onto_cuda_share_the_gpus_over_gloo(one_gpu: pytest.MonkeyPatch) -> None:
    one_gpu.setenv("LOCAL_WORLD_SIZE", "2")
    one_gpu.setenv("LOCAL_RANK", "1")
    assert mesh.placement(None, "cuda") == (torch.device("cuda", 0), "gloo")


def test_the_deepspeed_launchers_local_size_counts_too(one_gpu: pytest.MonkeyPatch) -> None:
    one_gpu.setenv("LOCAL_SIZE", "2")
    with pytest.warns(UserWarning, match="2 ranks on this host"):
        assert mesh.placement(None, "auto") == (CPU, "gloo")


def test_a_local_rank_beyond_the_gpus_counts_without_a_launcher_size(
    one_gpu: pytest.MonkeyPatch,
) -> None:
    one_gpu.setenv("LOCAL_RANK", "1")
    assert mesh.placement(None, "auto") == (CPU, "gloo")  # silently: local rank 0 warns


def test_asking_for_nccl_without_a_gpu_per_rank_is_refused_with_the_fix(
    one_gpu: pytest.MonkeyPatch,
) -> None:
    one_gpu.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"one rank per GPU \(1 per host\), or let ranks share"):
        mesh.placement("nccl", "cuda")


def test_asking_for_gloo_keeps_ranks_on_the_cpu(one_gpu: pytest.MonkeyPatch) -> None:
    assert mesh.placement("gloo", "auto") == (CPU, "gloo")


def test_asking_for_the_cpu_keeps_ranks_there_even_with_a_gpu_each(
    one_gpu: pytest.MonkeyPatch,
) -> None:
    one_gpu.setenv("LOCAL_WORLD_SIZE", "1")
    assert mesh.placement(None, "cpu") == (CPU, "gloo")


def test_an_unknown_device_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown device 'tpu': choose one of auto, cuda, cpu"):
        mesh.placement(None, "tpu")


def test_only_cuda_over_gloo_stages_through_host_memory() -> None:
    def of(device: str, backend: str | None) -> mesh.Mesh:
        return mesh.Mesh(pp=1, dp=1, rank=0, pp_rank=0, dp_rank=0, device=torch.device(device),
                         backend=backend)  # fmt: skip

    assert of("cuda", "gloo").staged
    assert not of("cuda", "nccl").staged
    assert not of("cpu", "gloo").staged
