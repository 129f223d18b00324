"""Optimizer-state bytes per rank with and without ZeRO-1, PP 2 × DP 2, after one step.

python scripts/bench_zero.py --model gpt-small
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.dist.harness import run_ranks  # noqa: E402


def _worker(rank: int, world: int, model: str, zero: int) -> tuple[int, int]:
    import torch

    from engine.comm.mesh import init_mesh
    from engine.config import EngineOptions, OptimizerSpec
    from engine.runtime.engine import PipelineEngine
    from models import layer_specs
    from partitioners import partition_model

    specs = layer_specs(model)
    engine = PipelineEngine(
        specs,
        init_mesh(2, 2, timeout_s=120),
        partition=partition_model(specs, method="balanced", num_stages=2),
        micro_batches=2,
        optimizer=OptimizerSpec(lr=1e-3),
        options=EngineOptions(zero=zero),
    )
    tokens = torch.randint(0, 256, (4, 65))
    engine.train_step(tokens[:, :-1], tokens[:, 1:])
    local = getattr(engine.optimizer, "optim", engine.optimizer)
    assert local is not None
    state = sum(
        t.numel() * t.element_size()
        for s in local.state.values()
        for t in s.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    return state, sum(p.numel() * p.element_size() for p in engine.module.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-small")
    args = parser.parse_args()
    print("| ZeRO | optimizer state per rank (MiB) | parameters per rank (MiB) |")
    print("| --- | --- | --- |")
    for zero in (0, 1):
        ranks = run_ranks(_worker, 4, args.model, zero)
        state = ", ".join(f"{s / 2**20:.2f}" for s, _ in ranks)
        params = ", ".join(f"{p / 2**20:.2f}" for _, p in ranks)
        print(f"| {zero} | {state} | {params} |")


if __name__ == "__main__":
    main()
