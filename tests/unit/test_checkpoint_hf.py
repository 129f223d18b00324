"""Hugging Face interchange and text generation from checkpoints."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.checkpoint.files import CheckpointError, expected_names
from engine.checkpoint.hf_interop import HFSource, export_hf, import_hf, open_model
from engine.checkpoint.save import save_weights
from engine.checkpoint.weights import stored_parameters
from engine.cli.main import main
from engine.training.config import TrainConfig
from engine.training.generate import generate, generate_text, load_model
from engine.training.loop import train
from models import GPTConfig, build_layers, layer_specs

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A few trained steps of each family, so no weight is still at its initial value."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for model in ("gpt-tiny", "llama-tiny"):
        config = TrainConfig.of(
            model=model,
            steps=2,
            global_batch=4,
            micro_batches=2,
            seq_len=32,
            threads=1,
            checkpoint_dir=str(root / model),
        )
        train(config, progress=False)
        out[model] = root / model
    return out


def _ours(checkpoint: Path) -> dict[str, torch.Tensor]:
    model, _ = load_model(checkpoint)
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_gpt_exports_under_gpt2_names_with_conv1d_layouts(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    export_hf(checkpoints["gpt-tiny"], tmp_path)
    hf = load_file(tmp_path / "model.safetensors")
    ours = _ours(checkpoints["gpt-tiny"])
    q, k, v = (ours[f"layers.1.attn.{x}_proj.weight"] for x in "qkv")
    assert torch.equal(hf["transformer.h.0.attn.c_attn.weight"], torch.cat([q, k, v]).T)
    assert torch.equal(hf["transformer.h.0.mlp.c_fc.weight"], ours["layers.1.mlp.fc.weight"].T)
    assert torch.equal(hf["transformer.wte.weight"], ours["layers.0.wte.weight"])
    assert "lm_head.weight" not in hf
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [
        "GPT2LMHeadModel"
    ]


def test_llama_exports_under_llama_for_causal_lm_names(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    export_hf(checkpoints["llama-tiny"], tmp_path)
    hf = load_file(tmp_path / "model.safetensors")
    ours = _ours(checkpoints["llama-tiny"])
    assert torch.equal(hf["model.embed_tokens.weight"], ours["layers.0.embed_tokens.weight"])
    assert torch.equal(
        hf["model.layers.3.self_attn.k_proj.weight"], ours["layers.4.self_attn.k_proj.weight"]
    )
    assert torch.equal(hf["model.norm.weight"], ours["layers.5.norm.weight"])
    assert torch.equal(hf["lm_head.weight"], ours["layers.6.lm_head.weight"])
    assert len(hf) == len(ours)


@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny"])
def test_export_then_import_gives_back_every_tensor(
    checkpoints: dict[str, Path], tmp_path: Path, model: str
) -> None:
    export_hf(checkpoints[model], tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "back")
    before, after = _ours(checkpoints[model]), _ours(tmp_path / "back")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_gpt2_files_saved_from_the_base_model_import_too(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """The Hub's gpt2 stores `h.0.…`, `wte.weight` without the `transformer.` prefix."""
    export_hf(checkpoints["gpt-tiny"], tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    save_file(
        {k.removeprefix("transformer."): v for k, v in tensors.items()},
        tmp_path / "hf" / "model.safetensors",
    )
    import_hf(tmp_path / "hf", tmp_path / "back")
    before, after = _ours(checkpoints["gpt-tiny"]), _ours(tmp_path / "back")
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_export_does_not_write_into_a_folder_in_use(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"an older export")
    with pytest.raises(CheckpointError, match="is not empty"):
        export_hf(checkpoints["gpt-tiny"], tmp_path)


def test_an_export_hf_cannot_represent_writes_nothing(tmp_path: Path) -> None:
    config = GPTConfig(vocab_size=256, n_layer=1, n_head=2, d_model=8, max_seq_len=16, bias=False)
    specs = config.layer_specs()
    save_weights(tmp_path / "ck", specs, stored_parameters(build_layers(specs, seed=0), specs))
    with pytest.raises(CheckpointError, match="bias=False cannot export"):
        export_hf(tmp_path / "ck", tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_a_failed_export_leaves_no_partial_folder(
    checkpoints: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def disk_full(*args: Any) -> None:
        raise OSError("No space left on device")

    monkeypatch.setattr("engine.checkpoint.hf_interop.atomic_write_text", disk_full)
    with pytest.raises(OSError, match="No space left"):
        export_hf(checkpoints["gpt-tiny"], tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []


def test_a_large_export_is_sharded_with_an_index(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    export_hf(checkpoints["llama-tiny"], tmp_path, max_shard_bytes=200_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    source = HFSource(tmp_path)
    assert source.names == expected_names(layer_specs("llama-tiny"))


def test_a_sharded_hf_folder_opens_as_hugging_face_not_as_a_checkpoint(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    export_hf(checkpoints["gpt-tiny"], tmp_path, max_shard_bytes=100_000)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    config, source = open_model(tmp_path)
    assert isinstance(source, HFSource) and config == layer_specs("gpt-tiny")[0].config
    before, after = _ours(checkpoints["gpt-tiny"]), _ours(tmp_path)
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny"])
def test_the_exported_config_names_no_special_token_outside_the_byte_vocabulary(
    checkpoints: dict[str, Path], tmp_path: Path, model: str
) -> None:
    """The byte tokenizer has no begin/end-of-text token: null, not HF's 50256 (or 1 and 2),
    and such a folder still imports."""
    export_hf(checkpoints[model], tmp_path / "hf")
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (hf["bos_token_id"], hf["eos_token_id"], hf["pad_token_id"]) == (None, None, None)
    import_hf(tmp_path / "hf", tmp_path / "back")
    assert open_model(tmp_path / "back")[0] == layer_specs(model)[0].config


def test_export_refuses_a_max_shard_size_below_one_byte(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    for bad in (0, -5):
        with pytest.raises(ValueError, match=rf"max_shard_bytes={bad} \(--max-shard-bytes\)"):
            export_hf(checkpoints["gpt-tiny"], tmp_path / "hf", max_shard_bytes=bad)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("bad", ["-5", "0", "5GB"])
def test_the_cli_refuses_a_max_shard_size_below_one_byte(
    checkpoints: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: str
) -> None:
    argv = ["export", "--checkpoint", str(checkpoints["gpt-tiny"]), "--out", str(tmp_path / "hf")]
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--max-shard-bytes", bad])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --max-shard-bytes: {bad!r} is not a positive number of bytes" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=["umask022", "umask027"])
def test_an_export_gets_the_modes_open_and_mkdir_give(
    checkpoints: dict[str, Path], tmp_path: Path, umask: int
) -> None:
    old = os.umask(umask)
    try:
        export_hf(checkpoints["llama-tiny"], tmp_path / "hf", max_shard_bytes=200_000)
    finally:
        os.umask(old)
    files = list((tmp_path / "hf").iterdir())
    assert len(files) > 3  # config, index and shards
    assert {f.name: stat.S_IMODE(f.stat().st_mode) for f in files} == {
        f.name: 0o666 & ~umask for f in files
    }
    assert stat.S_IMODE((tmp_path / "hf").stat().st_mode) == 0o777 & ~umask


def _root_without_latest(checkpoints: dict[str, Path], tmp_path: Path) -> tuple[Path, Path]:
    """A checkpoint root whose `latest` was lost, as a save cut off before it moved leaves it."""
    root = tmp_path / "root"
    shutil.copytree(checkpoints["gpt-tiny"], root)
    (root / "latest").unlink()
    return root, max(root.glob("step-*"))


@pytest.mark.parametrize("command", ["generate", "export"])
def test_a_root_without_latest_names_the_directory_to_pass_instead(
    checkpoints: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    command: str,
) -> None:
    """generate and export have no --resume-fallback: the fix is a path they take."""
    root, newest = _root_without_latest(checkpoints, tmp_path)
    rest = ["--prompt", "hi", "--max-new-tokens", "2"] if command == "generate" else []
    out = ["--out", str(tmp_path / "hf")] if command == "export" else []
    with pytest.raises(SystemExit):
        main([command, "--checkpoint", str(root), *rest, *out])
    err = capsys.readouterr().err
    assert f"the newest complete one is {newest}: pass that directory instead" in err
    assert "--resume-fallback" not in err
    assert main([command, "--checkpoint", str(newest), *rest, *out]) == 0


def test_import_refuses_an_architecture_it_cannot_represent(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(CheckpointError, match="model_type 'bert'"):
        import_hf(tmp_path, tmp_path / "out")


def test_init_from_an_hf_folder_of_another_shape_is_refused(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    export_hf(checkpoints["gpt-tiny"], tmp_path)
    config = TrainConfig.of(
        model="gpt-small",
        steps=1,
        global_batch=4,
        micro_batches=2,
        seq_len=32,
        init_from=str(tmp_path),
    )
    with pytest.raises(CheckpointError, match="pick the matching --model"):
        train(config, progress=False)


def test_init_from_an_export_equals_init_from_its_checkpoint(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    export_hf(checkpoints["gpt-tiny"], tmp_path)
    base = {
        "model": "gpt-tiny",
        "steps": 2,
        "global_batch": 4,
        "micro_batches": 2,
        "seq_len": 32,
        "threads": 1,
    }
    via_hf = train(TrainConfig.of(**base, init_from=str(tmp_path)), progress=False).losses
    direct = train(TrainConfig.of(**base, init_from=str(checkpoints["gpt-tiny"])), progress=False)
    fresh = train(TrainConfig.of(**base), progress=False).losses
    assert via_hf == direct.losses != fresh


def test_the_cli_exports_and_imports(
    checkpoints: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(
            [
                "export",
                "--checkpoint",
                str(checkpoints["llama-tiny"]),
                "--out",
                str(tmp_path / "hf"),
            ]
        )
        == 0
    )
    assert main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "ck")]) == 0
    assert (tmp_path / "ck" / "trainer.json").is_file()
    assert "wrote checkpoint" in capsys.readouterr().out


def test_import_does_not_overwrite_a_folder(
    checkpoints: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    export_hf(checkpoints["llama-tiny"], tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "ck")
    with pytest.raises(SystemExit):
        main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "ck")])
    assert "is not empty" in capsys.readouterr().err


# Logits equal transformers' own models (optional dependency).


@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny"])
def test_transformers_loads_an_export_without_foreign_special_tokens(
    checkpoints: dict[str, Path], tmp_path: Path, capfd: pytest.CaptureFixture[str], model: str
) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    export_hf(checkpoints[model], tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert (loaded.config.bos_token_id, loaded.config.eos_token_id) == (None, None)
    assert "50256" not in capfd.readouterr().err
    prompt = torch.tensor([[104, 105]])
    out = loaded.generate(prompt, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 5) and int(out.max()) < 256


def _hf_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).float()
    with torch.no_grad():
        return model.eval()(tokens).logits


@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny"])
def test_an_exported_model_gives_our_logits_in_transformers(
    checkpoints: dict[str, Path], tmp_path: Path, model: str
) -> None:
    export_hf(checkpoints[model], tmp_path)
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    theirs = _hf_logits(tmp_path, tokens)
    ours, _ = load_model(checkpoints[model])
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs, rtol=1e-4, atol=1e-4)


def test_a_model_saved_by_transformers_imports_with_its_logits(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=500.0,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "ck")
    tokens = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))
    ours, _ = load_model(tmp_path / "ck")
    with torch.no_grad():
        torch.testing.assert_close(
            ours(tokens), _hf_logits(tmp_path / "hf", tokens), rtol=1e-4, atol=1e-4
        )


# Generation.


def _tiny_model() -> Any:
    specs = layer_specs("gpt-tiny")
    return build_layers(specs, seed=3).eval()


def test_greedy_generation_extends_the_prompt_deterministically() -> None:
    model, prompt = _tiny_model(), torch.tensor([104, 105])
    first = generate(model, prompt, max_new_tokens=5, context=128)
    assert first.shape == (7,) and torch.equal(first[:2], prompt)
    assert torch.equal(first, generate(model, prompt, max_new_tokens=5, context=128))


def test_sampling_with_top_k_one_is_greedy() -> None:
    model, prompt = _tiny_model(), torch.tensor([104, 105])
    greedy = generate(model, prompt, max_new_tokens=5, context=128)
    sampled = generate(model, prompt, max_new_tokens=5, context=128, temperature=1.5, top_k=1)
    assert torch.equal(sampled, greedy)


def test_sampling_is_reproducible_by_seed() -> None:
    model, prompt = _tiny_model(), torch.tensor([104])
    draws = [
        generate(model, prompt, max_new_tokens=8, context=128, temperature=1.0, seed=s)
        for s in (1, 1, 2)
    ]
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])


def test_generation_slides_its_window_past_the_context() -> None:
    out = generate(_tiny_model(), torch.tensor([104]), max_new_tokens=10, context=4)
    assert out.shape == (11,)


def test_generate_refuses_an_empty_prompt() -> None:
    with pytest.raises(ValueError, match="prompt is empty"):
        generate(_tiny_model(), torch.tensor([], dtype=torch.long), max_new_tokens=1, context=8)


def test_the_cli_generates_text_from_a_checkpoint(
    checkpoints: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "generate",
        "--checkpoint",
        str(checkpoints["gpt-tiny"]),
        "--prompt",
        "def ",
        "--max-new-tokens",
        "12",
        "--temperature",
        "0.8",
        "--top-k",
        "20",
        "--seed",
        "3",
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("def ")
    expected = generate_text(
        checkpoints["gpt-tiny"], "def ", max_new_tokens=12, temperature=0.8, top_k=20, seed=3
    )
    assert printed == expected + "\n"


def test_stored_parameters_skip_a_tied_copy_owned_by_a_lower_layer() -> None:
    specs = layer_specs("gpt-tiny")
    head = build_layers(specs, [5, 6], seed=0)
    assert "layers.6.weight" not in stored_parameters(head, specs)
