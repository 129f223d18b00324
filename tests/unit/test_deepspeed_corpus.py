"""DeepSpeed configs in the shapes public projects ship them, each either mapped to the
settings DeepSpeed would run or refused naming the key that meshpipe cannot honour.

The dicts follow the published files (values trimmed where a template fills them in):
Megatron-DeepSpeed's pretrain scripts, GPT-NeoX, BigScience's BLOOM runs, the Hugging Face
Trainer's ZeRO-2/ZeRO-3 examples, DeepSpeedExamples (cifar, pipeline, bing_bert) and the
ZeRO-Offload tutorial.
"""

from __future__ import annotations

from typing import Any

import pytest

from engine.training.config import TrainConfig

MEGATRON_DEEPSPEED_GPT = {
    "train_batch_size": 256, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10,
    "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0, "prescale_gradients": False,
    "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2,
             "min_loss_scale": 1, "initial_scale_power": 11},
    "bf16": {"enabled": False}, "wall_clock_breakdown": False,
}  # fmt: skip
MEGATRON_DEEPSPEED_LLAMA2 = {
    "train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 1,
    "zero_optimization": {"stage": 1}, "bf16": {"enabled": True},
    "data_types": {"grad_accum_dtype": "fp32"},
    "activation_checkpointing": {"partition_activations": False,
                                 "contiguous_memory_optimization": False,
                                 "cpu_checkpointing": False, "number_checkpoints": None,
                                 "synchronize_checkpoint_boundary": False, "profile": False},
    "flops_profiler": {"enabled": False, "profile_step": 1, "module_depth": -1, "top_modules": 3,
                       "detailed": True},
    "comms_logger": {"enabled": False, "verbose": False, "prof_all": True, "debug": False},
}  # fmt: skip
GPT_NEOX = {
    "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
    "optimizer": {"type": "Adam", "params": {"lr": 0.0006, "betas": [0.9, 0.95], "eps": 1e-8}},
    "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "hysteresis": 2,
             "min_loss_scale": 1},
    "zero_optimization": {"stage": 1, "allgather_partitions": True,
                          "allgather_bucket_size": 500000000, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": 500000000,
                          "contiguous_gradients": True},
    "gradient_clipping": 1.0, "steps_per_print": 10, "wall_clock_breakdown": True,
}  # fmt: skip
BLOOM_176B = {
    "train_micro_batch_size_per_gpu": 2, "train_batch_size": 2048, "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 0}, "bf16": {"enabled": True}, "steps_per_print": 2000,
    "wall_clock_breakdown": False,
}  # fmt: skip
BLOOM_13B_FP16 = {
    "train_micro_batch_size_per_gpu": 1, "train_batch_size": 1024, "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 1},
    "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2,
             "min_loss_scale": 1, "initial_scale_power": 12},
    "steps_per_print": 2000, "wall_clock_breakdown": False,
}  # fmt: skip
_HF_COMMON = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto",
                                                 "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}  # fmt: skip
HF_ZERO2 = {
    **_HF_COMMON,
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8,
                          "overlap_comm": True, "reduce_scatter": True,
                          "reduce_bucket_size": 2e8, "contiguous_gradients": True},
}  # fmt: skip
HF_ZERO2_ON_DEVICE = {
    **HF_ZERO2,
    "zero_optimization": {**HF_ZERO2["zero_optimization"], "offload_optimizer": {"device": "none"}},
}  # fmt: skip
_HF_ZERO3_SECTION = {
    "stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
    "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True,
}  # fmt: skip
HF_ZERO3 = {
    **_HF_COMMON,
    "zero_optimization": {**_HF_ZERO3_SECTION,
                          "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "offload_param": {"device": "cpu", "pin_memory": True}},
}  # fmt: skip
HF_ZERO3_ON_DEVICE = {**_HF_COMMON, "zero_optimization": _HF_ZERO3_SECTION}
CIFAR = {
    "train_batch_size": 16, "steps_per_print": 2000,
    "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                             "weight_decay": 3e-7}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                 "warmup_num_steps": 1000}},
    "gradient_clipping": 1.0, "prescale_gradients": False,
    "fp16": {"enabled": True, "fp16_master_weights_and_grads": False, "loss_scale": 0,
             "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1,
             "initial_scale_power": 15},
    "wall_clock_breakdown": False,
    "zero_optimization": {"stage": 0, "allgather_partitions": True, "reduce_scatter": True,
                          "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000,
                          "overlap_comm": True, "contiguous_gradients": True,
                          "cpu_offload": False},
}  # fmt: skip
PIPELINE_EXAMPLE = {
    "train_batch_size": 256, "train_micro_batch_size_per_gpu": 8,
    "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-8}},
    "steps_per_print": 10, "wall_clock_breakdown": False,
}  # fmt: skip
BING_BERT_LAMB = {
    "train_batch_size": 4096, "train_micro_batch_size_per_gpu": 64, "steps_per_print": 1000,
    "prescale_gradients": False,
    "optimizer": {"type": "Lamb", "params": {"lr": 11e-3, "weight_decay": 0.01,
                                             "bias_correction": False, "max_coeff": 0.3,
                                             "min_coeff": 0.01}},
    "gradient_clipping": 1.0, "wall_clock_breakdown": False,
    "fp16": {"enabled": True, "loss_scale": 0},
}  # fmt: skip
ZERO_OFFLOAD_TUTORIAL = {
    "train_batch_size": 16, "fp16": {"enabled": True},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                          "contiguous_gradients": True, "overlap_comm": True},
}  # fmt: skip
MONITORED = {
    "train_batch_size": 8,
    "tensorboard": {"enabled": True, "output_path": "logs/", "job_name": "run1"},
    "csv_monitor": {"enabled": True, "output_path": "logs/", "job_name": "run1"},
    "flops_profiler": {"enabled": True, "profile_step": 1},
}  # fmt: skip

