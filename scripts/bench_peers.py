"""meshpipe against the pipeline engines users would otherwise pick, side by side in one run.

Every system trains the same GPT decoder from the same initial weights (saved once, loaded by
each) on the same batches with the same AdamW, each in its own processes with one intra-op
thread per rank, and reports the median step time, tokens/s, peak RSS per rank, the bubble
where it can be measured, and whether its losses match the single-process reference.
Installs nothing: systems that are not installed are listed as skipped.

    python scripts/bench_peers.py --model bench --steps 10
    python scripts/bench_peers.py --model bench-large --steps 10
    python scripts/bench_peers.py --systems meshpipe-zb_v,torch-ScheduleZBVZeroBubble --census
    python scripts/bench_peers.py --device cuda --model bench-gpu --rounds 5 --systems \
        single-1t,meshpipe-zb_v,torch-ScheduleZBVZeroBubble,meshpipe-dualpipe_v,torch-ScheduleDualPipeV

`--ranks N` (default 2) sets the pipeline ranks; `--ranks 1` puts both stages of each V on one
rank, where nothing is sent (DeepSpeed's and fairscale's workers here run two ranks only).
`--device cuda` runs each pipeline rank on its own GPU over NCCL (the driver refuses a machine
with fewer GPUs than ranks before starting any system), the single-process reference on one,
times each step to the GPU's end and reports each rank's peak CUDA memory: what settles a few
per cent that the CPU's round-to-round noise cannot. DeepSpeed's and fairscale's workers and
the thread-count variants of the reference run on the CPU only and are not offered there.
`--malloc keep` has glibc keep freed memory in every system's processes alike; each rank's
minor page faults a step are reported either way.

`--census` also counts the aten ops of one more step on every rank of meshpipe's and torch's
workers and prints where the counts differ: whether two engines run the same kernels is a
fact the wall clock of a noisy machine cannot settle.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

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
from scripts.bench_results import (  # noqa: E402
    census_lines,
    cpu_time,
    fastest,
    median_round,
    paired,
    slowest,
    table_row,
    verdict,
)

MODELS = {
    "bench": GPTConfig(
        vocab_size=256, n_layer=8, n_head=8, d_model=256, max_seq_len=128, tie_embeddings=False
    ),
    "bench-large": GPTConfig(
        vocab_size=256, n_layer=12, n_head=8, d_model=384, max_seq_len=128, tie_embeddings=False
    ),
    # Two GPUs: 0.8B parameters (13 GB of fp32 states), 4 × 1024 tokens per micro-batch.
    "bench-gpu": GPTConfig(
        vocab_size=256, n_layer=16, n_head=16, d_model=2048, max_seq_len=1024, tie_embeddings=False
    ),
    # Seconds per system: what the test suite runs to keep the harness itself working.
    "tiny": GPTConfig(
        vocab_size=256, n_layer=4, n_head=2, d_model=32, max_seq_len=128, tie_embeddings=False
    ),
}
GLOBAL_BATCH, MICRO_BATCHES, LR = 32, 8, 1e-3
MESHPIPE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_h2", "zb_drain",
                      "zb_drain+guard", "zb_v", "v_half", "v_min", "dualpipe_v")  # fmt: skip
TWO_STAGES_PER_RANK = ("interleaved_1f1b", "zb_v", "v_half", "v_min", "dualpipe_v")
TORCH_SCHEDULES = ("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
                   "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble",
                   "ScheduleDualPipeV")  # fmt: skip
V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
T = TypeVar("T")
CPU_ONLY = ("single-2t", "single-1t-pair", "deepspeed-PipelineEngine", "fairscale-Pipe")
"""Systems `--device cuda` does not offer: thread counts and the CPU-bound peers' workers."""
ALLOCATOR_ENV = {
    "glibc": {},
    # Freed memory kept for reuse, as CUDA's caching allocator keeps it: blocks up to 32 MiB
    # (glibc's most) come from the heap, not a fresh mmap whose every page faults when touched,
    # and the heap's top is not handed back to the kernel to fault in again a moment later.
    "keep": {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(2**30)},
}
"""`--malloc`: glibc's settings for every system's processes alike."""
TWO_RANKS_ONLY = ("deepspeed-PipelineEngine", "fairscale-Pipe")
"""Systems whose workers here split the model in two stages only (`--ranks 2`)."""


