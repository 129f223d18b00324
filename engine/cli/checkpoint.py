"""`meshpipe export | import | generate`: the commands that read and write checkpoints.

`engine.cli.main` registers them and dispatches here.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["COMMANDS", "add_parsers", "run"]

COMMANDS = ("export", "import", "generate")


def _shard_bytes(text: str) -> int:
    """`--max-shard-bytes`: a positive int, refused by argparse (with the usage) otherwise."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a positive number of bytes; pass e.g. {5 << 30} (5 GiB, the "
            "default when the flag is left out)"
        )
    return value


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register the checkpoint commands on `meshpipe`'s subparsers."""
    export = commands.add_parser("export", help="write a checkpoint as a Hugging Face model")
    export.add_argument("--checkpoint", required=True, help="checkpoint dir or its root")
    export.add_argument("--out", required=True, help="folder for config.json + safetensors")
    export.add_argument(
        "--max-shard-bytes",
        type=_shard_bytes,
        default=5 << 30,
        help="start a new shard past this many bytes (default 5 GiB)",
    )
    imp = commands.add_parser(
        "import", help="turn a Hugging Face GPT-2/Llama/Mistral/Qwen2 into a checkpoint"
    )
    imp.add_argument("source", help="folder with config.json and model.safetensors")
    imp.add_argument("--out", required=True, help="checkpoint directory to create")
    gen = commands.add_parser("generate", help="continue a prompt with a trained model")
    gen.add_argument("--checkpoint", required=True, help="checkpoint, its root, or an HF folder")
    gen.add_argument("--prompt", required=True, help="text to continue")
    gen.add_argument(
        "--tokenizer",
        default=None,
        help="the model's tokenizer (a tokenizer.json or its folder) where it carries none; "
        "one it carries is used by default and a different one refused",
    )
    gen.add_argument("--max-new-tokens", type=int, default=64, help="tokens to add")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 decodes greedily")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (0: all)")
    gen.add_argument("--seed", type=int, default=0, help="seed of the sampler")


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Run one of `COMMANDS`; bad input raises ValueError (the CLI prints it)."""
    from engine.checkpoint.files import read_json
    from engine.checkpoint.hf_configs import dropout_note
    from engine.checkpoint.hf_interop import export_hf, import_hf
    from engine.training.generate import generate_text
    from engine.training.paths import check_paths, checkpoint_in, tree_in, tree_out

    if args.command == "export":
        check_paths([checkpoint_in("--checkpoint", args.checkpoint), tree_out("--out", args.out)])
        out = export_hf(args.checkpoint, args.out, max_shard_bytes=args.max_shard_bytes)
        print(f"wrote a Hugging Face model to {out}")
    elif args.command == "import":
        check_paths([tree_in("SOURCE", args.source), tree_out("--out", args.out)])
        print(f"wrote checkpoint {import_hf(args.source, args.out)}")
        note = dropout_note(read_json(Path(args.source) / "config.json"))
        if note:
            print(note, file=sys.stderr)
    else:
        text = generate_text(
            args.checkpoint,
            args.prompt,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            seed=args.seed,
            tokenizer=args.tokenizer,
        )
        print(text)
    return 0
