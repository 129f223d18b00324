"""Parameters and optimizer state under stored names: what a stage writes and reads back.

A stage's parameters are named globally (`layers.{i}.…`). A weight tied across layers is
stored once, under its lowest layer's name, and a stage holding another copy reads it from
there. Optimizer state is stored per parameter (`{name}.exp_avg`, …), never by the optimizer's
positional index, so it follows its parameter into any layout. No torch.distributed here.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from engine.checkpoint.files import CheckpointError, canonical_name, expected_names
from engine.comm.dtensor import is_dtensor
from engine.parallel import ShardedOptimizer, full_tensor, local_tensor, shard_like
from models import LayerSpec

__all__ = [
    "TensorSource",
    "check_names",
    "copy_into",
    "gathered",
    "is_sharded",
    "like",
    "load_module_weights",
    "local_optimizer",
    "optimizer_state",
    "read_module_weights",
    "read_optimizer_state",
    "read_sharded_state",
    "sharded_model_tensors",
    "sharded_optimizer_state",
    "stored_parameters",
]


class TensorSource(Protocol):
    """Tensors under stored names: a checkpoint's index, or a Hugging Face folder renamed."""

    @property
    def names(self) -> frozenset[str]: ...

    def get(self, name: str) -> torch.Tensor: ...

    def where(self, name: str) -> str:
        """The file `name` is read from (for error messages)."""
        ...


def stored_parameters(module: nn.Module, specs: Sequence[LayerSpec]) -> dict[str, torch.Tensor]:
    """The parameters this module stores: all but tied copies owned by a lower layer. Full
    tensors: a tensor-parallel shard is gathered over its tp group (every tp rank calls this)."""
    return {
        name: full_tensor(param.detach())
        for name, param in module.named_parameters()
        if canonical_name(specs, name) == name
    }


def check_names(source: TensorSource, specs: Sequence[LayerSpec]) -> None:
    """The source holds exactly the model's stored names: nothing missing, nothing foreign."""
    want = expected_names(specs)
    missing, foreign = sorted(want - source.names), sorted(source.names - want)
    if missing:
        raise CheckpointError(
            f"{source.where(missing[0])} lacks {len(missing)} of the model's tensors, e.g. "
            f"{missing[:3]}: the checkpoint is incomplete or of another model"
        )
    if foreign:
        raise CheckpointError(
            f"{source.where(foreign[0])} holds {len(foreign)} tensors the model lacks, e.g. "
            f"{foreign[:3]}: it was saved from another model"
        )


def read_module_weights(
    module: nn.Module, specs: Sequence[LayerSpec], source: TensorSource, *, exact_dtype: bool
) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """Each parameter of `module` with its stored tensor, shape-checked; nothing is copied."""
    pairs = []
    for name, param in module.named_parameters():
        stored = canonical_name(specs, name)
        tensor = source.get(stored)
        if tensor.shape != param.shape:
            raise CheckpointError(
                f"{source.where(stored)}: tensor {stored!r} has shape {tuple(tensor.shape)} but "
                f"the model's {name!r} has {tuple(param.shape)}: vocabulary or width differ"
            )
        if exact_dtype and tensor.dtype != param.dtype:
            raise CheckpointError(
                f"{source.where(stored)}: tensor {stored!r} is {tensor.dtype}, the model's "
                f"{name!r} is {param.dtype}"
            )
        pairs.append((param, tensor))
    return pairs


def copy_into(param: nn.Parameter, tensor: torch.Tensor) -> None:
    """Copy a stored full tensor into a parameter; a tensor-parallel one takes its shard."""
    local_tensor(param).copy_(shard_like(param, tensor))


def _laid_out_like(param: nn.Parameter, value: Any) -> Any:
    """A stored optimizer state of a tensor-parallel parameter, sharded as the parameter is
    (the optimizer updates the shard with it); scalars and plain parameters' states as read."""
    if not is_dtensor(param) or not isinstance(value, torch.Tensor) or not value.dim():
        return value
    from torch.distributed.tensor import DTensor

    local = shard_like(param, value)
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False)


