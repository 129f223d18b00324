"""meshpipe against the pipeline engines users would otherwise pick, side by side in one run.

Every system trains the same GPT decoder from the same initial weights (saved once, loaded by
each) on the same batches with the same AdamW, each in its own processes with one intra-op
thread per rank, and reports the median step time, tokens/s, peak RSS per rank, the bubble
where it can be measured, and whether its losses match the single-process reference.
Installs nothing: systems that are not installed are listed as skipped.

    python scripts/bench_peers.py --model bench --steps 10
    python scripts/bench_peers.py --model bench-large --steps 10
    python scripts/bench_peers.py --systems meshpipe-zb_v,torch-ScheduleZBVZeroBubble --census

`--census` also counts the aten ops of one more step on every rank of meshpipe's and torch's
workers and prints where the counts differ: whether two engines run the same kernels is a
fact the wall clock of a noisy machine cannot settle.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.comm.launch import free_port  # noqa: E402
from engine.training.batches import BatchLoader  # noqa: E402
from engine.training.data import default_corpus, load_tokens  # noqa: E402
from models import GPTConfig, build_layers, lm_loss  # noqa: E402
from models.gpt import gpt_layers  # noqa: E402

MODELS = {
    "bench": GPTConfig(
        vocab_size=256, n_layer=8, n_head=8, d_model=256, max_seq_len=128, tie_embeddings=False
    ),
    "bench-large": GPTConfig(
        vocab_size=256, n_layer=12, n_head=8, d_model=384, max_seq_len=128, tie_embeddings=False
    ),
    # Seconds per system: what the test suite runs to keep the harness itself working.
    "tiny": GPTConfig(
        vocab_size=256, n_layer=4, n_head=2, d_model=32, max_seq_len=128, tie_embeddings=False
    ),
}
GLOBAL_BATCH, MICRO_BATCHES, SEQ_LEN, LR = 32, 8, 128, 1e-3
MESHPIPE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_h2", "zb_drain",
                      "zb_drain+guard", "zb_v", "v_half", "v_min", "dualpipe_v")  # fmt: skip
TWO_STAGES_PER_RANK = ("interleaved_1f1b", "zb_v", "v_half", "v_min", "dualpipe_v")
TORCH_SCHEDULES = ("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
                   "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble",
                   "ScheduleDualPipeV")  # fmt: skip
V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")


# --- shared inputs ---------------------------------------------------------------------------


def _prepare(work: Path, model: str, steps: int) -> None:
    """Weights, batches and stage boundaries, written once, read by every system."""
    specs = gpt_layers(MODELS[model])
    boundaries = {stages: _partition(model, stages) for stages in (2, 4)}
    (work / "boundaries.json").write_text(json.dumps(boundaries))
    state = build_layers(specs, seed=0).state_dict()
    save_file({k: v.contiguous() for k, v in state.items()}, str(work / "weights.safetensors"))
    loader = BatchLoader(
        load_tokens(default_corpus().bin_path), seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH, seed=0
    )
    torch.save([loader.batch_at(step) for step in range(steps)], work / "batches.pt")


def _census(step: Any) -> dict[str, list[int]]:
    """aten op → [calls, bytes of its new outputs] in one call of `step` (`--census`): a view
    or an in-place op's result (an alias of an input) allocates nothing, so it counts 0."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts: dict[str, list[int]] = {}

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            out = func(*args, **(kwargs or {}))
            row = counts.setdefault(str(func), [0, 0])
            row[0] += 1
            outs = out if isinstance(out, (tuple, list)) else (out,)
            for tensor, schema in zip(outs, func._schema.returns, strict=False):
                if isinstance(tensor, torch.Tensor) and schema.alias_info is None:
                    row[1] += tensor.numel() * tensor.element_size()
            return out

    with Counting():
        step()
    return counts


def _census_step(step: Any) -> dict[str, list[int]] | None:
    """`_census` of one more step when the driver asked for it (after the timed ones)."""
    return _census(step) if os.environ.get("BENCH_CENSUS") else None


def _load_into(module: torch.nn.Module, work: Path, rename: Any = None) -> None:
    """Copy the saved weights into `module` (names mapped by `rename` to `layers.{i}.…`)."""
    with safe_open(str(work / "weights.safetensors"), framework="pt") as tensors, torch.no_grad():
        for name, param in module.named_parameters():
            param.copy_(tensors.get_tensor(rename(name) if rename else name))


