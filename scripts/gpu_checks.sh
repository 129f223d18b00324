#!/usr/bin/env bash
# What a session lent a GPU checks (docs/BENCHMARKS.md, "On an H100"), in two parts that each
# fit one 10-minute call of the device tool: `stage` (one Llama stage's MFU, eager and
# compiled, the engine's per-step weight copies against autocast's casts, the runtime's
# overhead) and `system` (the CUDA tests, grouped-query attention's memory, two ranks sharing
# the GPU, the memory model against the allocator); a third, `peers`, times meshpipe's ZB-V and
# DualPipeV against torch's (issue 26's speed target), both stages of each V on one GPU, then
# on two ranks where the machine has two GPUs (skipped, saying so, on one); a fourth, `plan`,
# sets the planner's predictions against `meshpipe train --plan` runs on one GPU, the layers
# timed there (issue #25, item 4: the cost model off this VM's noise). Runs from
# the checkout without installing (PYTHONPATH) and keeps its output in
# OUT_DIR/gpu_checks-PART.log, so a call cut off at its time limit still returns what ran.
# Usage: bash scripts/gpu_checks.sh [OUT_DIR] [stage|system|peers|plan|all]
# GPU_CHECKS_SMOKE=1 runs every command at toy size on the CPU (llama-tiny, gpt-tiny): run it
# before a GPU session, whose calls are too few to spend on a mistyped flag.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu_checks}}"
part="${2:-all}"
case "$part" in
  stage|system|peers|plan|all) ;;
  *) echo "gpu_checks.sh: unknown part '$part': choose stage, system, peers, plan or all" >&2; exit 2 ;;
esac
mkdir -p "$out"
exec > >(tee -a "$out/gpu_checks-$part.log") 2>&1
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
py=python3
step() { echo "== $*"; }
wants() { [ "$part" = all ] || [ "$part" = "$1" ]; }
# run SECONDS LINES COMMAND...: the command under a time limit; its last LINES lines, or its
# last 20 and its exit status when it fails (a traceback must not be cut to one line)
run() {
  local limit=$1 lines=$2 log rc
  shift 2
  log=$(mktemp)
  timeout "$limit" "$@" >"$log" 2>&1
  rc=$?
  if [ "$rc" = 0 ]; then tail -n "$lines" "$log"; else tail -n 20 "$log"; echo "-- exit $rc"; fi
  rm -f "$log"
}
if [ "${GPU_CHECKS_SMOKE:-0}" = 1 ]; then
  dev=cpu llama=llama-tiny gpt=gpt-tiny seq=64 train_seq=64 mbs=2 sizes="1 2 4"
  peers="--model tiny --steps 2 --warmup 1" gpus=2 plan_seq=32
else
  dev=cuda llama=llama-1b gpt=gpt2 seq=2048 train_seq=512 mbs=8 sizes="4 8 16"
  peers="--model bench-gpu --steps 4 --warmup 1 --rounds 2" gpus=$(nvidia-smi -L | wc -l)
  plan_seq=1024
fi

step "device ($dev)"
[ "$dev" = cuda ] && nvidia-smi --query-gpu=name,memory.total,clocks.sm,power.limit --format=csv
$py -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.is_available() and torch.cuda.get_device_name())"

stage="$py scripts/bench_stage.py --model $llama --device $dev --precision bf16 --seq-len $seq"
steps="--micro-batches 8 --steps 4 --warmup 1"
if wants stage; then
step "$llama blocks, $mbs x $seq, compiled, 8 micro-batches a step sharing the weight copies"
run 150 1 $stage --micro-batch-size "$mbs" --compile $steps
step "the same with autocast's casts kept over the step (what the weight copies buy)"
run 150 1 $stage --micro-batch-size "$mbs" --compile $steps --casts autocast-step
step "the same, eager: weight copies, autocast's casts, and 1 micro-batch a step"
run 120 1 $stage --micro-batch-size "$mbs" $steps
run 120 1 $stage --micro-batch-size "$mbs" $steps --casts autocast-step
run 90 1 $stage --micro-batch-size "$mbs"
for size in $sizes; do
  [ "$size" = "$mbs" ] && continue
  step "$llama blocks, $size x $seq, compiled, 8 micro-batches a step"
  run 150 1 $stage --micro-batch-size "$size" --compile $steps