# --- shared inputs ---------------------------------------------------------------------------


def _prepare(work: Path, model: str, steps: int, ranks: int) -> None:
    """Weights, batches and stage boundaries (one and two stages per rank), written once,
    read by every system."""
    specs = gpt_layers(MODELS[model])
    boundaries = {stages: _partition(model, stages) for stages in (ranks, 2 * ranks)}
    (work / "boundaries.json").write_text(json.dumps(boundaries))
    state = build_layers(specs, seed=0).state_dict()
    save_file({k: v.contiguous() for k, v in state.items()}, str(work / "weights.safetensors"))
    loader = BatchLoader(
        load_tokens(default_corpus().bin_path),
        seq_len=MODELS[model].max_seq_len,
        global_batch=GLOBAL_BATCH,
        seed=0,
    )
    torch.save([loader.batch_at(step) for step in range(steps)], work / "batches.pt")


def _device(name: str) -> torch.device:
    """Where a worker computes: the CPU, or its local rank's GPU (`--device cuda`)."""
    if name == "cpu":
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device


@dataclass
class _Steps:
    """Each step's wall seconds, this process's CPU seconds and its minor page faults (pages
    the kernel handed it as it first touched them: what glibc's freed-and-refetched memory
    costs, `--malloc`), waiting for the GPU's work on both sides of a step."""

    walls: list[float] = field(default_factory=list)
    cpus: list[float] = field(default_factory=list)
    faults: list[int] = field(default_factory=list)

    def time(self, step: Callable[[], T]) -> T:
        sync = torch.cuda.synchronize if torch.cuda.is_initialized() else (lambda: None)
        sync()
        start, cpu = time.perf_counter(), time.process_time()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        out = step()
        sync()
        self.walls.append(time.perf_counter() - start)
        self.cpus.append(time.process_time() - cpu)
        self.faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
        return out


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


def _gpu_peak_mib() -> float | None:
    """The most CUDA memory this process had allocated at once; None where it used no GPU."""
    return torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_initialized() else None


def _report(
    work: Path,
    system: str,
    rank: int,
    steps: _Steps,
    losses: list[float],
    bubbles: list[float] | None = None,
    census: dict[str, list[int]] | None = None,
) -> None:
    """A rank's medians over the measured steps: wall time, and the CPU time its process
    spent in every thread (compute, gloo's, Python's), which tells a rank's work from its
    waiting."""
    warm = int(os.environ.get("BENCH_WARMUP", "2"))
    result = {
        "step_s": statistics.median(steps.walls[warm:]),
        "cpu_s": statistics.median(steps.cpus[warm:]),
        "faults": statistics.median(steps.faults[warm:]),
        "losses": losses,
        "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "gpu_mib": _gpu_peak_mib(),
        "bubble": statistics.median(bubbles[warm:]) if bubbles else None,
        "census": census,
    }
    (work / f"{system}.rank{rank}.json").write_text(json.dumps(result))


# --- workers: one per system, run inside that system's processes ------------------------------


