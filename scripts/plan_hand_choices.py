"""The planner's choice against the obvious hand choices on the same budget, on paper (issue
#25, item 4: the predicted speed-up for llama3-70b on 64 H100s).

A hand choice is a mesh (pp × dp × tp) run as people write it by hand: 1F1B, the balanced
split, no ZeRO, the largest micro-batch that fits without recompute, else with every stage
recomputed. Each is predicted as the search predicts its candidates (`engine.plan.predict`)
and its peak replayed exactly (`estimate_memory`); the planner's first plan is the search's.

    PYTHONPATH=$PWD python scripts/plan_hand_choices.py --model llama3-70b --devices 64 \\
        --device-memory 80GB --global-batch 1024 --seq-len 4096 \\
        --meshes 8x1x8,4x2x8,16x1x4,8x2x4
"""

from __future__ import annotations

import argparse

from engine.config import ParallelConfig, parse_size
from engine.plan import Hardware, PlanRequest, Prediction, predict, search
from engine.plan.candidates import Candidate
from engine.plan.exact import replayed


def _replayed_peak(request: PlanRequest, plan: Prediction) -> int:
    return max(replayed(request, [plan])[0].rank_peaks)


def _hand_choice(request: PlanRequest, mesh: ParallelConfig) -> tuple[Prediction, int] | None:
    """The mesh's hand choice and its replayed peak; None where nothing fits."""
    per_replica = request.global_batch // mesh.dp
    stages = tuple(range(mesh.pp))
    for recompute in ((), stages):
        for mbs in sorted(request.micro_batch_sizes, reverse=True):
            if per_replica % mbs:
                continue
            layout = Candidate(
                mesh=mesh,
                schedule="1f1b",
                stages_per_rank=1,
                micro_batches=per_replica // mbs,
                micro_batch_size=mbs,
                recompute=recompute,
            )
            plan = predict(request, layout)
            peak = _replayed_peak(request, plan)  # the exact peak, not the screen's
            if peak <= request.device_memory:
                return plan, peak
    return None


def _mesh(text: str) -> ParallelConfig:
    pp, dp, tp = (int(n) for n in text.split("x"))
    return ParallelConfig(pp=pp, dp=dp, tp=tp)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3-70b")
    parser.add_argument("--devices", type=int, default=64)
    parser.add_argument("--device-memory", default="80GB")
    parser.add_argument("--global-batch", type=int, default=1024)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--meshes", default="8x1x8,4x2x8,16x1x4,8x2x4", help="pp x dp x tp, ...")
    args = parser.parse_args()
    request = PlanRequest(
        model=args.model,
        devices=args.devices,
        device_memory=parse_size(args.device_memory),
        global_batch=args.global_batch,
        seq_len=args.seq_len,
        hardware=Hardware(),
        top=1,
    )
    best = search(request).plans[0]
    print(f"planner: {best.candidate.describe():60s} {best.step_time:8.1f} s")
    for text in args.meshes.split(","):
        mesh = _mesh(text)
        if mesh.pp * mesh.dp * mesh.tp != request.devices:
            raise SystemExit(f"mesh {text} is not {request.devices} devices")
        found = _hand_choice(request, mesh)
        if found is None:
            print(f"hand:    {text:60s} nothing fits, even with every stage recomputed")
            continue
        plan, peak = found
        speedup = plan.step_time / best.step_time
        print(
            f"hand:    {plan.candidate.describe():60s} {plan.step_time:8.1f} s  "
            f"{peak / 2**30:5.1f} GiB  planner {speedup:.2f}x"
        )


if __name__ == "__main__":
    main()
