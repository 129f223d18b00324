"""Hugging Face interchange: our global names to and from `GPT2LMHeadModel` and
`LlamaForCausalLM` names, with a `config.json` each side understands.

Each HF tensor is a *rule*: the concatenation of one or more of our tensors along dim 0,
transposed for GPT-2's Conv1D layers (`c_attn` is q, k, v stacked). Export applies the rules,
import inverts them, so a round trip is exact. Llama block names already follow HF's and our
rotary uses HF's half-split layout, so Llama needs renames only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from engine.checkpoint_files import (
    MODEL_INDEX,
    PASS_IT_FIX,
    TRAINER_FILE,
    CheckpointError,
    TensorReader,
    atomic_write_text,
    canonical_name,
    checkpoint_candidates,
    expected_names,
    has_checkpoint,
    model_config_from_dict,
    new_directory,
    read_json,
    read_trainer,
    save_weights,
    write_index,
    write_shard,
)
from engine.weights import TensorSource, check_names
from models import GPTConfig, LayerSpec, LlamaConfig, ModelConfig

__all__ = [
    "HFSource",
    "export_hf",
    "hf_config",
    "hf_rules",
    "import_hf",
    "model_config_from_hf",
    "open_model",
    "open_weights",
]

HF_CONFIG = "config.json"
HF_SINGLE = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"

_GPT_BLOCK = {  # our local name -> (HF local name, transposed)
    "ln_1.weight": ("ln_1.weight", False),
    "ln_1.bias": ("ln_1.bias", False),
    "attn.q_proj.weight": ("attn.c_attn.weight", True),
    "attn.k_proj.weight": ("attn.c_attn.weight", True),
    "attn.v_proj.weight": ("attn.c_attn.weight", True),
    "attn.q_proj.bias": ("attn.c_attn.bias", False),
    "attn.k_proj.bias": ("attn.c_attn.bias", False),
    "attn.v_proj.bias": ("attn.c_attn.bias", False),
    "attn.o_proj.weight": ("attn.c_proj.weight", True),
    "attn.o_proj.bias": ("attn.c_proj.bias", False),
    "ln_2.weight": ("ln_2.weight", False),
    "ln_2.bias": ("ln_2.bias", False),
    "mlp.fc.weight": ("mlp.c_fc.weight", True),
    "mlp.fc.bias": ("mlp.c_fc.bias", False),
    "mlp.proj.weight": ("mlp.c_proj.weight", True),
    "mlp.proj.bias": ("mlp.c_proj.bias", False),
}


@dataclass(frozen=True, kw_only=True)
class _Rule:
    hf: str
    """The HF tensor's name."""
    ours: tuple[str, ...]
    """Our stored names, concatenated along dim 0 in this order."""
    transpose: bool
    """GPT-2's Conv1D stores (in, out): transpose after concatenating."""


def _hf_name(config: ModelConfig, spec: LayerSpec, block: int, local: str) -> tuple[str, bool]:
    gpt = isinstance(config, GPTConfig)
    if spec.name == "block":
        name, transpose = _GPT_BLOCK[local] if gpt else (local, False)
        return (f"transformer.h.{block}." if gpt else f"model.layers.{block}.") + name, transpose
    if spec.name == "lm_head":
        return "lm_head.weight", False
    return ("transformer." if gpt else "model.") + local, False


def hf_rules(config: ModelConfig) -> list[_Rule]:
    """How every stored tensor of `config`'s model maps onto HF names (tied copies skipped)."""
    specs = config.layer_specs()
    groups: dict[str, tuple[list[str], bool]] = {}
    for i, spec in enumerate(specs):
        for local, _ in spec.build("meta").named_parameters():
            ours = f"layers.{i}.{local}"
            if canonical_name(specs, ours) != ours:
                continue
            hf, transpose = _hf_name(config, spec, i - 1, local)
            groups.setdefault(hf, ([], transpose))[0].append(ours)
    return [_Rule(hf=k, ours=tuple(v), transpose=t) for k, (v, t) in groups.items()]


