"""Per-layer costs measured from layer specs, and partitioning a model end to end."""

from __future__ import annotations

import pytest
import torch

from engine.cli.main import main
from models import layer_specs, lm_loss
from partitioners import Partition, layer_costs, partition_model
from partitioners.costs import (
    activation_costs,
    backward_root,
    flop_costs,
    measured_costs,
    parameter_costs,
    synchronized,
)

torch.set_num_threads(1)
SPECS = layer_specs("gpt-tiny")


def test_parameter_costs_count_each_layer() -> None:
    d, v, ctx = 64, 256, 128
    block = 12 * d * d + 13 * d
    assert parameter_costs(SPECS) == (v * d + ctx * d, block, block, block, block, 2 * d, v * d)


def test_block_flops_are_two_per_weight_per_token_plus_causal_attention() -> None:
    b, t, d = 2, 64, 64
    assert (
        flop_costs(SPECS, batch_size=b, seq_len=t)[1] == 2 * b * t * 12 * d * d + 2 * b * t * t * d
    )


def test_activation_bytes_scale_with_the_micro_batch() -> None:
    one = activation_costs(SPECS, batch_size=1, seq_len=32)
    two = activation_costs(SPECS, batch_size=2, seq_len=32)
    assert all(b == 2 * a for a, b in zip(one[1:], two[1:], strict=True))  # not positions
    assert one[1] > one[5] > 0


def test_activation_bytes_of_a_70b_block_are_traced_without_memory() -> None:
    block = layer_specs("llama-70b")[1]
    (saved,) = activation_costs([block], batch_size=1, seq_len=4096, dtype=torch.bfloat16)
    assert (
        saved > 34 * 4096 * 8192
    )  # Korthikanti et al.: about 34·s·h bytes and more for GQA/SwiGLU


def test_measured_costs_are_positive_seconds() -> None:
    costs = measured_costs(SPECS, batch_size=1, seq_len=16, repeats=1)
    assert len(costs) == len(SPECS) and all(c > 0 for c in costs)


def test_the_last_layer_is_timed_through_the_loss_as_training_runs_it() -> None:
    logits = torch.randn(2, 8, 256)
    targets = torch.zeros(2, 8, dtype=torch.long)
    assert torch.equal(backward_root(logits, last=True), lm_loss(logits, targets))


def test_any_other_layer_is_timed_through_the_sum_of_its_output() -> None:
    hidden = torch.randn(2, 8, 64)
    assert torch.equal(backward_root(hidden, last=False), hidden.sum())


def test_unknown_cost_model_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown cost model 'bytes'.*flops"):
        layer_costs(SPECS, "bytes")


def test_balanced_flops_partition_of_llama_7b_keeps_blocks_even() -> None:
    partition = partition_model(
        layer_specs("llama-7b"), method="balanced", num_stages=4, seq_len=4096
    )
    assert isinstance(partition, Partition)
    assert partition.boundaries == (0, 9, 17, 25, 35)


def test_type_partition_balances_blocks_like_deepspeed() -> None:
    partition = partition_model(SPECS, method="type:GPTBlock", num_stages=2)
    assert partition.boundaries == (0, 3, 7)


def test_too_many_stages_for_the_layers_is_rejected() -> None:
    with pytest.raises(ValueError, match="cannot split 7 layers into 8 stages"):
        partition_model(SPECS, method="uniform", num_stages=8)


def test_plan_cli_prints_a_row_per_stage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "gpt-tiny", "--pp", "3", "--partition", "uniform"]) == 0
    out = capsys.readouterr().out
    assert "[0, 3)" in out and "[3, 5)" in out and "[5, 7)" in out


def test_plan_cli_splits_by_memory_within_the_device_budget(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["plan", "--model", "llama-1b", "--pp", "4", "--partition", "memory"]
    argv += ["--device-memory", "13GiB", "--micro-batches", "8", "--micro-batch-size", "2"]
    assert main([*argv, "--seq-len", "2048"]) == 0
    out = capsys.readouterr().out
    assert "(memory, cost share by flops)" in out and "[0, 6)" in out


def test_a_cpu_timing_runs_the_work_alone() -> None:
    """Only a device that queues kernels (CUDA) is waited for: on the CPU the work returns
    when it is done, and the timed call is the work itself."""
    work = list
    assert synchronized(work, "cpu") is work