def _partition(model: str, stages: int) -> list[int]:
    """DeepSpeed's `parameters` partition (its own function when installed), for everyone.

    Run once by the driver: importing DeepSpeed costs a process about 25 MiB of resident
    memory, which only DeepSpeed's own workers should carry.
    """
    counts = [spec.num_parameters() for spec in gpt_layers(MODELS[model])]
    try:
        from deepspeed.runtime.utils import partition_balanced

        return [int(b) for b in partition_balanced(weights=counts, num_parts=stages)]
    except ImportError:
        from partitioners import by_parameters

        return list(by_parameters(counts, stages).boundaries)


def _boundaries(work: Path, stages: int) -> list[int]:
    """The boundaries of `stages` stages, as the driver's `_partition` wrote them."""
    return [int(b) for b in json.loads((work / "boundaries.json").read_text())[str(stages)]]


def _report(work: Path, system: str, rank: int, walls: list[float], cpus: list[float],
            losses: list[float], bubbles: list[float] | None = None,
            census: dict[str, list[int]] | None = None) -> None:  # fmt: skip
    """A rank's medians over the measured steps: wall time, and the CPU time its process
    spent in every thread (compute, gloo's, Python's), which tells a rank's work from its
    waiting."""
    warm = int(os.environ.get("BENCH_WARMUP", "2"))
    result = {
        "step_s": statistics.median(walls[warm:]),
        "cpu_s": statistics.median(cpus[warm:]),
        "losses": losses,
        "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "bubble": statistics.median(bubbles[warm:]) if bubbles else None,
        "census": census,
    }
    (work / f"{system}.rank{rank}.json").write_text(json.dumps(result))


# --- workers: one per system, run inside that system's processes ------------------------------


def _meshpipe(work: Path, model: str, schedule: str) -> None:
    """meshpipe with the peers' semantics (no clipping, no non-finite guard, so steps follow
    each other without a barrier); `NAME+guard` keeps the guard and its per-step barrier."""
    from engine.comm.mesh import init_mesh
    from engine.config import EngineOptions, OptimizerSpec
    from engine.runtime.engine import PipelineEngine
    from partitioners import Partition

    mesh = init_mesh(2, 1, timeout_s=600)
    name, _, guard = schedule.partition("+")
    v = 2 if name in TWO_STAGES_PER_RANK else 1
    specs = gpt_layers(MODELS[model])
    engine = PipelineEngine(
        specs, mesh, partition=Partition(boundaries=tuple(_boundaries(work, 2 * v))),
        micro_batches=MICRO_BATCHES, schedule=name, stages_per_rank=v,
        optimizer=OptimizerSpec(lr=LR), timeout_s=600,
        options=EngineOptions(nonfinite_guard=guard == "guard"),
    )  # fmt: skip
    _load_into(engine.module, work, lambda n: n.split(".", 1)[1])
    walls, cpus, steps = [], [], []
    for x, y in torch.load(work / "batches.pt"):
        start, cpu = time.perf_counter(), time.process_time()
        steps.append(engine.train_step(x, y))
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
    losses = [s.loss for s in steps]
    bubbles = [s.bubble for s in steps]  # read after the run: they arrive a step late
    census = _census_step(lambda: engine.train_step(x, y))
    _report(work, f"meshpipe-{schedule}", mesh.rank, walls, cpus, losses, bubbles, census)
    torch.distributed.destroy_process_group()


