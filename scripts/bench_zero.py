"""Bytes each rank holds per parameter and step time under --zero 0..3 (ZeRO-3 also with
--zero-reshard micro-batch), PP 2 × DP 2, bf16, AdamW (per tensor: ZeRO-3's shards cannot run
the fused kernel), after a few steps.

python scripts/bench_zero.py --model gpt-small
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.dist.harness import run_ranks  # noqa: E402


def _local_bytes(tensor: Any) -> int:
    from torch.distributed.tensor import DTensor

    part = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return int(part.numel() * part.element_size())


def _held(engine: Any) -> dict[str, int]:
    """Bytes of the tensors this rank holds between steps: weights, fp32 gradients, fp32
    masters (beside low-precision weights), optimizer moments."""
    import torch

    params = list(engine.module.parameters())
    optimizer = engine.optimizer
    moments = sum(
        _local_bytes(t)
        for s in optimizer.state.values()
        for t in s.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    if engine.sharded is None:
        return {
            "weights": sum(_local_bytes(p) for p in params),
            "gradients": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
            "masters": 0,
            "moments": moments,
        }
    flats = engine.sharded.flats
    grads = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for f in flats
        for t in (f.grads, f.shard_grad)
        if t is not None
    }
    return {
        "weights": sum(_local_bytes(f.weights) for f in flats),
        "gradients": sum(grads.values()),
        "masters": sum(_local_bytes(f.master) for f in flats if f.dtype != torch.float32),
        "moments": moments,
    }


def _worker(
    rank: int, world: int, model: str, zero: int, reshard: str, steps: int
) -> dict[str, Any]:
    import torch

    from engine.comm.mesh import init_mesh
    from engine.config import EngineOptions, OptimizerSpec
    from engine.runtime.engine import PipelineEngine
    from models import layer_specs
    from partitioners import partition_model

    specs = layer_specs(model)
    engine = PipelineEngine(
        specs,
        init_mesh(2, 2, timeout_s=300),
        partition=partition_model(specs, method="balanced", num_stages=2),
        micro_batches=4,
        optimizer=OptimizerSpec(lr=1e-3, impl="per_tensor"),
        options=EngineOptions(zero=zero, zero_reshard=reshard, precision="bf16"),
        timeout_s=300,
    )
    tokens = torch.randint(0, 256, (8, 65), generator=torch.Generator().manual_seed(rank // 2))
    times = [engine.train_step(tokens[:, :-1], tokens[:, 1:]).step_s for _ in range(steps)]
    numel = sum(p.numel() for p in engine.module.parameters())
    held = _held(engine)
    engine.close()
    return {"bytes": {k: v / numel for k, v in held.items()}, "step_s": times[1:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    print("| ZeRO | weights | gradients | masters | moments | total B/param | step s (median) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    modes = [(0, "step"), (1, "step"), (2, "step"), (3, "step"), (3, "micro-batch")]
    for zero, reshard in modes:
        ranks = run_ranks(_worker, 4, args.model, zero, reshard, args.steps, timeout_s=1200)
        b = ranks[0]["bytes"]
        step = statistics.median(t for r in ranks for t in r["step_s"])
        cells = " | ".join(f"{b[k]:.2f}" for k in ("weights", "gradients", "masters", "moments"))
        label = f"{zero}, resharded per micro-batch" if reshard == "micro-batch" else str(zero)
        print(f"| {label} | {cells} | {sum(b.values()):.2f} | {step:.3f} |")


if __name__ == "__main__":
    main()
