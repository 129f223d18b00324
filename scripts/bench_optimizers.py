"""Optimizer step time on the CPU: torch AdamW (per-tensor, foreach, fused) vs DeepSpeed's CPU
Adam, on the parameter shapes of a real model, measured side by side in one run.

    python scripts/bench_optimizers.py --model gpt-bench --threads 1 --steps 20
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from models import build_layers, layer_specs

Factory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


def _candidates() -> dict[str, Factory]:
    kwargs = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}
    out: dict[str, Factory] = {
        "torch AdamW (per tensor)": lambda p: torch.optim.AdamW(p, foreach=False, **kwargs),
        "torch AdamW (foreach)": lambda p: torch.optim.AdamW(p, foreach=True, **kwargs),
        "torch AdamW (fused)": lambda p: torch.optim.AdamW(p, fused=True, **kwargs),
    }
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        out["DeepSpeedCPUAdam"] = lambda p: DeepSpeedCPUAdam(p, adamw_mode=True, **kwargs)
    except ImportError:
        pass
    return out


def _time(factory: Factory, params: list[torch.nn.Parameter], steps: int) -> float:
    optimizer = factory(params)
    for p in params:
        p.grad = torch.randn_like(p)
    walls = []
    for _ in range(steps + 2):
        start = time.perf_counter()
        optimizer.step()
        walls.append(time.perf_counter() - start)
    return statistics.median(walls[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-bench")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    params = list(build_layers(layer_specs(args.model), seed=0).parameters())
    count = sum(p.numel() for p in params)
    print(f"{args.model}: {count / 1e6:.1f}M parameters, {args.threads} thread(s)\n")
    print("| optimizer | ms/step (median) | relative to per-tensor AdamW |")
    print("| --- | --- | --- |")
    base = None
    for name, factory in _candidates().items():
        try:
            seconds = _time(factory, params, args.steps)
        except (RuntimeError, ImportError) as error:
            print(f"| {name} | unavailable: {str(error).splitlines()[0][:60]} | |")
            continue
        base = base or seconds
        print(f"| {name} | {seconds * 1e3:.1f} | {base / seconds:.2f}× |")


if __name__ == "__main__":
    main()