def _torch_pipelining(work: Path, model: str, schedule: str) -> None:
    import torch.distributed as dist
    from torch.distributed import pipelining

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    v = 1 if schedule in ("ScheduleGPipe", "Schedule1F1B") else 2
    bounds = _boundaries(work, 2 * v)
    specs = gpt_layers(MODELS[model])
    stages, modules = [], []
    placed = (rank, 3 - rank) if schedule in V_SHAPED else (rank, rank + 2)
    for s in placed[:v]:
        module = build_layers(specs, range(bounds[s], bounds[s + 1]), seed=0)
        _load_into(module, work)
        modules.append(module)
        stages.append(pipelining.PipelineStage(module, s, 2 * v, torch.device("cpu")))
    cls = getattr(pipelining, schedule)
    runner = cls(stages[0] if v == 1 else stages, MICRO_BATCHES, loss_fn=lm_loss)
    params = [p for m in modules for p in m.parameters()]
    optimizer = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    walls, cpus, losses = [], [], []

    def step(x: torch.Tensor, y: torch.Tensor, mb_losses: list[torch.Tensor]) -> None:
        optimizer.zero_grad(set_to_none=True)
        _torch_step(runner, rank, x, y, mb_losses, schedule in V_SHAPED)
        optimizer.step()

    for x, y in torch.load(work / "batches.pt"):
        start, cpu = time.perf_counter(), time.process_time()
        mb_losses: list[torch.Tensor] = []
        step(x, y, mb_losses)
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
        losses.append(float(torch.stack(mb_losses).mean()) if mb_losses else float("nan"))
    census = _census_step(lambda: step(x, y, []))
    _report(work, f"torch-{schedule}", rank, walls, cpus, losses, census=census)
    dist.destroy_process_group()


def _torch_step(
    runner: Any, rank: int, x: Any, y: Any, losses: list[torch.Tensor], v_shaped: bool
) -> None:
    """Rank 0 holds stage 0 (feeds inputs); the rank with the last stage (rank 1, or rank 0
    under V-shaped placement) gives the targets and collects the losses."""
    if v_shaped and rank == 0:
        runner.step(x, target=y, losses=losses)
    elif v_shaped:
        runner.step()
    elif rank == 0:
        runner.step(x)
    else:
        runner.step(target=y, losses=losses)


def _deepspeed(work: Path, model: str) -> None:
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule

    from scripts.deepspeed_peer import MeshpipeLayer, micro_batch_iterator

    # With LOCAL_SIZE set (its launcher sets it) DeepSpeed maps a 66 MiB /dev/shm segment per
    # rank for inference all-reduces, which the PipelineEngine never uses, and never unlinks it.
    os.environ.pop("LOCAL_SIZE", None)
    deepspeed.init_distributed(dist_backend="gloo")
    specs = gpt_layers(MODELS[model])
    module = PipelineModule(
        layers=[LayerSpec(MeshpipeLayer, specs, i, 0) for i in range(len(specs))],
        num_stages=2, loss_fn=lm_loss, partition_method="parameters",
    )  # fmt: skip
    _load_into(module, work, lambda n: f"layers.{n.split('.')[0]}.{n.split('.', 2)[2]}")
    config = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // MICRO_BATCHES,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.95],
                                                  "weight_decay": 0.0, "torch_adam": True}},
        "steps_per_print": 10**9,
        "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 unless told otherwise
    }  # fmt: skip
    params = [p for p in module.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=module, config=config, model_parameters=params)
    batches = torch.load(work / "batches.pt")
    stream = micro_batch_iterator(batches, MICRO_BATCHES)
    walls, cpus, losses = [], [], []
    for _ in batches:
        start, cpu = time.perf_counter(), time.process_time()
        losses.append(float(engine.train_batch(stream)))
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
    _report(work, "deepspeed-PipelineEngine", engine.global_rank, walls, cpus, losses)
    # Left to interpreter exit, gloo's teardown with a peer already gone sometimes aborts
    # ("terminate called without an active exception"), failing the run after its report.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _fairscale(work: Path, model: str) -> None:
    from fairscale.nn import Pipe

    torch.set_num_threads(1)
    specs = gpt_layers(MODELS[model])
    sequential = torch.nn.Sequential(*build_layers(specs, seed=0).layers.values())
    _load_into(sequential, work, lambda n: f"layers.{n}")
    bounds = _boundaries(work, 2)
    pipe = Pipe(sequential, balance=[bounds[1], bounds[2] - bounds[1]], devices=["cpu", "cpu"],
                chunks=MICRO_BATCHES, checkpoint="never")  # fmt: skip
    optimizer = torch.optim.AdamW(
        pipe.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0, fused=True
    )
    walls, cpus, losses = [], [], []
    for x, y in torch.load(work / "batches.pt"):
        start, cpu = time.perf_counter(), time.process_time()
        optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(pipe(x), y)
        loss.backward()
        optimizer.step()
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
        losses.append(float(loss))
    _report(work, "fairscale-Pipe", 0, walls, cpus, losses)


