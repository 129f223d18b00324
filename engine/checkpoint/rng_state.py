"""A rank's random-number generators as JSON, so a resumed run draws what the original would.

Training consumes no randomness today (no dropout; batches come from (seed, step)), but any
future sampling must not make a resume diverge silently: torch (CPU and every CUDA device),
NumPy's global generator and Python's `random` are saved per rank and restored when the
resumed run has the same pp × dp × tp layout.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["capture_rng", "restore_rng", "rng_file"]


def rng_file(rank: int) -> str:
    """The file holding global rank `rank`'s generator states in a checkpoint."""
    return f"rng-rank{rank:05d}.json"


def _hex(state: torch.Tensor) -> str:
    return bytes(state.tolist()).hex()


def _bytes(text: str) -> torch.Tensor:
    return torch.tensor(list(bytes.fromhex(text)), dtype=torch.uint8)


def capture_rng() -> dict[str, Any]:
    """This process's generator states, JSON-serialisable."""
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    version, internal, gauss = random.getstate()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return {
        "torch_cpu": _hex(torch.get_rng_state()),
        "torch_cuda": [_hex(s) for s in cuda],
        "numpy": [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
        "python": [version, list(internal), gauss],
    }


def restore_rng(state: dict[str, Any]) -> None:
    """Set this process's generators from `capture_rng`'s output."""
    torch.set_rng_state(_bytes(state["torch_cpu"]))
    cuda = state.get("torch_cuda", [])
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([_bytes(s) for s in cuda])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