def _meshpipe(work: Path, model: str, schedule: str, device: str) -> None:
    """meshpipe with the peers' semantics (no clipping, no non-finite guard, so steps follow
    each other without a barrier); `NAME+guard` keeps the guard and its per-step barrier."""
    from engine.comm.mesh import init_mesh
    from engine.config import EngineOptions, OptimizerSpec
    from engine.runtime.engine import PipelineEngine
    from partitioners import Partition

    ranks = int(os.environ["WORLD_SIZE"])
    mesh = init_mesh(ranks, 1, timeout_s=600, device=_device(device).type)
    name, _, guard = schedule.partition("+")
    v = 2 if name in TWO_STAGES_PER_RANK else 1
    specs = gpt_layers(MODELS[model])
    engine = PipelineEngine(
        specs, mesh, partition=Partition(boundaries=tuple(_boundaries(work, ranks * v))),
        micro_batches=MICRO_BATCHES, schedule=name, stages_per_rank=v,
        optimizer=OptimizerSpec(lr=LR), timeout_s=600,
        options=EngineOptions(nonfinite_guard=guard == "guard"),
    )  # fmt: skip
    _load_into(engine.module, work, lambda n: n.split(".", 1)[1])
    timed, stats = _Steps(), []
    for x, y in torch.load(work / "batches.pt"):
        stats.append(timed.time(functools.partial(engine.train_step, x, y)))
    losses = [s.loss for s in stats]
    bubbles = [s.bubble for s in stats]  # read after the run: they arrive a step late
    census = _census_step(lambda: engine.train_step(x, y))
    _report(work, f"meshpipe-{schedule}", mesh.rank, timed, losses, bubbles, census)
    if torch.distributed.is_initialized():  # one rank joins no process group
        torch.distributed.destroy_process_group()


def _torch_pipelining(work: Path, model: str, schedule: str, device_name: str) -> None:
    import torch.distributed as dist
    from torch.distributed import pipelining

    device = _device(device_name)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    v = 1 if schedule in ("ScheduleGPipe", "Schedule1F1B") else 2
    bounds = _boundaries(work, ranks * v)
    specs = gpt_layers(MODELS[model])
    stages, modules = [], []
    v_shaped = schedule in V_SHAPED
    placed = (rank, 2 * ranks - 1 - rank) if v_shaped else (rank, rank + ranks)
    for s in placed[:v]:
        module = build_layers(specs, range(bounds[s], bounds[s + 1]), seed=0)
        _load_into(module, work)
        modules.append(module.to(device))
        stages.append(pipelining.PipelineStage(module, s, ranks * v, device))
    cls = getattr(pipelining, schedule)
    runner = cls(stages[0] if v == 1 else stages, MICRO_BATCHES, loss_fn=lm_loss)
    params = [p for m in modules for p in m.parameters()]
    optimizer = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    timed, losses = _Steps(), []

    def step(x: torch.Tensor, y: torch.Tensor, mb_losses: list[torch.Tensor]) -> None:
        optimizer.zero_grad(set_to_none=True)
        last = rank == (0 if v_shaped else ranks - 1)
        _torch_step(runner, x if rank == 0 else None, y if last else None, mb_losses)
        optimizer.step()

    for x, y in ((x.to(device), y.to(device)) for x, y in torch.load(work / "batches.pt")):
        mb_losses: list[torch.Tensor] = []
        timed.time(functools.partial(step, x, y, mb_losses))
        losses.append(float(torch.stack(mb_losses).mean()) if mb_losses else float("nan"))
    census = _census_step(lambda: step(x, y, []))
    _report(work, f"torch-{schedule}", rank, timed, losses, census=census)
    dist.destroy_process_group()


def _torch_step(runner: Any, x: Any, y: Any, losses: list[torch.Tensor]) -> None:
    """One step of torch's schedule: the rank holding stage 0 feeds the inputs `x`; the one
    holding the last stage (the last rank, or rank 0 under V-shaped placement) gives the
    targets `y` and collects the losses (None where this rank does neither)."""
    last = {} if y is None else {"target": y, "losses": losses}
    runner.step(*([] if x is None else [x]), **last)


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
    timed = _Steps()
    losses = [timed.time(lambda: float(engine.train_batch(stream))) for _ in batches]
    _report(work, "deepspeed-PipelineEngine", engine.global_rank, timed, losses)
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

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(pipe(x), y)
        loss.backward()
        optimizer.step()
        return float(loss)

    timed = _Steps()
    losses = [timed.time(functools.partial(step, x, y)) for x, y in torch.load(work / "batches.pt")]
    _report(work, "fairscale-Pipe", 0, timed, losses)


