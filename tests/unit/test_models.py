"""Models as layer lists: same maths as a monolithic module, partition-independent weights."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from models import MODEL_CONFIGS, LayerSpec, build_layers, get_config, layer_specs, lm_loss
from models.gpt import GPTConfig
from models.layers import sliding_window_mask
from models.llama import LlamaConfig

torch.set_num_threads(1)


class MonolithicGPT(nn.Module):
    """GPT-2 written as one module, nanoGPT style, independently of the layer list."""

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.c = c
        self.wte = nn.Embedding(c.vocab_size, c.d_model)
        self.wpe = nn.Embedding(c.max_seq_len, c.d_model)
        self.blocks = nn.ModuleList()
        for _ in range(c.n_layer):
            block = nn.ModuleDict(
                {
                    "ln_1": nn.LayerNorm(c.d_model),
                    "qkv": nn.Linear(c.d_model, 3 * c.d_model),
                    "proj": nn.Linear(c.d_model, c.d_model),
                    "ln_2": nn.LayerNorm(c.d_model),
                    "fc": nn.Linear(c.d_model, 4 * c.d_model),
                    "out": nn.Linear(4 * c.d_model, c.d_model),
                }
            )
            self.blocks.append(block)
        self.ln_f = nn.LayerNorm(c.d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        h, hd = self.c.n_head, self.c.d_model // self.c.n_head
        x = self.wte(idx) + self.wpe(torch.arange(t))
        mask = torch.tril(torch.ones(t, t, dtype=torch.bool))
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["ln_1"](x)).split(self.c.d_model, dim=-1)
            q, k, v = (z.view(b, t, h, hd).transpose(1, 2) for z in (q, k, v))
            att = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
            att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
            x = x + blk["proj"]((att @ v).transpose(1, 2).reshape(b, t, -1))
            m = blk["fc"](blk["ln_2"](x))
            x = x + blk["out"](
                0.5 * m * (1 + torch.tanh(math.sqrt(2 / math.pi) * (m + 0.044715 * m**3)))
            )
        return self.ln_f(x) @ self.wte.weight.T


def _load_gpt(mono: MonolithicGPT, stack: nn.Module, n_layer: int) -> None:
    p = dict(stack.named_parameters())
    with torch.no_grad():
        mono.wte.weight.copy_(p["layers.0.wte.weight"])
        mono.wpe.weight.copy_(p["layers.0.wpe.weight"])
        for i, blk in enumerate(mono.blocks, start=1):
            a = f"layers.{i}.attn."
            for name, src in (("weight", "weight"), ("bias", "bias")):
                qkv = [p[a + f"{x}_proj.{src}"] for x in "qkv"]
                getattr(blk["qkv"], name).copy_(torch.cat(qkv))
                getattr(blk["proj"], name).copy_(p[a + f"o_proj.{src}"])
                getattr(blk["fc"], name).copy_(p[f"layers.{i}.mlp.fc.{src}"])
                getattr(blk["out"], name).copy_(p[f"layers.{i}.mlp.proj.{src}"])
                getattr(blk["ln_1"], name).copy_(p[f"layers.{i}.ln_1.{src}"])
                getattr(blk["ln_2"], name).copy_(p[f"layers.{i}.ln_2.{src}"])
        mono.ln_f.weight.copy_(p[f"layers.{n_layer + 1}.ln_f.weight"])
        mono.ln_f.bias.copy_(p[f"layers.{n_layer + 1}.ln_f.bias"])


def _reference_llama(p: dict[str, torch.Tensor], c: LlamaConfig, idx: torch.Tensor) -> torch.Tensor:
    """Llama forward from a flat parameter dict, with complex-number RoPE and explicit GQA."""
    b, t = idx.shape
    hd = c.d_model // c.n_head
    freqs = 1.0 / (c.rope_theta ** (torch.arange(0, hd, 2).float() / hd))
    rot = torch.polar(torch.ones(t, hd // 2), torch.outer(torch.arange(t).float(), freqs))

    def rope(z: torch.Tensor) -> torch.Tensor:  # (b, h, t, hd), half-split pairs
        zc = torch.complex(z[..., : hd // 2], z[..., hd // 2 :]) * rot
        return torch.cat((zc.real, zc.imag), dim=-1)

    def rms(z: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + c.norm_eps) * w

    x = F.embedding(idx, p["layers.0.embed_tokens.weight"])
    mask = torch.tril(torch.ones(t, t, dtype=torch.bool))
    for i in range(1, c.n_layer + 1):
        a, m = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        h = rms(x, p[f"layers.{i}.input_layernorm.weight"])
        q = (h @ p[a + "q_proj.weight"].T).view(b, t, c.n_head, hd).transpose(1, 2)
        k = (h @ p[a + "k_proj.weight"].T).view(b, t, c.n_kv_head, hd).transpose(1, 2)
        v = (h @ p[a + "v_proj.weight"].T).view(b, t, c.n_kv_head, hd).transpose(1, 2)
        q, k = rope(q), rope(k)
        rep = c.n_head // c.n_kv_head
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        att = ((q @ k.transpose(-2, -1)) / math.sqrt(hd)).masked_fill(~mask, float("-inf"))
        y = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, -1)
        x = x + y @ p[a + "o_proj.weight"].T
        h = rms(x, p[f"layers.{i}.post_attention_layernorm.weight"])
        gate, up = h @ p[m + "gate_proj.weight"].T, h @ p[m + "up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ p[m + "down_proj.weight"].T
    x = rms(x, p[f"layers.{c.n_layer + 1}.norm.weight"])
    return x @ p[f"layers.{c.n_layer + 2}.lm_head.weight"].T


def test_gpt_layer_list_equals_monolithic_gpt() -> None:
    config = get_config("gpt-tiny")
    assert isinstance(config, GPTConfig)
    stack = build_layers(layer_specs(config), seed=3)
    mono = MonolithicGPT(config)
    _load_gpt(mono, stack, config.n_layer)
    idx = torch.randint(0, config.vocab_size, (2, 32))
    torch.testing.assert_close(stack(idx), mono(idx), rtol=1e-5, atol=1e-5)


def test_llama_layer_list_equals_reference_llama() -> None:
    config = get_config("llama-tiny")
    assert isinstance(config, LlamaConfig) and config.n_kv_head < config.n_head
    stack = build_layers(layer_specs(config), seed=3)
    params = {name: p.detach() for name, p in stack.named_parameters()}
    idx = torch.randint(0, config.vocab_size, (2, 32))
    torch.testing.assert_close(
        stack(idx), _reference_llama(params, config, idx), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny"])
def test_initial_weights_do_not_depend_on_the_partition(model: str) -> None:
    specs = layer_specs(model)
    whole = build_layers(specs, seed=7).state_dict()
    for part in ([0, 1], [2, 3, 4], [5, 6]):
        for name, tensor in build_layers(specs, part, seed=7).state_dict().items():
            assert torch.equal(tensor, whole[name]), name


def test_initial_weights_depend_on_the_seed() -> None:
    specs = layer_specs("gpt-tiny")
    a = build_layers(specs, [1], seed=0).layers["1"].attn.q_proj.weight
    b = build_layers(specs, [1], seed=1).layers["1"].attn.q_proj.weight
    assert not torch.equal(a, b)


def test_blocks_of_one_model_start_different() -> None:
    stack = build_layers(layer_specs("gpt-tiny"), [1, 2], seed=0)
    assert not torch.equal(
        stack.layers["1"].attn.q_proj.weight, stack.layers["2"].attn.q_proj.weight
    )


def test_parameter_names_are_global() -> None:
    names = [
        n for n, _ in build_layers(layer_specs("llama-tiny"), [2, 3], seed=0).named_parameters()
    ]
    assert names[0] == "layers.2.input_layernorm.weight"
    assert all(n.startswith(("layers.2.", "layers.3.")) for n in names)


def test_tied_layers_in_one_stack_share_one_parameter() -> None:
    stack = build_layers(layer_specs("gpt-tiny"), seed=0)
    assert stack.layers["6"].weight is stack.layers["0"].wte.weight
    names = [n for n, _ in stack.named_parameters()]
    assert "layers.6.weight" not in names


def test_tied_layers_built_apart_start_equal() -> None:
    specs = layer_specs("gpt-tiny")
    head = build_layers(specs, [6], seed=5).layers["6"].weight
    embedding = build_layers(specs, [0], seed=5).layers["0"].wte.weight
    assert torch.equal(head, embedding)


def test_a_tied_llama_head_shares_the_token_embedding() -> None:
    config = replace(get_config("llama-tiny"), tie_embeddings=True)
    stack = build_layers(layer_specs(config), seed=0)
    assert stack.layers["6"].lm_head.weight is stack.layers["0"].embed_tokens.weight


def test_a_sliding_window_lets_each_position_see_itself_and_window_minus_one_before() -> None:
    assert sliding_window_mask(5, 2, torch.device("cpu")).int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 1, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 0, 1, 1],
    ]


def test_a_window_as_long_as_the_sequence_is_plain_causal_attention() -> None:
    tokens = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    plain = build_layers(layer_specs("llama-tiny"), seed=0)
    windowed = replace(get_config("llama-tiny"), sliding_window=16)
    assert torch.equal(build_layers(layer_specs(windowed), seed=0)(tokens), plain(tokens))


def test_a_window_shorter_than_the_sequence_changes_the_logits() -> None:
    tokens = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    plain = build_layers(layer_specs("llama-tiny"), seed=0)
    windowed = replace(get_config("llama-tiny"), sliding_window=8)
    out = build_layers(layer_specs(windowed), seed=0)(tokens)
    assert torch.equal(out[:, :8], plain(tokens)[:, :8])
    assert not torch.allclose(out[:, 8:], plain(tokens)[:, 8:])


def test_a_window_counts_only_the_attention_flops_it_computes() -> None:
    """seq 16, window 4: 16·4 - 4²/2 = 56 query-key pairs of the causal 16²/2 = 128."""

    def block(window: int | None) -> LayerSpec:
        return layer_specs(replace(get_config("llama-tiny"), sliding_window=window))[1]

    matmuls = block(None).forward_flops(1, 16) - 4 * 128 * 64
    assert block(4).forward_flops(1, 16) == matmuls + 4 * 56 * 64
    assert block(16).forward_flops(1, 16) == block(None).forward_flops(1, 16)


def test_a_window_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="sliding_window=0 leaves no position"):
        replace(get_config("llama-tiny"), sliding_window=0)


def test_specs_describe_their_layers() -> None:
    specs = layer_specs("gpt-tiny")
    assert [s.name for s in specs] == ["embedding"] + ["block"] * 4 + ["final_norm", "lm_head"]
    assert [s.kind for s in specs][:2] == ["GPTEmbedding", "GPTBlock"]
    assert specs[0].tie_key == specs[-1].tie_key == "token_embedding"
    assert specs[1].num_parameters() == 12 * 64 * 64 + 13 * 64


def test_tiny_models_have_a_few_hundred_thousand_parameters() -> None:
    for name in ("gpt-tiny", "llama-tiny"):
        total = sum(p.numel() for p in build_layers(layer_specs(name), seed=0).parameters())
        assert 100_000 < total < 1_000_000, (name, total)


@pytest.mark.parametrize(
    ("model", "billions"),
    [
        ("llama-7b", 6.74),
        ("llama-13b", 13.0),
        ("llama-70b", 69.0),
        ("llama3-8b", 8.03),
        ("llama3-70b", 70.55),
        ("llama3-405b", 405.85),
    ],
)
def test_real_shapes_are_counted_on_meta_without_memory(model: str, billions: float) -> None:
    total = sum(spec.num_parameters() for spec in layer_specs(model))
    assert total / 1e9 == pytest.approx(billions, rel=0.01)


def test_gpt2_has_124m_parameters_counting_the_tie_once() -> None:
    specs = layer_specs("gpt2")
    total = sum(s.num_parameters() for s in specs) - specs[-1].num_parameters()
    assert total / 1e6 == pytest.approx(124.4, rel=0.01)


def test_unknown_model_lists_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown model 'gpt5'.*gpt-tiny"):
        get_config("gpt5")


def test_sequence_longer_than_context_is_rejected() -> None:
    stack = build_layers(layer_specs("gpt-tiny"), [0], seed=0)
    with pytest.raises(ValueError, match="exceeds the model's context 128"):
        stack(torch.zeros(1, 129, dtype=torch.long))


def test_layer_index_out_of_range_is_rejected() -> None:
    with pytest.raises(ValueError, match="out of range"):
        build_layers(layer_specs("gpt-tiny"), [7], seed=0)


def test_lm_loss_of_uniform_logits_is_log_vocab() -> None:
    loss = lm_loss(torch.zeros(2, 5, 256), torch.zeros(2, 5, dtype=torch.long))
    assert loss.item() == pytest.approx(math.log(256))


def test_registry_has_the_promised_shapes() -> None:
    names = ("gpt2", "gpt2-xl", "llama-1b", "llama-7b", "llama-13b", "llama-70b", "llama3-405b")
    for name in names:
        assert name in MODEL_CONFIGS