_NO_SPECIAL_TOKENS = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
"""The byte tokenizer (`engine.data`) has no begin/end-of-text or padding token: its 256 ids
are the 256 byte values, and files are joined by a plain newline byte. Left out, HF would
fill in GPT-2's 50256 (outside our vocabulary) or Llama's 1 and 2 (real bytes, not markers)."""


def hf_config(config: ModelConfig) -> dict[str, Any]:
    """`config.json` for HF's `GPT2LMHeadModel` or `LlamaForCausalLM`."""
    if isinstance(config, GPTConfig):
        if not config.bias:
            raise CheckpointError("HF GPT-2 has biases; a model with bias=False cannot export")
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": config.vocab_size,
            "n_positions": config.max_seq_len,
            "n_embd": config.d_model,
            "n_layer": config.n_layer,
            "n_head": config.n_head,
            "n_inner": None,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": 1e-5,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "tie_word_embeddings": config.tie_embeddings,
            "torch_dtype": "float32",
            **_NO_SPECIAL_TOKENS,
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.ffn_hidden,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_kv_head,
        "head_dim": config.d_model // config.n_head,
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        **_NO_SPECIAL_TOKENS,
    }


def _require(ok: bool, where: Path, what: str) -> None:
    if not ok:
        raise CheckpointError(f"{where}: {what}; meshpipe cannot represent this model")


def _gpt_from_hf(hf: Mapping[str, Any], where: Path) -> GPTConfig:
    d = int(hf["n_embd"])
    _require(hf.get("n_inner") in (None, 4 * d), where, f"n_inner={hf.get('n_inner')} != 4·n_embd")
    act = hf.get("activation_function", "gelu_new")
    tanh = act in ("gelu_new", "gelu_pytorch_tanh")
    _require(tanh, where, f"activation {act!r} is not tanh-GELU")
    eps = hf.get("layer_norm_epsilon", 1e-5)
    _require(eps == 1e-5, where, f"layer_norm_epsilon={eps}, ours is 1e-5")
    return GPTConfig(
        vocab_size=int(hf["vocab_size"]),
        n_layer=int(hf["n_layer"]),
        n_head=int(hf["n_head"]),
        d_model=d,
        max_seq_len=int(hf["n_positions"]),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
    )