def _single(work: Path, model: str, threads: int) -> None:
    from engine.runtime.optim import build_optimizer
    from engine.runtime.reference import reference_step

    torch.set_num_threads(threads)
    model_ = build_layers(gpt_layers(MODELS[model]), seed=0)
    _load_into(model_, work)
    optimizer = build_optimizer(model_, lr=LR)
    walls, cpus, losses = [], [], []
    for x, y in torch.load(work / "batches.pt"):
        start, cpu = time.perf_counter(), time.process_time()
        losses.append(reference_step(model_, optimizer, x, y, micro_batches=MICRO_BATCHES))
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
    rank = int(os.environ.get("RANK", "0"))
    pair = "-pair" if os.environ.get("WORLD_SIZE", "1") == "2" else ""
    _report(work, f"single-{threads}t{pair}", rank, walls, cpus, losses)


# --- driver ------------------------------------------------------------------------------------


def _commands(args: argparse.Namespace, work: Path) -> dict[str, list[str]]:
    """How each installed system is launched (its own launcher, its own processes)."""
    me = [str(Path(__file__).resolve()), "--work", str(work), "--model", args.model]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-port", str(args.port)]  # fmt: skip
    out: dict[str, list[str]] = {
        "single-1t": [sys.executable, *me, "--worker", "single", "--threads", "1"],
        "single-2t": [sys.executable, *me, "--worker", "single", "--threads", "2"],
        # Two independent single-thread runs side by side: what two busy cores give here.
        "single-1t-pair": [*torchrun, *me, "--worker", "single", "--threads", "1"],
    }
    for schedule in MESHPIPE_SCHEDULES:
        out[f"meshpipe-{schedule}"] = [
            *torchrun,
            *me,
            "--worker",
            "meshpipe",
            "--schedule",
            schedule,
        ]
    for schedule in TORCH_SCHEDULES:
        out[f"torch-{schedule}"] = [*torchrun, *me, "--worker", "torch", "--schedule", schedule]
    deepspeed = shutil.which("deepspeed", path=str(Path(sys.executable).parent))
    if deepspeed:
        port = str(free_port())  # its own: args.port + 1 may be any process's ephemeral port
        out["deepspeed-PipelineEngine"] = [deepspeed, "--num_gpus", "2", "--master_port", port,
                                           *me, "--worker", "deepspeed"]  # fmt: skip
    try:
        import fairscale  # noqa: F401

        out["fairscale-Pipe"] = [sys.executable, *me, "--worker", "fairscale"]
    except ImportError:
        pass
    return out


def _run(
    name: str, command: list[str], work: Path, warmup: int, census: bool = False
) -> tuple[list[dict[str, Any]], str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "BENCH_WARMUP": str(warmup), "BENCH_CENSUS": "1" if census else ""}  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    (work / f"{name}.log").write_text(done.stdout + done.stderr)
    results = [json.loads(p.read_text()) for p in sorted(work.glob(f"{name}.rank*.json"))]
    if done.returncode != 0 or not results:
        last = (done.stderr or done.stdout or "no output").strip().splitlines()[-1][:120]
        return [], f"{last} (whole log: {work / f'{name}.log'})"
    return results, ""


