#!/usr/bin/env bash
# One-shot GPU check: the gpu-marked tests, verify(1) vs verify(16) and AR vs speculative timing on a
# Qwen3-shaped random target, and a short report. Run once on a machine with a CUDA device:
#     bash benchmarks/gpu_check.sh [report-dir]      (default outputs/gpu_check)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-outputs/gpu_check}"
PY="${PYTHON:-python}"
mkdir -p "$OUT"
REPORT="$OUT/report.md"
{
  echo "# GPU check $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  echo "- git commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "- device: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -1 || echo none)"
  echo "- torch: $($PY -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)')"
} > "$REPORT"

echo "## gpu tests" >> "$REPORT"
PYTHONPATH=$PWD $PY -m pytest -q -s -m gpu tests/gpu -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -5
echo '```' >> "$REPORT"; grep -E "passed|failed|error|plan vs CUDA" "$OUT/gpu_tests.log" >> "$REPORT"; echo '```' >> "$REPORT"

echo "## timing (Qwen3-shaped random target)" >> "$REPORT"
PYTHONPATH=$PWD $PY benchmarks/gpu_timing.py --out "$OUT/timing.txt" 2>&1 | tail -8
echo '```' >> "$REPORT"; cat "$OUT/timing.txt" >> "$REPORT" 2>/dev/null; echo '```' >> "$REPORT"

# ---- SGLang: Triton kernels vs PyTorch at Qwen3-4B shapes, then a DRELAY server vs AR ---
# Needs SGLang's own environment (docs/sglang.md: `pip install "sglang==0.5.23"` then
# `pip install -e . --no-deps`, so the plugin's entry point exists); point SGLANG_PYTHON at it.
SGPY="${SGLANG_PYTHON:-$PY}"
echo "## sglang" >> "$REPORT"
if $SGPY -c "import sglang" 2>/dev/null; then
  PYTHONPATH=$PWD $SGPY benchmarks/gpu/sglang_check.py all --out "$OUT/sglang" 2>&1 | tee "$OUT/sglang.log" | tail -8
  echo '```' >> "$REPORT"; tail -30 "$OUT/sglang.log" >> "$REPORT"; echo '```' >> "$REPORT"
else
  echo "skipped: sglang is not importable by $SGPY (set SGLANG_PYTHON to SGLang's environment)" >> "$REPORT"
fi
# ---------------------------------------------------------------------------------------------------

echo "report: $REPORT"
cat "$REPORT"