def _llama_from_hf(hf: Mapping[str, Any], where: Path) -> LlamaConfig:
    d, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    _require(rope.get("rope_type", "default") == "default", where, f"rope scaling {rope}")
    _require(hf.get("hidden_act", "silu") == "silu", where, f"hidden_act={hf.get('hidden_act')}")
    _require(not hf.get("attention_bias") and not hf.get("mlp_bias"), where, "it has biases")
    _require(hf.get("head_dim", d // heads) == d // heads, where, "head_dim != hidden/heads")
    return LlamaConfig(
        vocab_size=int(hf["vocab_size"]),
        n_layer=int(hf["num_hidden_layers"]),
        n_head=heads,
        n_kv_head=int(hf.get("num_key_value_heads", heads)),
        d_model=d,
        ffn_hidden=int(hf["intermediate_size"]),
        max_seq_len=int(hf["max_position_embeddings"]),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
    )


def model_config_from_hf(hf: Mapping[str, Any], where: Path) -> ModelConfig:
    """Our config for an HF `config.json` (GPT-2 or Llama), or a CheckpointError saying why not."""
    kind = hf.get("model_type")
    try:
        if kind == "gpt2":
            return _gpt_from_hf(hf, where)
        if kind == "llama":
            return _llama_from_hf(hf, where)
    except CheckpointError:
        raise
    except KeyError as missing:
        raise CheckpointError(f"{where} lacks {missing}") from None
    except (TypeError, ValueError, AttributeError) as error:  # a null, a string, a bad shape
        raise CheckpointError(
            f"{where} does not describe a model meshpipe can build ({error}): "
            "fix the file or re-export the model"
        ) from None
    raise CheckpointError(f"{where} has model_type {kind!r}; meshpipe reads 'gpt2' and 'llama'")


def _corrupt(path: Path, error: SafetensorError) -> CheckpointError:
    return CheckpointError(f"{path} is corrupt or truncated ({error}): re-download or re-export it")


def _hf_files(folder: Path, prefix: str) -> dict[str, tuple[str, str]]:
    """HF tensor name -> (file, name in the file), from the sharded index or the single file.

    Files saved from the base model (GPT-2 on the Hub: `h.0.…`, `wte.weight`) lack the
    `transformer.` / `model.` prefix; they are found under the prefixed name too.
    """
    if (folder / HF_INDEX).is_file():
        weight_map = read_json(folder / HF_INDEX).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{folder / HF_INDEX} has no weight_map")
    elif (folder / HF_SINGLE).is_file():
        try:
            with safe_open(str(folder / HF_SINGLE), framework="pt") as f:
                weight_map = dict.fromkeys(f.keys(), HF_SINGLE)
        except SafetensorError as error:
            raise _corrupt(folder / HF_SINGLE, error) from None
    else:
        raise CheckpointError(f"{folder} holds neither {HF_SINGLE} nor {HF_INDEX}")
    files = {name: (file, name) for name, file in weight_map.items()}
    for name, file in weight_map.items():
        files.setdefault(prefix + name, (file, name))
    return files


def _check_hf_folder(folder: Path) -> None:
    """`folder` is a directory with a `config.json`, or a CheckpointError saying what it is."""
    if not folder.exists():
        raise CheckpointError(f"{folder} does not exist")
    if not folder.is_dir():
        raise CheckpointError(
            f"{folder} is not a folder: pass the Hugging Face model's folder, the one holding "
            f"{HF_CONFIG} and {HF_SINGLE} (or {HF_INDEX} and its shards)"
        )
    if not (folder / HF_CONFIG).is_file():
        raise CheckpointError(
            f"{folder} has no {HF_CONFIG}, so it is not a Hugging Face model folder: pass the "
            f"folder holding {HF_CONFIG} and {HF_SINGLE} (or {HF_INDEX} and its shards)"
        )


class HFSource:
    """An HF folder seen under our stored names (a `TensorSource`); tensors read lazily."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        _check_hf_folder(self.folder)
        hf = read_json(self.folder / HF_CONFIG)
        self.config = model_config_from_hf(hf, self.folder / HF_CONFIG)
        prefix = "transformer." if isinstance(self.config, GPTConfig) else "model."
        self._files = _hf_files(self.folder, prefix)
        rules = hf_rules(self.config)
        if isinstance(self.config, LlamaConfig) and hf.get("tie_word_embeddings"):
            rules = [
                _Rule(hf="model.embed_tokens.weight", ours=r.ours, transpose=False)
                if r.hf == "lm_head.weight"
                else r
                for r in rules
            ]
        self._rule = {ours: (rule, j) for rule in rules for j, ours in enumerate(rule.ours)}
        self._names = frozenset(n for n, (r, _) in self._rule.items() if r.hf in self._files)
        self._cache: tuple[str, torch.Tensor] | None = None

    @property
    def names(self) -> frozenset[str]:
        """Our stored names whose HF tensor the folder holds."""
        return self._names

    def where(self, name: str) -> str:
        rule = self._rule.get(name)
        found = self._files.get(rule[0].hf) if rule else None
        return str(self.folder / found[0]) if found else str(self.folder)

    def _read(self, hf: str) -> torch.Tensor:
        if self._cache is None or self._cache[0] != hf:
            file, stored = self._files[hf]
            self._cache = (hf, self._read_file(self.folder / file, stored))
        return self._cache[1]

    def _read_file(self, path: Path, stored: str) -> torch.Tensor:
        """Tensor `stored` of a file the index (or the single file's own header) lists."""
        index = self.folder / HF_INDEX
        if not path.is_file():
            raise CheckpointError(
                f"{index} points at {path.name}, which does not exist: "
                "the download is incomplete; re-download or re-export the folder"
            )
        try:
            with safe_open(str(path), framework="pt") as f:
                tensor = f.get_tensor(stored) if stored in f.keys() else None  # noqa: SIM118
        except SafetensorError as error:
            raise _corrupt(path, error) from None
        if tensor is None:
            raise CheckpointError(
                f"{path} lacks tensor {stored!r}, which {index} places there: the folder is "
                "incomplete or its files are mixed up; re-download or re-export it"
            )
        return tensor

    def get(self, name: str) -> torch.Tensor:
        if name not in self.names:
            raise CheckpointError(f"tensor {name!r} has no source in {self.folder}")
        rule, j = self._rule[name]
        tensor = self._read(rule.hf)
        tensor = tensor.T if rule.transpose else tensor
        return tensor.chunk(len(rule.ours))[j].contiguous()


def open_model(path: str | Path) -> tuple[ModelConfig, TensorSource]:
    """The model config and weights of an HF folder or a meshpipe checkpoint (or its root).

    A sharded HF folder has an index under the same name as ours (`HF_INDEX == MODEL_INDEX`),
    so the index cannot tell them apart: an HF folder has `config.json` and no `trainer.json`.
    """
    path = Path(path)
    if (path / HF_CONFIG).is_file() and not (path / TRAINER_FILE).is_file():
        source = HFSource(path)
        return source.config, source
    directory = checkpoint_candidates(path, fix=PASS_IT_FIX)[0]
    config = model_config_from_dict(read_trainer(directory).get("model", {}))
    return config, TensorReader(directory, MODEL_INDEX)


def open_weights(path: str | Path, config: ModelConfig) -> TensorSource:
    """Weights for a run of `config`'s model; a different shape is an error naming both."""
    saved, source = open_model(path)
    if saved != config:
        raise CheckpointError(
            f"{path} holds {saved}, but the run builds {config}: pick the matching --model"
        )
    return source


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def export_hf(checkpoint: str | Path, out: str | Path, *, max_shard_bytes: int = 5 << 30) -> Path:
    """Write `config.json` and `model.safetensors` (sharded with an index past
    `max_shard_bytes`) that `transformers` loads as GPT2LMHeadModel / LlamaForCausalLM.

    Everything is checked before the first byte is written, and the folder appears at `out`
    complete or not at all."""
    if (
        isinstance(max_shard_bytes, bool)
        or not isinstance(max_shard_bytes, int)
        or max_shard_bytes < 1
    ):
        raise ValueError(
            f"max_shard_bytes={max_shard_bytes!r} (--max-shard-bytes) must be a positive int: "
            f"the largest shard in bytes, e.g. {5 << 30} (5 GiB, the default when left out)"
        )
    config, source = open_model(checkpoint)
    hf = hf_config(config)  # refuses what HF cannot represent before any tensor is read
    check_names(source, config.layer_specs())
    tensors = {}
    for rule in hf_rules(config):
        joined = torch.cat([source.get(name) for name in rule.ours])
        tensors[rule.hf] = (joined.T if rule.transpose else joined).contiguous()
    shards = _shards(tensors, max_shard_bytes)
    with new_directory(out) as tmp:
        if len(shards) == 1:
            write_shard(tmp, HF_SINGLE, shards[0])
        else:
            n = len(shards)
            files = [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
            records = [write_shard(tmp, f, s) for f, s in zip(files, shards, strict=True)]
            write_index(tmp / HF_INDEX, records, {})
        atomic_write_text(tmp / HF_CONFIG, json.dumps(hf, indent=1) + "\n")
    return Path(out)


def import_hf(folder: str | Path, out: str | Path) -> Path:
    """A meshpipe checkpoint (weights only, one stage) from an HF GPT-2 or Llama folder."""
    folder = Path(folder)
    if (folder / TRAINER_FILE).is_file() or has_checkpoint(folder):
        raise CheckpointError(
            f"{folder} is already a meshpipe checkpoint, not a Hugging Face folder: nothing to "
            f"import; `meshpipe train --init-from {folder}` and "
            f"`meshpipe generate --checkpoint {folder}` take it directly"
        )
    source = HFSource(folder)
    specs = source.config.layer_specs()
    check_names(source, specs)
    tensors = {name: source.get(name) for name in sorted(expected_names(specs))}
    return save_weights(out, specs, tensors)
