"""Train a GPT with meshpipe from a DeepSpeed-style launch (or torchrun, or plainly).

Runs unchanged under the deepspeed launcher and under torchrun:

    deepspeed --num_gpus 4 scripts/train_llm.py --deepspeed_config scripts/ds_config.json
    torchrun --nproc-per-node 4 scripts/train_llm.py --deepspeed_config scripts/ds_config.json
    python scripts/train_llm.py --deepspeed_config scripts/ds_config.json

(pp 2 × dp 2 by default: train_batch_size 16 = 2 per rank × 4 accumulation × dp 2.)

Batch, optimizer, LR schedule, bf16, clipping, ZeRO and seed come from the DeepSpeed JSON; the
rest are meshpipe's `train` flags (the model is GPT with tied embeddings by default, trained on
the embedded corpus, with checkpoints and a metrics file under --out).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine.cli.main import main as meshpipe_main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deepspeed_config", "--deepspeed-config", required=True)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None)
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--pp", default="2")
    parser.add_argument("--dp", default="2")
    parser.add_argument("--steps", default="300")
    parser.add_argument("--seq-len", default="128")
    parser.add_argument("--out", default="runs/train_llm", help="checkpoints and metrics")
    args, rest = parser.parse_known_args(argv)
    out = Path(args.out)
    return meshpipe_main(
        [
            "train",
            "--deepspeed_config", args.deepspeed_config,
            "--model", args.model,
            "--pp", args.pp,
            "--dp", args.dp,
            "--steps", args.steps,
            "--seq-len", args.seq_len,
            "--checkpoint-dir", str(out / "checkpoints"),
            "--save-every", "100",
            "--keep", "2",
            "--metrics-file", str(out / "metrics.jsonl"),
            *rest,
        ]
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