def load_module_weights(
    module: nn.Module, specs: Sequence[LayerSpec], source: TensorSource
) -> None:
    """Check, then copy every parameter of `module` from `source` (one process)."""
    check_names(source, specs)
    pairs = read_module_weights(module, specs, source, exact_dtype=False)
    with torch.no_grad():
        for param, tensor in pairs:
            copy_into(param, tensor)


_SCALARS: dict[str, tuple[type, torch.dtype]] = {
    "bool": (bool, torch.bool),
    "int": (int, torch.int64),
    "float": (float, torch.float64),
}
"""Python scalars an optimizer may keep as state (DeepSpeed's CPU Adam counts `step` in an
int), stored as 0-dim tensors wide enough to give back the same value."""


def _state_tensor(name: str, value: object) -> tuple[torch.Tensor, str | None]:
    """`value` as a tensor, and the Python type to give back on load (None: a tensor)."""
    if isinstance(value, torch.Tensor):
        return value, None
    kind = type(value).__name__
    if kind not in _SCALARS:
        raise CheckpointError(
            f"optimizer state {name} is a {kind}: only tensors and {', '.join(_SCALARS)} "
            "scalars can be saved"
        )
    return torch.tensor(value, dtype=_SCALARS[kind][1]), kind


def _state_value(tensor: torch.Tensor, kind: str | None, where: str) -> Any:
    """The state value a stored tensor stands for: the tensor, or the scalar it holds."""
    if kind is None:
        return tensor
    if kind not in _SCALARS or tensor.dim() != 0:
        raise CheckpointError(f"{where}: cannot read back a {kind} scalar from {tensor.shape}")
    return _SCALARS[kind][0](tensor.item())


def _optimized(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer holding this rank's state: for ZeRO-1 its local shard `.optim` (the
    wrapper's own `state` stays empty and its `state_dict()` needs a consolidation onto one
    rank), else `optimizer` itself. The shard's parameters are the ones this rank owns."""
    # Looked up, not imported: a ZeRO optimizer exists only once its module was imported, and
    # importing torch.distributed.optim costs seconds that every other run would pay.
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    if zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer):
        inner: torch.optim.Optimizer = optimizer.optim
        return inner
    return optimizer


def is_sharded(optimizer: torch.optim.Optimizer) -> bool:
    """Whether each data-parallel replica holds a different part of the state (ZeRO-1)."""
    return local_optimizer(optimizer) is not optimizer


