"""The planner's cost model against measured step times on this machine (issue #25, item 4).

Each layer is timed here (`meshpipe plan --profile`'s costs); each layout is predicted by the
planner (`engine.plan.predict`), written as a plan file and run by `meshpipe train --plan` for
a few steps (the first, warm-up step left out of its tokens/s); the table prints predicted and
measured seconds per step and the error. Then the planner's own choice for the same devices
against the hand choice (balanced split, 1F1B, no recompute, the largest micro-batch that fits).

    PYTHONPATH=$PWD python scripts/plan_check.py --model gpt-bench --devices 2

A GPU run: add `--device cuda --device-memory 80GB` on a machine with the GPUs (the layer
times are then measured on the CPU only if --profile; give --device-flops instead).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from engine.config import ParallelConfig, parse_size
from engine.plan import Hardware, PlanRequest, measured_forward, search, write_plan
from engine.plan.candidates import Candidate
from engine.plan.request import Prediction
from engine.plan.search import predict
from models import layer_specs

_TOKENS = re.compile(r"\(([\d,.]+) tokens/s")


def _layouts(devices: int, global_batch: int) -> list[Candidate]:
    """Layouts of `devices` ranks: pp, dp and tp of 1 or 2, several schedules and recompute,
    micro-batches of 2 sequences."""

    def c(
        pp: int, dp: int, tp: int, schedule: str = "1f1b", recompute: tuple[int, ...] = ()
    ) -> Candidate:
        return Candidate(
            mesh=ParallelConfig(pp=pp, dp=dp, tp=tp),
            schedule=schedule,
            stages_per_rank=1,
            micro_batches=global_batch // (2 * dp),
            micro_batch_size=2,
            recompute=recompute,
        )

    if devices == 1:
        return [c(1, 1, 1), c(1, 1, 1, recompute=(0,))]
    return [
        c(2, 1, 1),
        c(2, 1, 1, "gpipe"),
        c(2, 1, 1, "zb_h1"),
        c(2, 1, 1, recompute=(0, 1)),
        c(2, 1, 1, recompute=(0,)),
        c(1, 2, 1),
        c(1, 1, 2),
    ]


def _measure(request: PlanRequest, plan: Prediction, steps: int, folder: Path) -> float:
    """Seconds per step of `meshpipe train --plan` (steady steps)."""
    path = folder / "plan.json"
    write_plan(path, request, plan)
    ranks = plan.candidate.mesh.pp * plan.candidate.mesh.dp * plan.candidate.mesh.tp
    command = [sys.executable, "-m", "engine.cli", "train", "--plan", str(path)]
    command += ["--steps", str(steps), "--no-progress", "--device", request.device]
    if request.device == "cpu":
        command += ["--threads", "1"]  # as the layers were timed
    assert ranks == request.devices
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    found = _TOKENS.search(out)
    assert found, out
    tokens = float(found.group(1).replace(",", ""))
    return request.global_batch * request.seq_len / tokens


def _hand_choice(request: PlanRequest) -> Prediction:
    """Every device a pipeline stage, balanced, 1F1B, no recompute, the largest micro-batch
    that fits."""
    for mbs in sorted(request.micro_batch_sizes, reverse=True):
        m = request.global_batch // mbs
        if request.global_batch % mbs or m < 1:
            continue
        layout = Candidate(
            mesh=ParallelConfig(pp=request.devices, dp=1, tp=1),
            schedule="1f1b",
            stages_per_rank=1,
            micro_batches=m,
            micro_batch_size=mbs,
        )
        plan = predict(request, layout)
        if max(plan.rank_peaks) <= request.device_memory:
            return plan
    raise ValueError("no micro-batch size fits the hand choice")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-bench")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--device-memory", default="4GB")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--link-bandwidth", type=float, default=2e9, help="gloo on one host")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)  # each rank trains on one thread (--threads 1)
    specs = layer_specs(args.model)
    sizes = (1, 2, 4, 8)
    request = PlanRequest(
        model=args.model,
        devices=args.devices,
        device_memory=parse_size(args.device_memory),
        global_batch=args.global_batch,
        seq_len=args.seq_len,
        precision="fp32",
        device=args.device,
        hardware=Hardware(link_bandwidth=args.link_bandwidth, latency=1e-4, gpus_per_node=8),
        measured={b: measured_forward(specs, b, args.seq_len) for b in sizes},
        micro_batch_sizes=sizes,
    )
    print(f"{'layout':<44} {'predicted':>10} {'measured':>10} {'error':>7}")
    with tempfile.TemporaryDirectory() as folder:
        rows = [(c.describe(), predict(request, c)) for c in _layouts(args.devices, 16)]
        chosen = search(request).plans[0]
        rows.append(("planner: " + chosen.candidate.describe(), chosen))
        hand = _hand_choice(request)
        rows.append(("hand: " + hand.candidate.describe(), hand))
        for name, plan in rows:
            measured = _measure(request, plan, args.steps, Path(folder))
            error = plan.step_time / measured - 1
            print(f"{name:<44} {plan.step_time:>9.4f}s {measured:>9.4f}s {error:>+7.1%}")


if __name__ == "__main__":
    main()
