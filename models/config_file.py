"""A model shape from a file: `--model-config FILE.json` (our GPT or Llama fields, or a
Hugging Face `config.json`) and `--model hf:DIR` (the folder's `config.json`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from models.gpt import GPTConfig
from models.hf_config import model_config_from_hf
from models.llama import LlamaConfig

__all__ = ["FAMILIES", "HF_PREFIX", "read_model_config"]

HF_PREFIX = "hf:"
"""`--model hf:DIR`: the shape of the Hugging Face model in DIR."""
FAMILIES: dict[str, type[GPTConfig] | type[LlamaConfig]] = {"gpt": GPTConfig, "llama": LlamaConfig}
"""Our files' `family` and the config class whose fields the file holds."""


def _ours(values: dict[str, Any], where: Path) -> GPTConfig | LlamaConfig:
    family = values.get("family")
    if family not in FAMILIES:
        raise ValueError(
            f'{where}: family={family!r}; write "family": "gpt" or "llama" beside the '
            "fields of GPTConfig or LlamaConfig (or give a Hugging Face config.json)"
        )
    cls = FAMILIES[family]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    given = {k: v for k, v in values.items() if k != "family"}
    unknown = sorted(set(given) - set(fields))
    missing = sorted(n for n, f in fields.items() if f.default is dataclasses.MISSING)
    missing = [n for n in missing if n not in given]
    if unknown or missing:
        raise ValueError(
            f"{where}: {family} models have no fields {unknown} and need {missing}; "
            f"the fields are {sorted(fields)}"
        )
    if isinstance(given.get("rope_scaling"), list):
        given["rope_scaling"] = tuple(given["rope_scaling"])
    try:
        return cls(**given)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where} does not build a {family} model: {error}") from None


def read_model_config(spec: str | Path) -> GPTConfig | LlamaConfig:
    """The model of a JSON file of our fields (`{"family": "gpt", "n_layer": …}`), of a
    Hugging Face `config.json`, or of `hf:DIR`."""
    text = str(spec)
    path = Path(text.removeprefix(HF_PREFIX))
    if text.startswith(HF_PREFIX):
        path = path / "config.json"
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"model config {path} does not exist: give a JSON file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"model config {path} is unreadable ({error}): fix the file") from None
    if not isinstance(values, dict):
        raise ValueError(f"model config {path} holds no JSON object: give the model's fields")
    if "model_type" in values:
        return model_config_from_hf(values, path)
    return _ours(values, path)
