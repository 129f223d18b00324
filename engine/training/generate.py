"""Text from a trained model: greedy or sampled decoding in one process, with the tokenizer
the model carries (the byte tokenizer when it carries none).

Decoding recomputes the whole window per token (no KV cache): the models this is for are the
small ones a laptop trains, and one code path with training's forward keeps it exact.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.checkpoint.hf_interop import model_folder, open_model, tokenizer_files
from engine.checkpoint.weights import load_module_weights
from engine.training.data import VOCAB_SIZE
from engine.training.tokenizer import (
    TOKENIZER_FILE,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
)
from models import LayerStack, ModelConfig, build_layers

__all__ = ["encode_prompt", "generate", "generate_text", "load_model", "model_tokenizer"]


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
    vocab: int = VOCAB_SIZE,
) -> torch.Tensor:
    """`prompt` (1-D token ids) followed by `max_new_tokens` new ones.

    Temperature 0 is greedy; otherwise softmax(logits / T), keeping only the `top_k` largest
    when `top_k` > 0, sampled with a generator seeded by `seed`. Only ids below `vocab` (the
    tokenizer's) are ever produced, so the output always decodes.
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
        logits = model(tokens[-context:].unsqueeze(0))[0, -1, :vocab].float()
        tokens = torch.cat([tokens, _pick(logits, temperature, top_k, generator).view(1)])
    return tokens


def model_tokenizer(path: str | Path, config: ModelConfig, given: str | None = None) -> Tokenizer:
    """The tokenizer the model at `path` carries; `given` (--tokenizer) must be that one, and
    is used where the model carries none (else the byte tokenizer)."""
    text = tokenizer_files(path).get(TOKENIZER_FILE)
    where = str(model_folder(path) / TOKENIZER_FILE)
    carried = None if text is None else HFTokenizer(text, where)
    chosen = None if given is None else load_tokenizer(given)
    if carried is not None and chosen is not None and chosen.sha256 != carried.sha256:
        raise ValueError(
            f"--tokenizer {given} is not the tokenizer {path} was trained with ({where}): "
            "leave --tokenizer out to use the model's own"
        )
    tokenizer = carried or chosen or ByteTokenizer()
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"the tokenizer {tokenizer.name} has {tokenizer.vocab_size} tokens but {path} "
            f"embeds only {config.vocab_size}: pass the model's own with --tokenizer"
        )
    return tokenizer


def encode_prompt(tokenizer: Tokenizer, prompt: str) -> torch.Tensor:
    """The prompt's ids, refused when the tokenizer cannot encode it faithfully."""
    ids = tokenizer.encode(prompt)
    if not ids:
        raise ValueError("the prompt is empty: give at least one token of text")
    if tokenizer.unk_id is not None and tokenizer.unk_id in ids:
        raise ValueError(
            f"the prompt {prompt!r} holds text the model's tokenizer ({tokenizer.name}) cannot "
            "encode (it becomes the unknown token): rephrase it with text the model was "
            "trained on"
        )
    return torch.tensor(ids, dtype=torch.long)


def generate_text(
    path: str | Path,
    prompt: str,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
    tokenizer: str | None = None,
) -> str:
    """The prompt and its continuation, as text, from the model saved at `path` (decoded
    with the tokenizer it carries, or `tokenizer`)."""
    model, config = load_model(path)
    chosen = model_tokenizer(path, config, tokenizer)
    tokens = generate(
        model,
        encode_prompt(chosen, prompt),
        max_new_tokens=max_new_tokens,
        context=config.max_seq_len,
        temperature=temperature,
        top_k=top_k,
        seed=seed,
        vocab=chosen.vocab_size,
    )
    return chosen.decode(tokens.tolist())
