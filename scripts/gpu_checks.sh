#!/usr/bin/env bash
# What a session lent a GPU checks (docs/BENCHMARKS.md, "On an H100"), in two parts that each
# fit one 10-minute call of the device tool: `stage` (one Llama stage's MFU, eager and
# compiled, the engine's per-step weight copies against autocast's casts, the runtime's
# overhead) and `system` (the CUDA tests, grouped-query attention's memory, two ranks sharing
# the GPU, the memory model against the allocator). Runs from the checkout without installing
# (PYTHONPATH). Usage: bash scripts/gpu_checks.sh [OUT_DIR] [stage|system|all]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu_checks}}"
part="${2:-all}"
case "$part" in
  stage|system|all) ;;
  *) echo "gpu_checks.sh: unknown part '$part': choose stage, system or all" >&2; exit 2 ;;
esac
mkdir -p "$out"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
py=python3
step() { echo "== $*"; }
wants() { [ "$part" = all ] || [ "$part" = "$1" ]; }

step "device"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,power.limit --format=csv
$py -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name())"

if wants system; then
step "CUDA tests (tests/unit/test_cuda.py, test_compile.py)"
MESHPIPE_TEST_CUDA=1 timeout 300 $py -m pytest -q -p no:cacheprovider -rs tests/unit/test_cuda.py \
  tests/unit/test_compile.py 2>&1 | tail -15

step "grouped-query attention: what CUDA's SDPA keeps (the memory model assumes compact K/V)"
timeout 60 $py - <<'PY'
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

for batch, heads, kv_heads, seq, dim in ((2, 4, 2, 64, 16), (4, 32, 4, 2048, 64)):
    def make(h: int) -> torch.Tensor:
        shape = (batch, h, seq, dim)
        return torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q, k, v = make(heads), make(kv_heads), make(kv_heads)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    kept = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()
    ops = sorted({e.name for e in prof.events() if e.name.startswith("aten::")})
    compact = 2 * k.numel() * k.element_size()
    print(f"{batch}x{heads}/{kv_heads}x{seq}x{dim}: kept beside the output {kept} B "
          f"(compact k+v {compact} B), {type(y.grad_fn).__name__}, {ops}")
PY
fi

stage="$py scripts/bench_stage.py --model llama-1b --device cuda --precision bf16 --seq-len 2048"
steps="--micro-batches 8 --steps 4 --warmup 1"
if wants stage; then
step "llama-1b blocks, 8 x 2048, eager: 1 micro-batch a step, then 8 sharing the weight copies"
timeout 90 $stage --micro-batch-size 8 | tail -1
timeout 120 $stage --micro-batch-size 8 $steps | tail -1
for mb in 4 8 16; do
  step "llama-1b blocks, $mb x 2048, compiled, 8 micro-batches a step"
  timeout 150 $stage --micro-batch-size "$mb" --compile $steps | tail -1
done
step "the same at 8 x 2048 with autocast's casts (what the weight copies buy)"
timeout 150 $stage --micro-batch-size 8 --compile $steps --casts autocast-step | tail -1
timeout 120 $stage --micro-batch-size 8 $steps --casts autocast-step | tail -1
step "runtime overhead on CUDA, compiled"
timeout 150 $stage --layers all --micro-batch-size 2 --runtime-overhead 8 --steps 5 --compile | tail -3
step "8 x 2048 compiled with inductor's autotuning (the last: its compile may take minutes)"
timeout 240 $stage --micro-batch-size 8 --compile --compile-mode max-autotune-no-cudagraphs \
  $steps | tail -1
fi

if wants system; then
train="$py -m engine.cli train --model gpt2 --steps 12 --global-batch 32 --micro-batches 8 \
  --seq-len 512 --precision bf16 --no-progress --log-every 4 --timeout 120"
step "gpt2 bf16, pp 1 (bubble must be near 0)"
timeout 200 $train --pp 1 --metrics-file "$out/pp1.jsonl" 2>&1 | tail -4
step "gpt2 bf16, pp 2 sharing the GPU over gloo (host-staged exchange)"
timeout 240 $train --pp 2 --device cuda --metrics-file "$out/pp2.jsonl" 2>&1 | tail -4

step "memory model against CUDA"
for model in gpt-tiny llama-tiny; do
  for schedule in gpipe 1f1b; do
    timeout 60 $py -m engine.cli memory --model $model --pp 2 --micro-batches 4 \
      --micro-batch-size 2 --seq-len 64 --schedule $schedule --dtype bf16 --device cuda --measure \
      | tail -5
  done
done
fi
