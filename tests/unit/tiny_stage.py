"""The stage shape the derived-trace tests trace (`test_local_edges`, `test_first_style`): two
tiny blocks, micro-batches of 2 × 16 tokens, bf16, no recompute; each case varies it."""

from __future__ import annotations

from engine.memory.replay import StageShape

TINY_SHAPE = StageShape(
    micro_batches=4,
    micro_batch_size=2,
    seq_len=16,
    hidden=64,
    divisor=4,
    precision="bf16",
    recompute="none",
)