def _single(work: Path, model: str, threads: int, device_name: str) -> None:
    from engine.runtime.optim import build_optimizer
    from engine.runtime.reference import reference_step

    torch.set_num_threads(threads)
    device = _device(device_name)
    model_ = build_layers(gpt_layers(MODELS[model]), seed=0)
    _load_into(model_, work)
    model_.to(device)
    optimizer = build_optimizer(model_, lr=LR)
    timed, losses = _Steps(), []
    for x, y in ((x.to(device), y.to(device)) for x, y in torch.load(work / "batches.pt")):
        step = functools.partial(
            reference_step, model_, optimizer, x, y, micro_batches=MICRO_BATCHES
        )
        losses.append(timed.time(step))
    rank = int(os.environ.get("RANK", "0"))
    pair = "-pair" if os.environ.get("WORLD_SIZE", "1") == "2" else ""
    _report(work, f"single-{threads}t{pair}", rank, timed, losses)


# --- driver ------------------------------------------------------------------------------------


def _commands(args: argparse.Namespace, work: Path) -> dict[str, list[str]]:
    """How each installed system is launched (its own launcher, its own processes)."""
    me = [str(Path(__file__).resolve()), "--work", str(work), "--model", args.model,
          "--device", args.device]  # fmt: skip
    launch = [sys.executable, "-m", "torch.distributed.run", "--master-port", str(args.port)]
    torchrun = [*launch, "--nproc-per-node", str(args.ranks)]
    single = ["--worker", "single", "--threads"]
    out: dict[str, list[str]] = {
        "single-1t": [sys.executable, *me, *single, "1"],
        "single-2t": [sys.executable, *me, *single, "2"],
        # Two independent single-thread runs side by side: what two busy cores give here.
        "single-1t-pair": [*launch, "--nproc-per-node", "2", *me, *single, "1"],
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
    refused = (CPU_ONLY if args.device == "cuda" else ()) + (
        TWO_RANKS_ONLY if args.ranks != 2 else ()
    )
    return {name: command for name, command in out.items() if name not in refused}


def _chosen(args: argparse.Namespace, commands: dict[str, list[str]]) -> list[str]:
    """The systems `--systems` names (every one offered when it names none), refused by name
    before anything runs where one is not offered or the GPUs are too few."""
    wanted = [s for s in args.systems.split(",") if s] or list(commands)
    unknown = [name for name in wanted if name not in commands]
    for name in unknown:
        why = "unknown or not installed"
        if args.device == "cuda" and name in CPU_ONLY:
            why = "runs on the CPU only (--device cpu)"
        elif args.ranks != 2 and name in TWO_RANKS_ONLY:
            why = "runs on two ranks only (--ranks 2)"
        raise SystemExit(f"bench_peers: {name} {why}; choose among: {', '.join(commands)}")
    if args.ranks < 1:
        raise SystemExit(f"bench_peers: --ranks {args.ranks}: a pipeline needs 1 rank or more")
    gpus = torch.cuda.device_count() if args.device == "cuda" else args.ranks
    if gpus < args.ranks:
        raise SystemExit(
            f"bench_peers: --device cuda --ranks {args.ranks} runs each pipeline on "
            f"{args.ranks} GPUs (NCCL needs one per rank) and this machine has {gpus}: run it "
            f"where {args.ranks} are, --ranks {gpus} here, or leave out --device cuda to "
            "compare on the CPU"
        )
    return wanted


def _run(
    name: str, command: list[str], work: Path, args: argparse.Namespace
) -> tuple[list[dict[str, Any]], str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "BENCH_WARMUP": str(args.warmup), "BENCH_CENSUS": "1" if args.census else "",
           **ALLOCATOR_ENV[args.malloc]}  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    (work / f"{name}.log").write_text(done.stdout + done.stderr)
    results = [json.loads(p.read_text()) for p in sorted(work.glob(f"{name}.rank*.json"))]
    if done.returncode != 0 or not results:
        last = (done.stderr or done.stdout or "no output").strip().splitlines()[-1][:120]
        return [], f"{last} (whole log: {work / f'{name}.log'})"
    return results, ""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench", choices=sorted(MODELS))
    parser.add_argument("--steps", type=int, default=10, help="measured steps")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--systems", default="", help="comma-separated subset of system names")
    parser.add_argument(
        "--device", default="cpu", choices=("cpu", "cuda"),
        help="cuda: each pipeline on --ranks GPUs over NCCL, the reference on one",
    )  # fmt: skip
    parser.add_argument(
        "--malloc", default="glibc", choices=sorted(ALLOCATOR_ENV),
        help="keep: glibc keeps freed memory for reuse (every system alike), as CUDA's "
        "caching allocator does; glibc: its defaults",
    )  # fmt: skip
    parser.add_argument(
        "--ranks", type=int, default=2,
        help="pipeline ranks (2: every system; 1: both stages of a V on one rank, no transfers)",
    )  # fmt: skip
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
    commands = _commands(args, work)
    wanted = _chosen(args, commands)
    _prepare(work, args.model, args.warmup + args.steps, args.ranks)
    rounds: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in wanted}
    for _ in range(args.rounds):
        for name in wanted:
            result, why = _run(name, commands[name], work, args)
            if why:
                print(f"{name}: failed: {why}", file=sys.stderr)
            elif result:
                rounds[name].append(result)
    _print_tables(args, rounds, wanted)


