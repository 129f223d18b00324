"""Pipeline runs and their single-process references, shared by the distributed tests.

A `Case` is one (model, layout, schedule, micro-batching) configuration. `run_case` runs it on
the calling rank's mesh; `reference_run` runs the same steps in one process with the same
seed, the same global batches and the same micro-batch size.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from engine.comm.mesh import init_mesh
from engine.config import EngineOptions, OptimizerSpec
from engine.parallel import full_tensor, local_tensor
from engine.runtime.clipping import global_grad_norm, global_parameter_order
from engine.runtime.engine import PipelineEngine
from engine.runtime.optim import build_from_spec
from engine.runtime.precision import LossScaler
from engine.runtime.reference import reference_step
from models import (
    GPTConfig,
    LayerSpec,
    build_layers,
    document_scope,
    get_config,
    layer_specs,
    lm_loss,
)
from partitioners import partition_model

GPT_UNTIED = GPTConfig(
    vocab_size=256, n_layer=4, n_head=4, d_model=64, max_seq_len=64, tie_embeddings=False
)
GPT_DEEP = GPTConfig(
    vocab_size=256, n_layer=7, n_head=4, d_model=32, max_seq_len=64, tie_embeddings=False
)
LLAMA_BIASED = replace(  # Qwen2's q, k, v biases, Mistral's window (shorter than SEQ_LEN), a tie
    get_config("llama-tiny"), qkv_bias=True, sliding_window=5, tie_embeddings=True
)
MODELS: dict[str, Any] = {
    "gpt-untied": GPT_UNTIED,
    "llama-biased": LLAMA_BIASED,
    "gpt-deep": GPT_DEEP,
    "gpt-tiny": "gpt-tiny",
    "llama": "llama-tiny",
}
SEQ_LEN = 16


def model_specs(model: str) -> list[LayerSpec]:
    """The layer list of a case's model. `gpt-crossed-ties` is gpt-tiny (embedding tied to the
    head) with two more ties, blocks 1 ↔ 4 and 2 ↔ 3: with two stages each rank meets the
    three tied weights in a different order."""
    if model != "gpt-crossed-ties":
        return list(layer_specs(MODELS[model]))
    specs = list(layer_specs("gpt-tiny"))
    for block, key in ((1, "A"), (4, "A"), (2, "B"), (3, "B")):
        specs[block] = replace(specs[block], tie_key=key, tied_param="mlp.fc.weight")
    return specs


STEPS = 2


@dataclass(frozen=True)
class Case:
    model: str
    pp: int
    dp: int
    schedule: str
    micro_batches: int
    partition: str
    optimizer: str = "adamw"
    stages_per_rank: int = 1
    clip: float = 0.0
    precision: str = "fp32"
    recompute: str = "none"
    zero: int = 0
    zero_reshard: str = "step"
    zero_reshard_stages: tuple[int, ...] | None = None
    nan_at_step: int = -1
    micro_batch_size: int = 2
    guard: bool = True
    tp: int = 1
    optimizer_impl: str = "fused"
    compile: bool = False
    documents: bool = False
    """Pack documents: each batch row holds several (`batch_documents`)."""
    sequence_parallel: bool = False

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.micro_batches * self.dp

    def __str__(self) -> str:
        return (
            f"{self.model}-pp{self.pp}-dp{self.dp}-{self.schedule}-m{self.micro_batches}-"
            f"{self.partition.replace(':', '=').replace(',', '.')}-{self.optimizer}"
            + (f"-v{self.stages_per_rank}" if self.stages_per_rank > 1 else "")
            + (f"-clip{self.clip}" if self.clip else "")
            + (f"-{self.precision}" if self.precision != "fp32" else "")
            + (f"-recompute={self.recompute}" if self.recompute != "none" else "")
            + (f"-zero{self.zero}" if self.zero else "")
            + (f"-reshard={self.zero_reshard}" if self.zero_reshard != "step" else "")
            + (
                f"-on={'.'.join(map(str, self.zero_reshard_stages))}"
                if self.zero_reshard_stages is not None
                else ""
            )
            + (f"-nan@{self.nan_at_step}" if self.nan_at_step >= 0 else "")
            + ("" if self.guard else "-unguarded")
            + (f"-tp{self.tp}" if self.tp > 1 else "")
            + ("-compiled" if self.compile else "")
            + ("-packed" if self.documents else "")
            + ("-sp" if self.sequence_parallel else "")
        )


def batches(case: Case) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1234)
    shape = (case.global_batch, SEQ_LEN + 1)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, 256, shape, generator=generator)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def batch_documents(case: Case) -> list[torch.Tensor | None]:
    """Each step's document ids (global_batch, SEQ_LEN): documents of random lengths packed
    into every row, or None per step when the case packs none."""
    if not case.documents:
        return [None] * STEPS
    generator = torch.Generator().manual_seed(4321)
    starts = torch.rand((STEPS, case.global_batch, SEQ_LEN), generator=generator) < 0.2
    return list(starts.cumsum(-1))


def _optimizer(case: Case) -> OptimizerSpec:
    """AdamW for bitwise cases; SGD where results are compared to a tolerance, because Adam
    normalises gradients that are mathematically zero (attention's key bias) and turns their
    last-bit noise into lr-sized steps."""
    impl = "per_tensor" if case.zero == 3 else case.optimizer_impl  # FSDP2 shards: no fused
    return OptimizerSpec(name=case.optimizer, lr=1e-2, weight_decay=0.1, momentum=0.9, impl=impl)


def _poison(engine: PipelineEngine, case: Case, step: int) -> None:
    """Make stage 0's output NaN in the chosen step (test of the global skip)."""
    if 0 not in engine.stages or step != case.nan_at_step:
        return
    first = next(iter(engine.stages[0].module.layers.values()))
    handle = first.register_forward_hook(lambda _m, _i, out: out * float("nan"))
    engine._nan_hook = handle  # type: ignore[attr-defined]


def _unpoison(engine: PipelineEngine) -> None:
    handle = getattr(engine, "_nan_hook", None)
    if handle is not None:
        handle.remove()
        engine._nan_hook = None  # type: ignore[attr-defined]


def run_case(case: Case) -> dict[str, Any]:
    """Train `case` on this rank; returns losses, in-flight peaks and this rank's parameters."""
    mesh = init_mesh(case.pp, case.dp, case.tp, timeout_s=60)
    specs = model_specs(case.model)
    stages = case.pp * case.stages_per_rank
    partition = partition_model(specs, method=case.partition, num_stages=stages, seq_len=SEQ_LEN)
    engine = PipelineEngine(
        specs,
        mesh,
        partition=partition,
        micro_batches=case.micro_batches,
        schedule=case.schedule,
        stages_per_rank=case.stages_per_rank,
        seed=7,
        optimizer=_optimizer(case),
        timeout_s=60,
        options=EngineOptions(
            clip_grad_norm=case.clip,
            precision=case.precision,
            recompute=case.recompute,
            zero=case.zero,
            zero_reshard=case.zero_reshard,
            zero_reshard_stages=case.zero_reshard_stages,
            nonfinite_guard=case.guard,
            compile=case.compile,
            sequence_parallel=case.sequence_parallel,
        ),
    )
    rows = case.global_batch // case.dp
    gathered = _count_gathered(engine)
    losses, peaks, pending, bubbles, norms, skipped = [], [], [], [], [], []
    steps = []
    documents = batch_documents(case)
    for step, (inputs, targets) in enumerate(batches(case)):
        local = slice(mesh.dp_rank * rows, (mesh.dp_rank + 1) * rows)
        _poison(engine, case, step)
        docs = documents[step]
        stats = engine.train_step(
            inputs[local] if engine.is_first else None,
            targets[local] if engine.is_last else None,
            None if docs is None else docs[local],
        )
        _unpoison(engine)
        steps.append(stats)
    for stats in steps:  # read after all steps: the pipeline figures of a step arrive late
        norms.append(stats.grad_norm)
        skipped.append(stats.skipped)
        losses.append(stats.loss)
        peaks.append(stats.in_flight_peak)
        pending.append(stats.pending_w_peak)
        bubbles.append(stats.bubble)
    inputs, targets = batches(case)[0]
    local = slice(mesh.dp_rank * rows, (mesh.dp_rank + 1) * rows)
    docs = documents[0]
    eval_loss = engine.eval_step(
        inputs[local], targets[local], None if docs is None else docs[local]
    )
    params = {n: full_tensor(p.detach()).clone() for n, p in engine.module.named_parameters()}
    local_shapes = {
        n.split(".", 1)[1]: tuple(local_tensor(p).shape)
        for n, p in engine.module.named_parameters()
    }
    if engine.sharded is not None:  # the fp32 masters, not the low-precision working weights
        masters = engine.sharded.full_masters()
        named = engine.module.named_parameters()
        params = {n: masters[id(p)].clone() for n, p in named}
    zero_bytes = held_bytes(engine) if engine.sharded is not None else {}
    if engine.fsdp is not None:
        zero_bytes = fsdp_held_bytes(engine)
    engine.close()  # the next case's engine makes its own groups in this world
    return {
        "losses": losses,
        "eval_loss": eval_loss,
        "peaks": peaks,
        "pending_w": pending,
        "bubbles": bubbles,
        "params": {n.split(".", 1)[1]: p for n, p in params.items()},
        "dp_rank": mesh.dp_rank,
        "tp_rank": mesh.tp_rank,
        "pp_rank": mesh.pp_rank,
        "sent_shapes": engine.exchange.sent_shapes,
        "local_shapes": local_shapes,
        "grad_norms": norms,
        "skipped": skipped,
        "optimizer_state_bytes": _state_bytes(engine.optimizer),
        "zero_bytes": zero_bytes,
        "gathered_at_forwards": gathered,
        "fsdp_layers": len(engine.fsdp.layers) if engine.fsdp is not None else 0,
        "fsdp_resharded": len(engine.fsdp.resharded) if engine.fsdp is not None else 0,
    }


def _count_gathered(engine: PipelineEngine) -> list[int]:
    """ZeRO-3: how many of the rank's layers are gathered as each layer's forward starts (FSDP
    registers a layer's plain tensors while gathered, its DTensor shards otherwise)."""
    from torch.distributed.tensor import DTensor

    counts: list[int] = []
    if engine.fsdp is None:
        return counts
    layers = engine.fsdp.layers

    def count(*_: object) -> None:
        counts.append(sum(not isinstance(next(iter(m.parameters())), DTensor) for m in layers))

    for layer in layers:
        layer.register_forward_pre_hook(count)  # type: ignore[attr-defined]
    return counts


def fsdp_held_bytes(engine: PipelineEngine) -> dict[str, float]:
    """Bytes per parameter a ZeRO-3 rank holds between steps: the local shards of weights,
    gradients and optimizer state (DTensors), over the whole stage's parameter count."""
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> int:
        part = t.to_local() if isinstance(t, DTensor) else t
        return part.numel() * part.element_size()

    params = list(engine.module.parameters())
    numel = sum(p.numel() for p in params)
    optimizer = engine.optimizer
    assert optimizer is not None
    return {
        "weights": sum(local(p) for p in params) / numel,
        "gradients": sum(local(p.grad) for p in params if p.grad is not None) / numel,
        "moments": sum(
            local(t)
            for p in params
            for t in optimizer.state[p].values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        )
        / numel,
    }


def held_bytes(engine: PipelineEngine) -> dict[str, float]:
    """Bytes per low-precision parameter this rank holds after a step under ZeRO, by kind,
    counted from the tensors themselves: weights, fp32 gradients, fp32 masters, moments."""
    assert engine.sharded is not None
    flats = [f for f in engine.sharded.flats if f.dtype != torch.float32]
    numel = sum(f.numel for f in flats)
    if not numel:
        return {}
    grads = [t for f in flats for t in (f.grads, f.shard_grad) if t is not None]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in grads}
    optimizer = engine.optimizer
    assert optimizer is not None
    moments = sum(
        t.numel() * t.element_size()
        for f in flats
        for t in optimizer.state[f.master].values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )
    return {
        "weights": sum(f.weights.numel() * f.weights.element_size() for f in flats) / numel,
        "gradients": sum(storages.values()) / numel,
        "masters": sum(f.master.numel() * f.master.element_size() for f in flats) / numel,
        "moments": moments / numel,
    }


