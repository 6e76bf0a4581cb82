#!/usr/bin/env bash
# The GPU checks of docs/performance.md ("GPU") in one command, for a machine with one NVIDIA GPU:
#   1. the versions it ran with (GPU, driver, torch/CUDA, transformers, megatron-core, Transformer Engine or not);
#   2. the speed ledger on the real Qwen2.5-1.5B shape (random weights), bf16, seq 4096, 16,384 tokens a step:
#      plain transformers.Trainer, the standard backend and the mca backend on one GPU, packing on (the three)
#      and off (HF and mca); MFU against the GPU's datasheet peak;
#   3. backend parity on the GPU: cases of the parity sweep that fit one GPU (`roll-parity --case NAME`: a tiny
#      model built on the spot, the standard and the mca backend trained on the same batches, the losses and the
#      exported weights compared at the sweep's CPU bounds; a case over them is reported, not hidden).
# Usage: bash scripts/gpu_ledger.sh OUT_DIR [nvidia-h100|nvidia-h200]
# Writes OUT_DIR/env.txt, bench.md (the ledger block), bench.json, parity_CASE.json/.log, summary.txt.
set -u
out=${1:?usage: bash scripts/gpu_ledger.sh OUT_DIR [nvidia-h100|nvidia-h200]}
kind=${2:-nvidia-h100}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
work=${GPU_LEDGER_WORK:-outputs/gpu_ledger}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$py" -c "import torch, transformers, megatron.core as m; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'transformers', transformers.__version__, 'megatron-core', m.__version__)"
  "$py" -c "import transformer_engine as te; print('transformer_engine', te.__version__)" 2>/dev/null \
    || echo "transformer_engine: not importable (the mca backend uses the local spec)"
} > "$out/env.txt" 2>&1
cat "$out/env.txt"

# GPU_LEDGER_SHAPE / _SEQ / _TOKENS: a smaller smoke run of this script (e.g. tiny, 64, 256 with kind cpu);
# GPU_LEDGER_CASES: roll-bench --only (full case names), GPU_LEDGER_PARITY_CASES: the parity cases, GPU_LEDGER_WORK:
# roll-bench --work-dir (the model, the runs' logs).
s=${GPU_LEDGER_SEQ:-4096}
shape=${GPU_LEDGER_SHAPE:-qwen2.5-1.5b}
tokens=${GPU_LEDGER_TOKENS:-16384}
cases=${GPU_LEDGER_CASES:-hf-1p-bf16-s$s-pack,standard-1p-bf16-s$s-pack,mca-1p-bf16-s$s-pack,hf-1p-bf16-s$s-nopack,mca-1p-bf16-s$s-nopack}
timeout "${GPU_LEDGER_BENCH_TIMEOUT:-1200}" "$py" -m roll.bench --device-kind "$kind" --model-shape "$shape" \
  --seq "$s" --tokens-per-step "$tokens" --dtype bf16 --full --only "$cases" --steps 5 --warmup 2 --timeout 240 \
  --no-convert --no-saves --work-dir "$work" --markdown-out "$out/bench.md" --json-out "$out/bench.json" \
  > "$out/bench.log" 2>&1
echo "roll-bench: exit $?" | tee "$out/summary.txt"
grep -E "^\| \((a|b|c/d)\)" "$out/bench.md" 2>/dev/null

for case in ${GPU_LEDGER_PARITY_CASES:-sft_plain bf16 packing lora_all_r8 dpo_sigmoid}; do
  timeout 240 "$py" -m roll.parity.cli --case "$case" --json > "$out/parity_$case.json" 2> "$out/parity_$case.log"
  echo "roll-parity --case $case: exit $?" | tee -a "$out/summary.txt"
done
