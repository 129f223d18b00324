"""scripts/train_llm.py runs unchanged under the deepspeed launcher and under torchrun."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist.harness import free_port

ROOT = Path(__file__).resolve().parents[2]
CONFIG = {
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "weight_decay": 0.1}},
    "scheduler": {
        "type": "WarmupCosineLR",
        "params": {"warmup_num_steps": 2, "total_num_steps": 3, "warmup_type": "linear"},
    },
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "seed": 0,
}


def _launch(launcher: list[str], tmp_path: Path) -> Path:
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(CONFIG))
    script = [str(ROOT / "scripts" / "train_llm.py"), "--deepspeed_config", str(config)]
    flags = ["--model", "gpt-tiny", "--pp", "2", "--dp", "1", "--steps", "3", "--seq-len", "32",
             "--out", str(tmp_path / "run"), "--no-progress"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [*launcher, *script, *flags], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "final loss" in done.stdout
    return tmp_path / "run"


def test_runs_under_the_deepspeed_launcher(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install .[deepspeed])")
    launcher = shutil.which("deepspeed", path=str(Path(sys.executable).parent))
    assert launcher is not None
    run = _launch([launcher, "--num_gpus", "2", "--master_port", str(free_port())], tmp_path)
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 3
    assert (run / "checkpoints" / "latest").is_file()


def test_runs_under_torchrun(tmp_path: Path) -> None:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-port", str(free_port())]  # fmt: skip
    run = _launch(launcher, tmp_path)
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 3