def _work_as(args: argparse.Namespace) -> None:
    """One rank of one system (the command `_commands` launched it with)."""
    work = Path(args.work)
    workers = {
        "meshpipe": lambda: _meshpipe(work, args.model, args.schedule, args.device),
        "torch": lambda: _torch_pipelining(work, args.model, args.schedule, args.device),
        "deepspeed": lambda: _deepspeed(work, args.model),
        "fairscale": lambda: _fairscale(work, args.model),
        "single": lambda: _single(work, args.model, args.threads, args.device),
    }
    workers[args.worker]()


def _print_tables(
    args: argparse.Namespace, rounds: dict[str, list[list[dict[str, Any]]]], wanted: list[str]
) -> None:
    """The table of every system's median round, the targets, each round and the census."""
    seq_len = MODELS[args.model].max_seq_len
    tokens = GLOBAL_BATCH * seq_len
    ok = {n: median_round(r) for n, r in rounds.items() if r}
    best = fastest(ok, "meshpipe")
    meshpipe_best = tokens / slowest(ok[best]) if best else 1.0
    reference = ok["single-1t"][0]["losses"] if "single-1t" in ok else []
    size = sum(spec.num_parameters() for spec in gpt_layers(MODELS[args.model])) / 1e6
    print(
        f"model {args.model} ({size:.1f}M), global batch {GLOBAL_BATCH} = {MICRO_BATCHES} × "
        f"{GLOBAL_BATCH // MICRO_BATCHES}, seq {seq_len}, {args.steps} steps after "
        f"{args.warmup}; {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
        f"; {args.ranks} pipeline rank(s), malloc {args.malloc}{_gpu_name(args.device)}\n"
    )
    memory = "CUDA memory allocated" if args.device == "cuda" else "RSS"
    print(
        "| system | s/step (median) | tokens/s | meshpipe best ÷ this | CPU s/step per rank "
        f"| peak {memory} per rank (MiB) | page faults per step per rank (k) | bubble "
        "| losses match reference |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in wanted:
        if ok.get(name):
            print(table_row(name, ok[name], tokens, meshpipe_best, reference))
        else:
            print(f"| {name} | failed or not installed | | | | | | | |")
    print()
    print("\n".join(verdict(ok, args.ranks)))
    if args.rounds > 1:
        print("- every round, in run order (s/step of the slowest rank):")
        for name, runs in rounds.items():
            steps = " / ".join(f"{slowest(ranks):.3f}" for ranks in runs)
            cpus = " / ".join(f"{cpu_time(ranks):.3f}" for ranks in runs)
            print(f"  - {name}: {steps} (CPU of all ranks: {cpus})")
        print("\n".join(paired(rounds, ok)))
    if args.census:
        print("\n".join(census_lines(ok)))


def _gpu_name(device: str) -> str:
    """The GPU a `--device cuda` table was measured on, for its heading."""
    return f", each on a {torch.cuda.get_device_name(0)}" if device == "cuda" else ""


if __name__ == "__main__":
    main()