def _state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer wraps the local one
    if inner is None:
        return 0
    return sum(
        t.numel() * t.element_size()
        for state in inner.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )


def run_cases(rank: int, world_size: int, cases: list[Case]) -> dict[str, dict[str, Any]]:
    """Harness entry point: run every case on this rank, keyed by the case's name."""
    return {str(case): run_case(case) for case in cases}


def _scored(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, docs: torch.Tensor | None
) -> torch.Tensor:
    with document_scope(docs):
        return lm_loss(model(x), y)


def reference_run(case: Case) -> dict[str, Any]:
    """The same steps in one process: m·dp micro-batches of the same size."""
    torch.set_num_threads(1)
    model = build_layers(model_specs(case.model), seed=7)
    optimizer = build_from_spec(_optimizer(case), model)
    scaler = LossScaler() if case.precision == "fp16" else None
    specs = model_specs(case.model)
    order = global_parameter_order(specs)
    losses, norms = [], []
    documents = batch_documents(case)
    for (x, y), docs in zip(batches(case), documents, strict=True):
        losses.append(
            reference_step(
                model,
                optimizer,
                x,
                y,
                micro_batches=case.micro_batches * case.dp,
                clip_grad_norm=case.clip,
                precision=case.precision,
                scaler=scaler,
                documents=docs,
            )
        )
        norms.append(float(global_grad_norm(list(model.named_parameters()), order)))
    x, y = batches(case)[0]
    size = case.micro_batch_size
    docs = documents[0]
    doc_rows = docs.split(size) if docs is not None else [None] * (len(x) // size)
    with torch.no_grad():
        pairs = zip(x.split(size), y.split(size), doc_rows, strict=True)
        eval_loss = float(
            torch.stack([_scored(model, a, b, d) for a, b, d in pairs]).mean()
        )
    return {
        "losses": losses,
        "eval_loss": eval_loss,
        "grad_norms": norms,
        "params": {n: p.detach().clone() for n, p in model.state_dict(keep_vars=False).items()},
    }
