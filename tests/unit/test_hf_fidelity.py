"""Every Hugging Face config field that changes what a model computes is honoured (the imported
model's logits equal `transformers`' within 1e-5) or refused with an error naming the field;
Llama's tied embeddings, Mistral and Qwen2 import and export back as they were."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from engine.checkpoint.files import CheckpointError
from engine.checkpoint.hf_configs import model_config_from_hf
from engine.checkpoint.hf_interop import export_hf, import_hf
from engine.cli.main import main
from engine.training.generate import generate, load_model

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

torch.set_num_threads(1)

NO_TOKENS = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
GPT2_SHAPE = {"vocab_size": 256, "n_positions": 64, "n_embd": 32, "n_layer": 2, "n_head": 4}
LLAMA_SHAPE = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2,
                   max_position_embeddings=64)  # fmt: skip
SHAPES = {"gpt2": GPT2_SHAPE, "llama": LLAMA_SHAPE, "mistral": LLAMA_SHAPE, "qwen2": LLAMA_SHAPE}
# head_dim 8 and theta 100: wavelengths 6.3, 20, 63 and 199 positions, so with an original
# context of 32 one is kept (< 32/4), one blended and two stretched (> 32/1).
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=100.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=32)  # fmt: skip
LINEAR_ROPE = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))


def _hf_model(family: str, fields: dict[str, Any]) -> Any:
    """A tiny HF model of `family` with every parameter drawn at random (biases and norms too,
    so that a dropped bias or a wrong epsilon shows in the logits)."""
    config = transformers.AutoConfig.for_model(family, **SHAPES[family], **NO_TOKENS, **fields)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return model.eval()


def _saved(tmp_path: Path, family: str, fields: dict[str, Any]) -> tuple[Any, Path]:
    model = _hf_model(family, fields)
    model.save_pretrained(tmp_path / "hf")
    return model, tmp_path / "hf"


def _assert_same_logits(ours_at: Path, theirs: Any, tokens: torch.Tensor = TOKENS) -> None:
    ours, _ = load_model(ours_at)
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=0, atol=1e-5)


HONOURED = [
    ("gpt2", {}),
    ("gpt2", {"activation_function": "gelu_pytorch_tanh"}),
    ("gpt2", {"reorder_and_upcast_attn": True}),
    ("gpt2", {"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1}),
    ("gpt2", {"tie_word_embeddings": False}),
    ("gpt2", {"layer_norm_epsilon": 1e-3}),
    ("gpt2", {"n_inner": 48}),
    ("llama", {}),
    ("llama", {"attention_bias": True}),
    ("llama", {"mlp_bias": True}),
    ("llama", {"rms_norm_eps": 1e-3}),
    ("llama", {"tie_word_embeddings": True}),
    ("llama", {"pretraining_tp": 2}),
    ("llama", {"attention_dropout": 0.1}),
    ("llama", {"head_dim": 16}),  # 4 heads of 16 in a width of 32, as Qwen3 and Mistral Nemo
    ("llama", {"rope_parameters": LLAMA3_ROPE}),
    ("llama", {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": True}),  # Llama 3.2 1B
    ("mistral", {"sliding_window": None}),
    ("mistral", {"sliding_window": 5}),
    ("mistral", {"sliding_window": 64}),
    ("mistral", {"sliding_window": None, "head_dim": 16}),
    ("qwen2", {}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 0}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 2}),
    ("qwen2", {"tie_word_embeddings": True}),
]

REFUSED = [
    ("gpt2", {"scale_attn_weights": False}, "scale_attn_weights"),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ("gpt2", {"activation_function": "relu"}, "activation_function"),
    ("gpt2", {"add_cross_attention": True}, "add_cross_attention"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act"),
    ("llama", {"rope_parameters": LINEAR_ROPE}, "rope_parameters"),
    ("llama", {"rope_parameters": {**LLAMA3_ROPE, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1},
     "use_sliding_window"),
]  # fmt: skip


def _case_id(case: tuple[Any, ...]) -> str:
    return case[0] + "".join(f"-{k}={v}" for k, v in case[1].items())


@pytest.mark.parametrize(("family", "fields"), HONOURED, ids=map(_case_id, HONOURED))
def test_a_field_meshpipe_honours_imports_with_transformers_logits(
    tmp_path: Path, family: str, fields: dict[str, Any]
) -> None:
    theirs, folder = _saved(tmp_path, family, fields)
    import_hf(folder, tmp_path / "ck")
    _assert_same_logits(tmp_path / "ck", theirs)


@pytest.mark.parametrize(("family", "fields", "field"), REFUSED, ids=map(_case_id, REFUSED))
def test_a_field_meshpipe_cannot_compute_is_refused_by_name(
    tmp_path: Path, family: str, fields: dict[str, Any], field: str
) -> None:
    _, folder = _saved(tmp_path, family, fields)
    with pytest.raises(CheckpointError, match=rf"config.json: {field}=.*refuses it rather"):
        import_hf(folder, tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


def test_importing_a_model_with_dropout_says_meshpipe_trains_without_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, folder = _saved(tmp_path, "gpt2", {"resid_pdrop": 0.1, "attn_pdrop": 0.0, "embd_pdrop": 0.0})
    assert main(["import", str(folder), "--out", str(tmp_path / "ck")]) == 0
    err = capsys.readouterr().err
    assert "note: resid_pdrop=0.1 not applied" in err and "trains without dropout" in err
    assert "attn_pdrop" not in err


def test_a_mistral_without_a_window_exports_as_the_llama_it_is(tmp_path: Path) -> None:
    _, folder = _saved(tmp_path, "mistral", {"sliding_window": None})
    import_hf(folder, tmp_path / "ck")
    export_hf(tmp_path / "ck", tmp_path / "out")
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["architectures"] == ["LlamaForCausalLM"]


def test_a_tied_llama_stays_tied_in_meshpipe(tmp_path: Path) -> None:
    _, folder = _saved(tmp_path, "llama", {"tie_word_embeddings": True})
    model, config = load_model(folder)
    head, embedding = model.layers["4"].lm_head.weight, model.layers["0"].embed_tokens.weight
    assert config.tie_embeddings and head is embedding


def test_a_tied_llama_exports_tied_and_without_a_separate_head(tmp_path: Path) -> None:
    theirs, folder = _saved(tmp_path, "llama", {"tie_word_embeddings": True})
    import_hf(folder, tmp_path / "ck")
    export_hf(tmp_path / "ck", tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"]
    assert "lm_head.weight" not in load_file(tmp_path / "out" / "model.safetensors")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        torch.testing.assert_close(back(TOKENS).logits, theirs(TOKENS).logits, rtol=0, atol=1e-5)


ROUND_TRIPS = [
    ("gpt2", {"n_inner": 48, "layer_norm_epsilon": 1e-3}),
    ("llama", {"attention_bias": True, "mlp_bias": True}),
    ("llama", {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": True}),
    ("mistral", {"sliding_window": 5}),
    ("llama", {"head_dim": 16}),
    ("qwen2", {}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 0}),
]


@pytest.mark.parametrize(("family", "fields"), ROUND_TRIPS, ids=map(_case_id, ROUND_TRIPS))
def test_an_import_exports_back_to_its_own_architecture(
    tmp_path: Path, family: str, fields: dict[str, Any]
) -> None:
    theirs, folder = _saved(tmp_path, family, fields)
    import_hf(folder, tmp_path / "ck")
    export_hf(tmp_path / "ck", tmp_path / "out")
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["model_type"] == family
    assert exported["architectures"] == theirs.config.architectures
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(TOKENS).logits, theirs(TOKENS).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("family", "fields"),
    [("mistral", {"sliding_window": 5}), ("qwen2", {})],
    ids=["mistral-window-5", "qwen2"],
)
def test_greedy_generation_equals_transformers(
    tmp_path: Path, family: str, fields: dict[str, Any]
) -> None:
    """Past the window too: the prompt and continuation are longer than 5 tokens."""
    theirs, folder = _saved(tmp_path, family, fields)
    prompt = TOKENS[0, :8]
    ours, _ = load_model(folder)
    mine = generate(ours, prompt, max_new_tokens=12, context=64)
    expected = theirs.generate(prompt[None], max_new_tokens=12, do_sample=False)[0]
    assert torch.equal(mine, expected)


# config.json as the Hub ships them (transformers 4 wrote `rope_scaling`, not `rope_parameters`).

HUB_SHAPE = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
             "hidden_act": "silu"}  # fmt: skip
HUB_CONFIGS = {
    "llama-3.2": {**HUB_SHAPE, "model_type": "llama", "tie_word_embeddings": True,
                  "head_dim": 16, "attention_bias": False, "mlp_bias": False,
                  "pretraining_tp": 1, "rope_theta": 500000.0,
                  "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0,
                                   "low_freq_factor": 1.0, "rope_type": "llama3",
                                   "original_max_position_embeddings": 8192}},
    "mistral-7b-v0.1": {**HUB_SHAPE, "model_type": "mistral", "sliding_window": 4096,
                        "rope_theta": 10000.0, "tie_word_embeddings": False},
    "qwen2.5": {**HUB_SHAPE, "model_type": "qwen2", "use_sliding_window": False,
                "sliding_window": 32768, "max_window_layers": 21, "rope_scaling": None,
                "tie_word_embeddings": True, "rope_theta": 1000000.0, "attention_dropout": 0.0},
}  # fmt: skip
HUB_EXPECTED = {
    "llama-3.2": {"tie_embeddings": True, "rope_scaling": (32.0, 1.0, 4.0, 8192),
                  "rope_theta": 500000.0, "head_dim": None},
    "mistral-7b-v0.1": {"sliding_window": 4096, "qkv_bias": False},
    "qwen2.5": {"qkv_bias": True, "o_bias": False, "sliding_window": None,
                "tie_embeddings": True},
}  # fmt: skip


@pytest.mark.parametrize("name", HUB_CONFIGS)
def test_hub_configs_of_transformers_4_read_as_their_models(name: str) -> None:
    config = model_config_from_hf(HUB_CONFIGS[name], Path("config.json"))
    assert {k: getattr(config, k) for k in HUB_EXPECTED[name]} == HUB_EXPECTED[name]


def test_a_transformers_4_rope_scaling_of_another_type_is_refused_by_name() -> None:
    linear = {**HUB_CONFIGS["llama-3.2"], "rope_scaling": {"type": "linear", "factor": 2.0}}
    with pytest.raises(CheckpointError, match=r"config.json: rope_scaling=\{'type': 'linear'"):
        model_config_from_hf(linear, Path("config.json"))
