"""The planner prices a tensor-parallel layer's all-reduces as the engine runs them: counted
against torch's `CommDebugMode` on the engine's own split layers, forward and backward apart."""

import pytest
import torch
from torch.distributed.tensor.debug import CommDebugMode

from engine.memory.fake_world import stage_grid
from engine.parallel.tensor_parallel import build_sharded_layers, sharded_loss_scope
from engine.plan import Hardware
from engine.plan.timing import stage_times, tp_all_reduces
from models import layer_specs
from partitioners.costs import backward_root

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")


def _collectives(
    model: str, index: int, sequence_parallel: bool = False
) -> tuple[dict[str, int], dict[str, int]]:
    """(forward, backward) collectives of one micro-batch of the layer split over tp 2."""
    specs = layer_specs(model)
    last = index == len(specs) - 1
    with stage_grid(1, 2) as grid:
        assert grid.tp_mesh is not None
        stack = build_sharded_layers(
            specs,
            range(index, index + 1),
            seed=0,
            device="cpu",
            tp_mesh=grid.tp_mesh,
            sequence_parallel=sequence_parallel,
        )
        x = specs[index].example_input(2, 16, device="cpu")
        if x.is_floating_point():
            x = torch.randn(x[:, : 16 // (2 if sequence_parallel else 1)].shape)
            x.requires_grad_()
        with sharded_loss_scope(last):
            with CommDebugMode() as forward:
                root = backward_root(stack(x), last)
            with CommDebugMode() as backward:
                root.backward()
    return _named(forward), _named(backward)


def _named(mode: CommDebugMode) -> dict[str, int]:
    return {str(op).removeprefix("c10d_functional."): n for op, n in mode.get_comm_counts().items()}


def _counted(model: str, index: int) -> tuple[int, int]:
    """(forward, backward) all-reduces of one micro-batch of the layer split over tp 2."""
    forward, backward = _collectives(model, index)
    return forward.get("all_reduce", 0), backward.get("all_reduce", 0)


@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny"])
@pytest.mark.parametrize("where", ["embedding", "block", "head"])
def test_each_layers_all_reduces_are_the_ones_dtensor_runs(model: str, where: str) -> None:
    specs = layer_specs(model)
    index = {"embedding": 0, "block": 1, "head": len(specs) - 1}[where]
    priced = tp_all_reduces(specs[index])
    assert _counted(model, index) == (priced.forward + priced.loss, priced.backward)


def test_a_blocks_column_wise_linears_sum_their_gradients_before_one_all_reduce() -> None:
    """q, k and v read one input, as gate and up do: one all-reduce each, not one per Linear."""
    assert tp_all_reduces(layer_specs("llama-tiny")[1]) == (2, 2, 0)
    assert tp_all_reduces(layer_specs("gpt-tiny")[1]) == (2, 2, 0)


def test_a_stages_backward_pays_its_column_wise_all_reduces() -> None:
    specs = layer_specs("llama-tiny")
    latency = 1e-3
    hardware = Hardware(latency=latency, link_bandwidth=1e30)
    times = stage_times(
        [0.0] * len(specs),
        specs,
        range(1, 2),
        hardware=hardware,
        activation_bytes=1024,
        tp=2,
        recompute=False,
        input_shares=[0.5] * len(specs),
    )
    one = 2 * latency  # a ring all-reduce over 2 ranks: 2 steps
    assert times.forward == pytest.approx(2 * one)
    assert times.backward == pytest.approx(2 * one) == times.input_grad
    assert times.tp_comm == pytest.approx(4 * one)


def test_an_actions_collectives_are_told_apart_from_its_compute() -> None:
    """On a host's shared cores only the compute shares them; the all-reduces, and a
    recomputed forward's, and ZeRO-3's turns, take their own time (`StageTimes.waits`)."""
    specs = layer_specs("llama-tiny")
    one = 2 * 1e-3  # a ring all-reduce over 2 ranks at 1 ms latency
    times = stage_times(
        [0.25] * len(specs),
        specs,
        range(1, 2),
        hardware=Hardware(latency=1e-3, link_bandwidth=1e30),
        activation_bytes=1024,
        tp=2,
        recompute=True,
        input_shares=[0.5] * len(specs),
        zero_turn=(0.01, 0.03),
    )
    assert times.waits == pytest.approx((2 * one + 0.01, 4 * one + 0.03, 4 * one + 0.03, 0.0))
    assert times.forward - times.waits[0] == pytest.approx(0.25)
    assert times.backward - times.waits[1] == pytest.approx(2 * 0.25 + 0.25)  # B and the F again


def test_a_vocabulary_split_heads_loss_reduces_scalars_at_the_latency() -> None:
    specs = layer_specs("gpt-tiny")
    head = len(specs) - 1
    hardware = Hardware(latency=1e-3, link_bandwidth=1e3)  # a hidden state: seconds a byte
    times = stage_times(
        [0.0] * len(specs),
        specs,
        range(head, head + 1),
        hardware=hardware,
        activation_bytes=1000,
        tp=2,
        recompute=False,
        input_shares=[0.5] * len(specs),
    )
    assert times.forward == pytest.approx(3 * 2e-3)  # no bytes: the loss's scalars
    assert times.backward == pytest.approx(2 * (1000 / 2 / 1e3 + 1e-3))  # its input's gradient


def test_under_sequence_parallelism_a_blocks_backward_reduce_scatters_once_per_shared_input() -> (
    None
):
    """The gathered input reaches q, k and v as one DTensor: their summed gradient is
    reduce-scattered back to the sequence shard once, not all-reduced once per Linear."""
    forward, backward = _collectives("llama-tiny", 1, sequence_parallel=True)
    assert forward == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}
    assert backward == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}