HF_FLAGS = {"dp": 2, "global_batch": 16, "micro_batches": 2, "lr": 5e-5, "warmup_steps": 10}

MAPPED = [
    ("Megatron-DeepSpeed GPT, fp16 under ZeRO-1", MEGATRON_DEEPSPEED_GPT, {"dp": 8},
     {"global_batch": 256, "micro_batches": 8, "zero": 1, "precision": "fp16",
      "initial_scale_power": 11, "loss_scale_window": 500, "hysteresis": 2,
      "clip_grad_norm": 1.0, "log_every": 10, "log_phases": False}),
    ("Megatron-DeepSpeed Llama 2, bf16", MEGATRON_DEEPSPEED_LLAMA2, {"dp": 4},
     {"global_batch": 32, "micro_batches": 2, "precision": "bf16", "recompute": "none",
      "log_every": 1, "clip_grad_norm": 1.0}),
    ("GPT-NeoX 1-3B shape", GPT_NEOX, {"dp": 2},
     {"global_batch": 8, "micro_batches": 1, "optimizer": "adamw", "lr": 0.0006,
      "betas": "0.9,0.95", "precision": "fp16", "hysteresis": 2, "loss_scale_window": 1000,
      "lr_schedule": "constant", "log_phases": True}),
    ("BLOOM-176B, bf16 without ZeRO", BLOOM_176B, {"dp": 8},
     {"global_batch": 2048, "micro_batches": 128, "precision": "bf16", "zero": 0,
      "log_every": 2000}),
    ("BLOOM 13B, fp16 under ZeRO-1", BLOOM_13B_FP16, {"dp": 16},
     {"global_batch": 1024, "micro_batches": 64, "initial_scale_power": 12, "hysteresis": 2}),
    ("HF Trainer ZeRO-2 on the device, auto", HF_ZERO2_ON_DEVICE, HF_FLAGS,
     {"global_batch": 16, "micro_batches": 2, "zero": 2, "lr": 5e-5, "precision": "fp32",
      # gradient_clipping "auto": meshpipe's default, 1.0 (the Trainer's max_grad_norm too)
      "lr_schedule": "deepspeed:WarmupLR", "clip_grad_norm": 1.0}),
    ("HF Trainer ZeRO-3 on the device, auto", HF_ZERO3_ON_DEVICE, HF_FLAGS,
     {"zero": 3, "optimizer_impl": "per_tensor", "betas": "0.9,0.95"}),
    ("DeepSpeedExamples cifar, fp16 without ZeRO", CIFAR, {"dp": 1},
     {"global_batch": 16, "micro_batches": 1, "betas": "0.8,0.999", "weight_decay": 3e-7,
      "initial_scale_power": 15, "loss_scale_window": 500, "hysteresis": 1}),
    ("DeepSpeedExamples pipeline", PIPELINE_EXAMPLE, {"dp": 2, "pp": 2},
     {"global_batch": 256, "micro_batches": 16, "betas": "0.9,0.999", "weight_decay": 0.0}),
    ("monitors with the FLOPs profiler on", MONITORED, {"dp": 1},
     {"tensorboard_dir": "logs/run1", "csv_dir": "logs/run1", "flops_profile_step": 2,
      "flops_profile_file": None}),
]  # fmt: skip

REFUSED = [
    ("HF Trainer ZeRO-2 with CPU offload", HF_ZERO2, HF_FLAGS,
     "zero_optimization.offload_optimizer=.*offloading to the CPU or NVMe is not implemented"),
    ("HF Trainer ZeRO-3 with CPU offload", HF_ZERO3, HF_FLAGS,
     "zero_optimization.offload_optimizer=.*offloading"),
    ("DeepSpeedExamples bing_bert with LAMB", BING_BERT_LAMB, {"dp": 4},
     "optimizer type 'Lamb' is not supported"),
    ("ZeRO-Offload tutorial", ZERO_OFFLOAD_TUTORIAL, {"dp": 1},
     "zero_optimization.offload_optimizer=\\{'device': 'cpu'\\}"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("config", "flags", "expected"),
    [case[1:] for case in MAPPED],
    ids=[case[0] for case in MAPPED],
)
def test_a_public_config_maps_to_what_deepspeed_would_run(
    config: dict[str, Any], flags: dict[str, Any], expected: dict[str, Any]
) -> None:
    flat = TrainConfig.from_deepspeed(config, **flags).flat()
    assert {name: flat[name] for name in expected} == expected


@pytest.mark.parametrize(
    ("config", "flags", "message"),
    [case[1:] for case in REFUSED],
    ids=[case[0] for case in REFUSED],
)
def test_a_public_config_meshpipe_cannot_honour_is_refused_by_key(
    config: dict[str, Any], flags: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig.from_deepspeed(config, **flags)