def optimizer_state(
    optimizer: torch.optim.Optimizer, module: nn.Module, specs: Sequence[LayerSpec]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """`module`'s share of the optimizer: tensors `{param}.{key}` and JSON metadata
    (optimizer class, hyper-parameters per group, state keys per parameter, and the Python
    type of each state value that is a scalar rather than a tensor).

    Under ZeRO-1 the share is that of the parameters this rank owns, and the class recorded is
    the sharded one (e.g. AdamW), so any layout, sharded or not, can load it."""
    owner = local_optimizer(optimizer)
    optimized = {id(p) for p in _optimized(owner)}
    tensors: dict[str, torch.Tensor] = {}
    state_keys: dict[str, list[str]] = {}
    scalars: dict[str, str] = {}
    for name, param in module.named_parameters():
        if canonical_name(specs, name) != name or id(param) not in optimized:
            continue
        state_keys[name] = []
        for key, value in sorted(owner.state.get(param, {}).items()):
            tensor, kind = _state_tensor(f"{name}.{key}", value)
            tensors[f"{name}.{key}"] = full_tensor(tensor)
            state_keys[name].append(key)
            if kind is not None:
                scalars[f"{name}.{key}"] = kind
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    meta = {
        "optimizer": type(owner).__name__,
        "param_groups": groups,
        "state_keys": state_keys,
        "scalars": scalars,
    }
    return tensors, meta


def _check_optimizer(optimizer: torch.optim.Optimizer, meta: dict[str, Any], where: str) -> None:
    saved, ours = meta.get("optimizer"), type(local_optimizer(optimizer)).__name__
    if saved != ours:
        raise CheckpointError(f"{where} holds {saved} state but the run uses {ours}")
    groups = meta.get("param_groups")
    if not isinstance(groups, list) or len(groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"{where} has {len(groups) if isinstance(groups, list) else 'no'} parameter groups; "
            f"the run's {ours} has {len(optimizer.param_groups)}"
        )


def _from_json(group: dict[str, Any]) -> dict[str, Any]:
    """JSON turned tuples (Adam's betas) into lists; give them back."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in group.items()}


def read_optimizer_state(
    optimizer: torch.optim.Optimizer,
    modules: Iterable[nn.Module],
    specs: Sequence[LayerSpec],
    source: Any,
) -> dict[str, Any]:
    """A `state_dict` for `optimizer` holding the stored state of the modules' parameters
    (under ZeRO-1, of those this rank owns: `load_state_dict` keeps only those anyway).

    `source` is a `TensorReader` of the optimizer index (its metadata carries the groups).
    """
    meta, where = source.metadata, str(source.index_path)
    _check_optimizer(optimizer, meta, where)
    index = {id(p): i for i, p in enumerate(_optimized(optimizer))}
    owned = {id(p) for p in _optimized(local_optimizer(optimizer))}
    state_keys: dict[str, list[str]] = meta.get("state_keys", {})
    scalars: dict[str, str] = meta.get("scalars", {})
    state: dict[int, dict[str, Any]] = {}
    for module in modules:
        for name, param in module.named_parameters():
            if id(param) not in owned:
                continue
            stored = canonical_name(specs, name)
            if stored not in state_keys:
                raise CheckpointError(f"{where} holds no optimizer state for {stored!r}")
            entry = {key: source.get(f"{stored}.{key}") for key in state_keys[stored]}
            for key, tensor in entry.items():
                if tensor.dim() and tensor.shape != param.shape:
                    raise CheckpointError(
                        f"{source.where(f'{stored}.{key}')}: tensor {stored}.{key} has shape "
                        f"{tuple(tensor.shape)} but {name!r} has {tuple(param.shape)}"
                    )
            if entry:
                state[index[id(param)]] = {
                    key: _laid_out_like(
                        param, _state_value(tensor, scalars.get(f"{stored}.{key}"), where)
                    )
                    for key, tensor in entry.items()
                }
    groups = [  # numbered as `state_dict()` numbers them, which ZeRO-1 cannot call
        {**_from_json(saved), "params": [index[id(p)] for p in group["params"]]}
        for saved, group in zip(meta["param_groups"], optimizer.param_groups, strict=True)
    ]
    return {"state": state, "param_groups": groups}


def sharded_model_tensors(
    module: nn.Module, specs: Sequence[LayerSpec], masters: Mapping[int, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """What `stored_parameters` gives, from ZeRO's whole fp32 masters (by parameter id): a
    ZeRO run stores fp32 weights as a ZeRO-0 run does, not its low-precision working copies."""
    named = dict(module.named_parameters())
    return {name: masters[id(named[name])] for name in stored_parameters(module, specs)}


def sharded_optimizer_state(
    states: Mapping[int, Mapping[str, Any]],
    module: nn.Module,
    specs: Sequence[LayerSpec],
    *,
    optimizer: str,
    groups: list[dict[str, Any]],
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """`optimizer_state`'s tensors and metadata from ZeRO's whole per-parameter state
    (`ShardedOptimizer.full_state`, or FSDP's gathered): the reference's class name and its
    groups' hyper-parameters, so a ZeRO-0 run loads it as its own."""
    tensors: dict[str, torch.Tensor] = {}
    state_keys: dict[str, list[str]] = {}
    scalars: dict[str, str] = {}
    for name, param in module.named_parameters():
        if canonical_name(specs, name) != name or id(param) not in states:
            continue
        state_keys[name] = []
        for key, value in sorted(states[id(param)].items()):
            tensor, kind = _state_tensor(f"{name}.{key}", value)
            tensors[f"{name}.{key}"] = tensor
            state_keys[name].append(key)
            if kind is not None:
                scalars[f"{name}.{key}"] = kind
    meta = {
        "optimizer": optimizer,
        "param_groups": groups,
        "state_keys": state_keys,
        "scalars": scalars,
    }
    return tensors, meta


def read_sharded_state(
    sharded: ShardedOptimizer, modules: Iterable[nn.Module], specs: Sequence[LayerSpec], source: Any
) -> tuple[dict[int, dict[str, Any]], list[dict[str, Any]]]:
    """The stored state of every parameter ZeRO shards (by parameter id) and the stored
    hyper-parameters of the reference's groups, from any layout's optimizer index."""
    meta, where = source.metadata, str(source.index_path)
    ours = type(sharded.optimizer).__name__
    if meta.get("optimizer") != ours:
        saved = meta.get("optimizer")
        raise CheckpointError(f"{where} holds {saved} state but the run uses {ours}")
    groups = meta.get("param_groups")
    expected = len(sharded.reference_groups())
    if not isinstance(groups, list) or len(groups) != expected:
        raise CheckpointError(f"{where} has no {expected} parameter groups as the run's {ours}")
    state_keys: dict[str, list[str]] = meta.get("state_keys", {})
    scalars: dict[str, str] = meta.get("scalars", {})
    mine = {id(p) for p in sharded.params}
    state: dict[int, dict[str, Any]] = {}
    for module in modules:
        for name, param in module.named_parameters():
            if id(param) not in mine:
                continue
            stored = canonical_name(specs, name)
            if stored not in state_keys:
                raise CheckpointError(f"{where} holds no optimizer state for {stored!r}")
            entry = {}
            for key in state_keys[stored]:
                tensor = source.get(f"{stored}.{key}")
                if tensor.dim() and tensor.shape != param.shape:
                    raise CheckpointError(
                        f"{source.where(f'{stored}.{key}')}: tensor {stored}.{key} has shape "
                        f"{tuple(tensor.shape)} but {name!r} has {tuple(param.shape)}"
                    )
                entry[key] = _state_value(tensor, scalars.get(f"{stored}.{key}"), where)
            state[id(param)] = entry
    return state, [_from_json(g) for g in groups]


def gathered(
    params: Iterable[nn.Parameter], optimizer: torch.optim.Optimizer | None
) -> tuple[dict[int, torch.Tensor], dict[int, dict[str, Any]]]:
    """ZeRO-3: every parameter and its optimizer state whole, by parameter id (a collective
    all-gather of each DTensor shard over the replicas; every rank must call it alike)."""
    masters: dict[int, torch.Tensor] = {}
    states: dict[int, dict[str, Any]] = {}
    for param in params:
        masters[id(param)] = _whole(param.detach())
        state = optimizer.state.get(param, {}) if optimizer is not None else {}
        states[id(param)] = {key: _whole(value) for key, value in sorted(state.items())}
    return masters, states


def _whole(value: Any) -> Any:
    return value.full_tensor() if is_dtensor(value) else value


def like(param: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` placed as `param` is: its shard when `param` is a DTensor (ZeRO-3; no
    communication, every rank holds the whole tensor), else `tensor` itself."""
    if not is_dtensor(param) or is_dtensor(tensor) or tensor.shape != param.shape:
        return tensor
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(
        tensor.to(param.device), param.device_mesh, param.placements, src_data_rank=None
    )
