"""Text from a trained model: greedy or sampled decoding in one process, byte tokenizer.

Decoding recomputes the whole window per token (no KV cache): the models this is for are the
small ones a laptop trains, and one code path with training's forward keeps it exact.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.checkpoint.hf_interop import open_model
from engine.checkpoint.weights import load_module_weights
from engine.training.data import VOCAB_SIZE, decode, encode
from models import LayerStack, ModelConfig, build_layers

__all__ = ["generate", "generate_text", "load_model"]


def load_model(path: str | Path) -> tuple[LayerStack, ModelConfig]:
    """The whole model of a checkpoint (or its root, or an HF folder), in eval mode on CPU."""
    config, source = open_model(path)
    specs = config.layer_specs()
    model = build_layers(specs, seed=0)
    load_module_weights(model, specs, source)
    return model.eval(), config


def _pick(
    logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator
) -> torch.Tensor:
    if temperature == 0:
        return logits.argmax()
    logits = logits / temperature
    if top_k:
        kth = logits.topk(min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[0]


@torch.no_grad()
def generate(
    model: LayerStack,
    prompt: torch.Tensor,
    *,
    max_new_tokens: int,
    context: int,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
) -> torch.Tensor:
    """`prompt` (1-D token ids) followed by `max_new_tokens` new ones.

    Temperature 0 is greedy; otherwise softmax(logits / T), keeping only the `top_k` largest
    when `top_k` > 0, sampled with a generator seeded by `seed`. Only the byte tokenizer's
    ids are ever produced, so the output always decodes.
    """
    if prompt.dim() != 1 or prompt.numel() == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if temperature < 0 or top_k < 0 or max_new_tokens < 0:
        raise ValueError(
            f"temperature={temperature}, top_k={top_k}, max_new_tokens={max_new_tokens} "
            "must all be >= 0"
        )
    generator = torch.Generator().manual_seed(seed)
    tokens = prompt.to(torch.long)
    for _ in range(max_new_tokens):
        logits = model(tokens[-context:].unsqueeze(0))[0, -1, :VOCAB_SIZE].float()
        tokens = torch.cat([tokens, _pick(logits, temperature, top_k, generator).view(1)])
    return tokens


def generate_text(
    path: str | Path,
    prompt: str,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
) -> str:
    """The prompt and its continuation, as text, from the model saved at `path`."""
    model, config = load_model(path)
    if config.vocab_size < VOCAB_SIZE:
        raise ValueError(
            f"{path} has a vocabulary of {config.vocab_size}; the byte tokenizer needs {VOCAB_SIZE}"
        )
    tokens = generate(
        model,
        torch.from_numpy(encode(prompt)).long(),
        max_new_tokens=max_new_tokens,
        context=config.max_seq_len,
        temperature=temperature,
        top_k=top_k,
        seed=seed,
    )
    return decode(tokens)