def _row(name: str, results: list[dict[str, Any]], tokens: int, best: float,
         reference: list[float]) -> str:  # fmt: skip
    step = _slowest(results)
    losses = next(r["losses"] for r in reversed(results) if r["losses"][0] == r["losses"][0])
    if not reference:
        match = "– (no single-1t in this run)"
    elif all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(losses, reference, strict=True)):
        match = "yes"
    else:
        match = "NO"
    bubble = results[0]["bubble"]
    rss = ", ".join(f"{r['rss_mib']:.0f}" for r in results)
    cpu = ", ".join(f"{r['cpu_s']:.3f}" for r in results)
    return (
        f"| {name} | {step:.3f} | {tokens / step:,.0f} | {best / (tokens / step):.2f} | {cpu} "
        f"| {rss} | {'–' if bubble is None else f'{bubble:.1%}'} | {match} |"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench", choices=sorted(MODELS))
    parser.add_argument("--steps", type=int, default=10, help="measured steps")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--systems", default="", help="comma-separated subset of system names")
    parser.add_argument(
        "--rounds", type=int, default=1,
        help="run every system this many times, round-robin; report the median round",
    )  # fmt: skip
    parser.add_argument(
        "--port", type=int, default=29700, help="torchrun's port (DeepSpeed gets a free one)"
    )
    parser.add_argument(
        "--census", action="store_true",
        help="count every rank's aten ops in one more step; print where meshpipe's best and "
        "torch's best differ",
    )  # fmt: skip
    parser.add_argument("--work", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--schedule", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser


def main() -> None:
    args = _parser().parse_args()
    if args.worker:
        _work_as(args)
        return
    work = Path(args.work or ROOT / "runs" / "bench_peers" / args.model)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    _prepare(work, args.model, args.warmup + args.steps)
    commands = _commands(args, work)
    wanted = [s for s in args.systems.split(",") if s] or list(commands)
    rounds: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in wanted}
    for _ in range(args.rounds):
        for name in wanted:
            result, why = _run(name, commands[name], work, args.warmup, args.census)
            if why:
                print(f"{name}: failed: {why}", file=sys.stderr)
            elif result:
                rounds[name].append(result)
    _print_tables(args, rounds, wanted)


def _work_as(args: argparse.Namespace) -> None:
    """One rank of one system (the command `_commands` launched it with)."""
    work = Path(args.work)
    workers = {
        "meshpipe": lambda: _meshpipe(work, args.model, args.schedule),
        "torch": lambda: _torch_pipelining(work, args.model, args.schedule),
        "deepspeed": lambda: _deepspeed(work, args.model),
        "fairscale": lambda: _fairscale(work, args.model),
        "single": lambda: _single(work, args.model, args.threads),
    }
    workers[args.worker]()


def _print_tables(
    args: argparse.Namespace, rounds: dict[str, list[list[dict[str, Any]]]], wanted: list[str]
) -> None:
    """The table of every system's median round, the targets, each round and the census."""
    tokens = GLOBAL_BATCH * SEQ_LEN
    ok = {n: _median_round(r) for n, r in rounds.items() if r}
    fastest = _fastest(ok, "meshpipe")
    meshpipe_best = tokens / _slowest(ok[fastest]) if fastest else 1.0
    reference = ok["single-1t"][0]["losses"] if "single-1t" in ok else []
    size = sum(spec.num_parameters() for spec in gpt_layers(MODELS[args.model])) / 1e6
    print(
        f"model {args.model} ({size:.1f}M), global batch {GLOBAL_BATCH} = {MICRO_BATCHES} × "
        f"{GLOBAL_BATCH // MICRO_BATCHES}, seq {SEQ_LEN}, {args.steps} steps after "
        f"{args.warmup}; {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}\n"
    )
    print(
        "| system | s/step (median) | tokens/s | meshpipe best ÷ this | CPU s/step per rank "
        "| peak RSS per rank (MiB) | bubble | losses match reference |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in wanted:
        if ok.get(name):
            print(_row(name, ok[name], tokens, meshpipe_best, reference))
        else:
            print(f"| {name} | failed or not installed | | | | | | |")
    print()
    print("\n".join(_verdict(ok)))
    if args.rounds > 1:
        print("- every round, in run order (s/step of the slowest rank):")
        for name, runs in rounds.items():
            steps = " / ".join(f"{_slowest(ranks):.3f}" for ranks in runs)
            cpus = " / ".join(f"{_cpu(ranks):.3f}" for ranks in runs)
            print(f"  - {name}: {steps} (CPU of all ranks: {cpus})")
        print("\n".join(_paired(rounds, ok)))
    if args.census:
        print("\n".join(_census_lines(ok)))


def _slowest(ranks: list[dict[str, Any]]) -> float:
    """A system's step time: its slowest rank's (the pipeline runs at that pace)."""
    return max(r["step_s"] for r in ranks)


def _fastest(ok: dict[str, list[dict[str, Any]]], prefix: str) -> str | None:
    """The fastest system whose name starts with `prefix` (None if there is none)."""
    names = [n for n in ok if n.startswith(prefix)]
    return min(names, key=lambda n: _slowest(ok[n])) if names else None


def _median_round(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The round whose slowest rank has the median step time (rounds sorted by it)."""
    ordered = sorted(rounds, key=_slowest)
    return ordered[(len(ordered) - 1) // 2]


def _paired(rounds: dict[str, list[list[dict[str, Any]]]],
            ok: dict[str, list[dict[str, Any]]]) -> list[str]:  # fmt: skip
    """meshpipe's best against DeepSpeed and torch's best, round by round: rounds run
    round-robin, so a round's systems ran minutes apart and share the machine's drift."""
    best, lines = _fastest(ok, "meshpipe"), []
    for peer in ("deepspeed-PipelineEngine", _fastest(ok, "torch")):
        if best is None or peer is None or peer not in ok:
            continue
        pairs = list(zip(rounds[best], rounds[peer], strict=False))
        for what, measure in (("s/step", _slowest), ("CPU s/step of all ranks", _cpu)):
            ratios = [measure(theirs) / measure(ours) for ours, theirs in pairs]
            listed = ", ".join(f"{r:.3f}" for r in ratios)
            lines.append(f"- {peer} ÷ {best}, {what}, paired by round: {listed} "
                         f"(median {statistics.median(ratios):.3f}×)")  # fmt: skip
    return lines


def _cpu(ranks: list[dict[str, Any]]) -> float:
    """A system's CPU time per step, every rank's together: the work it did."""
    return sum(r["cpu_s"] for r in ranks)


def _verdict(ok: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The issue's targets, measured in this run: ratios of step times, memory per rank."""
    step = {n: _slowest(ranks) for n, ranks in ok.items()}
    best, top = _fastest(ok, "meshpipe"), _fastest(ok, "torch")
    if best is None:
        return []
    lines = [f"- meshpipe's best: {best} ({step[best]:.3f} s/step)"]
    if "deepspeed-PipelineEngine" in step:
        lines.append(
            f"- vs DeepSpeed PipelineEngine: {step['deepspeed-PipelineEngine'] / step[best]:.3f}×"
        )
        ds_rss = [r["rss_mib"] for r in ok["deepspeed-PipelineEngine"]]
        our_rss = [r["rss_mib"] for r in ok[best]]
        lines.append(f"- peak RSS per rank: {our_rss} MiB vs DeepSpeed's {ds_rss} MiB")
    if top is not None:
        lines.append(
            f"- vs the best torch.distributed.pipelining ({top}): {step[top] / step[best]:.3f}×"
        )
    limits = (
        ("single-1t", "physical limit (single-1t / 2)"),
        ("single-1t-pair", "two busy cores' limit (single-1t-pair / 2)"),
    )
    for name, label in limits:
        if name in step:
            lines.append(f"- {label}: {step[name] / 2:.3f} s/step; meshpipe's best reaches "
                         f"{step[name] / 2 / step[best]:.1%} of it")  # fmt: skip
    return lines


def _census_lines(ok: dict[str, list[dict[str, Any]]]) -> list[str]:
    """meshpipe's best against torch's best, rank by rank: the aten ops whose calls or output
    bytes differ, and how many ops ran the same."""
    best, peer = _fastest(ok, "meshpipe"), _fastest(ok, "torch")
    if best is None or peer is None:
        return []
    lines = [f"- aten ops of one step, {best} against {peer} (calls, MiB of outputs):"]
    for rank, (ours, theirs) in enumerate(zip(ok[best], ok[peer], strict=True)):
        mine, other = ours["census"], theirs["census"]
        same = [op for op in mine if mine[op] == other.get(op)]
        lines.append(f"  - rank {rank}: {len(same)} ops alike ({sum(mine[op][0] for op in same)} "
                     f"calls); differing:")  # fmt: skip
        for op in sorted(set(mine) | set(other)):
            a, b = mine.get(op, [0, 0]), other.get(op, [0, 0])
            if a != b:
                lines.append(f"    - {op}: {a[0]} vs {b[0]} calls, "
                             f"{a[1] / 2**20:.1f} vs {b[1] / 2**20:.1f} MiB")  # fmt: skip
    return lines


if __name__ == "__main__":
    main()