done
step "runtime overhead on $dev, compiled"
run 150 3 $stage --layers all --micro-batch-size 2 --runtime-overhead 8 --steps 5 --compile
step "$mbs x $seq compiled with inductor's autotuning (the last: its compile may take minutes)"
run 240 1 $stage --micro-batch-size "$mbs" --compile --compile-mode max-autotune-no-cudagraphs $steps
fi

if wants system; then
step "CUDA tests (tests/unit/test_cuda.py, test_compile.py)"
MESHPIPE_TEST_CUDA=1 run 300 15 $py -m pytest -q -p no:cacheprovider -rs tests/unit/test_cuda.py \
  tests/unit/test_compile.py

step "grouped-query attention: what SDPA keeps on $dev (the memory model assumes compact K/V)"
timeout 60 $py - <<'PY'
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

cuda = torch.cuda.is_available()
for batch, heads, kv_heads, seq, dim in ((2, 4, 2, 64, 16), (4, 32, 4, 2048, 64)):
    def make(h: int) -> torch.Tensor:
        shape = (batch, h, seq, dim)
        device = "cuda" if cuda else "cpu"
        return torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True)
    q, k, v = make(heads), make(kv_heads), make(kv_heads)
    before = torch.cuda.memory_allocated() if cuda else 0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    kept = torch.cuda.memory_allocated() - before - y.numel() * y.element_size() if cuda else "n/a"
    ops = sorted({e.name for e in prof.events() if e.name.startswith("aten::")})
    compact = 2 * k.numel() * k.element_size()
    print(f"{batch}x{heads}/{kv_heads}x{seq}x{dim}: kept beside the output {kept} B "
          f"(compact k+v {compact} B), {type(y.grad_fn).__name__}, {ops}")
PY

train="$py -m engine.cli train --model $gpt --steps 12 --global-batch 32 --micro-batches 8 \
  --seq-len $train_seq --precision bf16 --no-progress --log-every 4 --timeout 120"
step "$gpt bf16, pp 1 (bubble must be near 0)"
run 200 4 $train --pp 1 --device "$dev" --metrics-file "$out/pp1.jsonl"
step "$gpt bf16, pp 2 sharing the $dev over gloo (host-staged exchange on a GPU)"
run 240 4 $train --pp 2 --device "$dev" --metrics-file "$out/pp2.jsonl"

step "memory model against $dev"
for model in gpt-tiny llama-tiny; do
  for schedule in gpipe 1f1b; do
    run 60 5 $py -m engine.cli memory --model $model --pp 2 --micro-batches 4 \
      --micro-batch-size 2 --seq-len 64 --schedule $schedule --dtype bf16 --device "$dev" --measure
  done
done
fi

if wants peers; then
systems=single-1t,meshpipe-zb_v,torch-ScheduleZBVZeroBubble,meshpipe-dualpipe_v,torch-ScheduleDualPipeV
step "meshpipe's ZB-V and DualPipeV against torch's, both stages of each V on one $dev rank"
run 400 30 $py scripts/bench_peers.py --device "$dev" --ranks 1 $peers --systems "$systems" \
  --work "$out/bench_peers_1"
step "the same on 2 $dev ranks (the V's stages 0 and 3 on one, 1 and 2 on the other)"
if [ "$gpus" -lt 2 ]; then
  echo "skipped: two GPUs are needed (NCCL, one per rank) and this machine has $gpus"
else
  run 400 30 $py scripts/bench_peers.py --device "$dev" --ranks 2 $peers --systems "$systems" \
    --work "$out/bench_peers_2"
fi
fi

if wants plan; then
step "the planner's predicted step against $gpt runs on one $dev, fp32, two rounds (issue #25)"
run 480 20 $py scripts/plan_check.py --model $gpt --devices 1 --device "$dev" \
  --device-memory 80GB --global-batch 16 --seq-len $plan_seq --steps 6 --rounds 2
fi
