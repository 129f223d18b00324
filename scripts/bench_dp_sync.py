"""Every-step data parallelism against local SGD, DiLoCo and the parameter server (--dp-sync),
pp 2 × dp 2 on the CPU: loss against tokens and wall time, the bytes each rank sends between
the replicas per step, with and without a simulated slow link between the two replicas.

The slow link is a sleep before each exchange between the replicas of a stage (every
all-reduce over the dp group: gradients, the loss, a meeting's weights; every send over a
parameter server's pair groups: a push, a reply with weights), in the thread that sends:
`--latency` seconds plus the bytes over `--bandwidth` bytes/s. Training loss is the global
batch's (the mean of the replicas' own losses); the held-out loss is measured after the last
step on each replica's weights (the same on both after a meeting, or with K = 0) and averaged.

python scripts/bench_dp_sync.py --model gpt-tiny --steps 200 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.dist.harness import run_ranks  # noqa: E402

MODES = [
    ("every-step", 1),
    ("local-sgd", 10),
    ("local-sgd", 50),
    ("diloco", 10),
    ("diloco", 50),
    ("parameter-server", 0),
    ("parameter-server", 1),
    ("parameter-server", 4),
]
"""(--dp-sync, H for local-sgd and diloco or K for parameter-server)."""
EVAL_BATCHES = 4
WINDOW = 10
"""Steps the training loss is averaged over at each mark."""


class _SlowDpLink:
    """Counts (and, with a latency or a bandwidth, delays) every all-reduce and send over
    `groups` (the dp group, a parameter server's pair groups), set for each run."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.groups: list[Any] = []
        self.latency = self.bandwidth = 0.0
        self.sent = 0
        self._lock = threading.Lock()
        dist.all_reduce = self._slowed(dist.all_reduce)  # type: ignore[assignment]
        dist.send = self._slowed(dist.send)  # type: ignore[assignment]

    def _slowed(self, real: Any) -> Any:
        def call(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group", args[1] if len(args) > 1 else None)
            if any(group is g for g in self.groups):
                size = tensor.numel() * tensor.element_size()
                with self._lock:
                    self.sent += size
                if self.latency or self.bandwidth:
                    time.sleep(self.latency + (size / self.bandwidth if self.bandwidth else 0))
            return real(tensor, *args, **kwargs)

        return call


def _sync(mode: str, every: int) -> Any:
    from engine.config import ReplicaSync

    if mode == "parameter-server":
        return ReplicaSync(dp_sync=mode, max_staleness=every)
    return ReplicaSync(dp_sync=mode, sync_every=every) if mode != "every-step" else None


def _worker(
    rank: int, world: int, args: dict[str, Any], runs: list[tuple[str, int, str]]
) -> list[dict[str, Any]]:
    """Every run in one launch (starting four ranks costs minutes on a loaded machine)."""
    from engine.comm.mesh import init_mesh

    mesh = init_mesh(2, 2, timeout_s=600)
    link = _SlowDpLink()
    results = []
    for mode, every, speed in runs:
        slow = speed == "slow"
        link.latency, link.bandwidth = args["latency"] * slow, args["bandwidth"] * slow
        results.append(_one_run(mesh, args, _sync(mode, every), link))
        if rank == 0:
            mine = results[-1]
            tail = statistics.mean(mine["losses"][-WINDOW:])
            print(
                f"  done: {mode} {every} {speed}: {mine['ends'][-1]:.0f}s, replica 0's loss "
                f"{tail:.3f} (last {WINDOW}), held-out {mine['eval']:.3f}",
                flush=True,
            )
    return results


def _one_run(mesh: Any, args: dict[str, Any], sync: Any, link: _SlowDpLink) -> dict[str, Any]:
    from engine.config import OptimizerSpec
    from engine.runtime.engine import PipelineEngine
    from engine.training.batches import BatchLoader
    from engine.training.data import default_corpus, load_tokens
    from models import layer_specs
    from partitioners import partition_model

    specs = layer_specs(args["model"])
    engine = PipelineEngine(
        specs,
        mesh,
        partition=partition_model(specs, method="balanced", num_stages=2),
        micro_batches=2,
        optimizer=OptimizerSpec(lr=args["lr"], weight_decay=0.1),
        timeout_s=600,
        replica_sync=sync,
    )
    loader = BatchLoader(
        load_tokens(default_corpus().bin_path),
        seq_len=args["seq_len"],
        global_batch=args["global_batch"],
        seed=0,
        dp_rank=mesh.dp_rank,
        dp_size=2,
    )
    server = engine.param_server
    link.groups = [mesh.dp_group, *(server.groups if server is not None else [])]
    link.sent = 0
    losses, ends = [], []
    start = time.perf_counter()
    for step in range(args["steps"]):
        losses.append(engine.train_step(*loader.batch_at(step)).loss)
        ends.append(time.perf_counter() - start)
    held_out = [engine.eval_step(*loader.batch_at(10**6 + i)) for i in range(EVAL_BATCHES)]
    engine.close()
    return {
        "staleness": max(server.staleness) if server is not None else 0,
        "dp": mesh.dp_rank,
        "losses": losses,
        "ends": ends,
        "eval": statistics.mean(held_out),
        "bytes_per_step": link.sent / args["steps"],
    }


def _summary(ranks: list[dict[str, Any]], args: dict[str, Any]) -> dict[str, Any]:
    """The global batch's loss per step (mean of the two replicas'), wall clock, bytes."""
    replicas = [next(r for r in ranks if r["dp"] == d) for d in (0, 1)]
    losses = [statistics.mean(pair) for pair in zip(*(r["losses"] for r in replicas), strict=True)]
    ends = [max(r["ends"][i] for r in ranks) for i in range(args["steps"])]
    tokens = args["global_batch"] * args["seq_len"]
    return {
        "losses": losses,
        "ends": ends,
        "tokens_per_step": tokens,
        "eval": statistics.mean(r["eval"] for r in replicas),
        "bytes_per_step": max(r["bytes_per_step"] for r in ranks),
        "wall_s": ends[-1],
        "staleness": max(r["staleness"] for r in ranks),
    }


def _row(mode: str, every: int, link: str, result: dict[str, Any], marks: list[int]) -> str:
    losses, ends = result["losses"], result["ends"]
    at = [statistics.mean(losses[max(0, m - WINDOW) : m]) for m in marks]
    curve = " / ".join(f"{loss:.3f} @{ends[m - 1]:.0f}s" for loss, m in zip(at, marks, strict=True))
    label = {"every-step": mode, "parameter-server": f"{mode} K={every}"}.get(
        mode, f"{mode} H={every}"
    )
    if mode == "parameter-server":
        label += f" (max lag {result['staleness']})"
    kib = result["bytes_per_step"] / 1024
    return (
        f"| {label} | {link} | {curve} | {result['eval']:.3f} | {result['wall_s']:.0f} | "
        f"{kib:,.0f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--latency", type=float, default=0.05, help="slow link: s per exchange")
    parser.add_argument("--bandwidth", type=float, default=50e6, help="slow link: bytes/s")
    parser.add_argument("--modes", default=",".join(f"{m}:{h}" for m, h in MODES))
    parser.add_argument("--links", default="fast,slow", help="fast, slow or both")
    parser.add_argument("--json", default=None, help="write every curve here")
    args = vars(parser.parse_args())
    modes = [(m, int(h)) for m, h in (item.split(":") for item in args["modes"].split(","))]
    marks = [args["steps"] * k // 4 for k in range(1, 5)]
    tokens = args["global_batch"] * args["seq_len"]
    print(f"training loss (mean of the {WINDOW} steps before) @ wall s at steps {marks}")
    print(f"({tokens} tokens per step)\n")
    print("| sync | dp link | loss @ wall time | held-out loss | wall s | KiB sent/step/rank |")
    print("| --- | --- | --- | --- | --- | --- |")
    runs = [(mode, every, link) for link in args["links"].split(",") for mode, every in modes]
    per_rank = run_ranks(_worker, 4, args, runs, timeout_s=4 * 3600)
    label = f"+{args['latency'] * 1e3:.0f} ms, {args['bandwidth'] / 1e6:.0f} MB/s"
    results = {}
    for i, (mode, every, link) in enumerate(runs):
        result = _summary([rank[i] for rank in per_rank], args)
        results[f"{mode}:{every}:{link}"] = result
        shown = label if link == "slow" else "local"
        print(_row(mode, every, shown, result, marks), flush=True)
    if args["json"]:
        Path(args["json"]).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
