#!/usr/bin/env bash
# The GPU check: one command, at most 8 minutes on one GPU, report under $OUT (or the given folder).
#
#     bash benchmarks/gpu_check.sh [--dry-run] [--commit ID] [report-dir]   (report-dir: $OUT, else outputs/gpu_check)
#
# The commit under test is recorded in the report: --commit ID, else $GPU_CHECK_COMMIT, else
# `git rev-parse HEAD` where the checkout has its .git (a copied working tree has none: pass it in).
#
# Steps, each under its own time limit (and all under TOTAL_S):
#   env         versions, device, and that drelay_model imports without ray, mlflow, pydantic
#   tests       pytest on CUDA: tests/gpu/test_cuda.py (every selector lossless fp32/bf16 on tiny
#               targets, per-request sampling, a bf16 joint step) and tests/model/test_kernels.py
#               (the Triton kernels compiled, against PyTorch)
#   lossless    benchmarks/gpu/check_lossless.py   (Qwen3 vocabulary, fp32 = HF generate, bf16)
#   accepted    benchmarks/gpu/check_accepted.py   (scripted selector: every accept length 0..H, crops, commits)
#   kernels     benchmarks/gpu/check_kernels.py    (Triton vs PyTorch, paper-sized selector, timed)
#   graphs      benchmarks/gpu/check_graphs.py     (CUDA graph of draft + select, B = 1/8/32)
#   joint_step  benchmarks/gpu/check_joint_step.py (Qwen3-4B per-worker step, activations vs the plan)
#   joint_step_8b                                  (the same at the Qwen3-8B per-worker shape)
#   timing      benchmarks/gpu_timing.py           (Qwen3-4B-shaped layers: verify(1) vs verify(16), AR vs
#                                                   speculative), if time is left
# What comes back: report.md (the summary), results.json (every step's record), gpu_check.log
# (all output). Python: $PYTHON, else `python`, else `python3`. Imports: drelay_model, torch, triton,
# transformers, numpy, safetensors, pytest only — what the GPU machine has. --dry-run runs nothing
# on the device: it says whether each step is ready here (its code imports with this Python's
# packages, its inputs are readable, pytest collects its tests) and whether it would run or skip.
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ -n "${PYTHON:-}" ]]; then PY=$PYTHON
elif command -v python >/dev/null 2>&1; then PY=python
else PY=python3; fi
TOTAL_S="${GPU_CHECK_TOTAL_S:-500}"
DRY=0
COMMIT="${GPU_CHECK_COMMIT:-}"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY=1; shift ;;
    --commit) [[ -n "${2:-}" ]] || { echo "gpu_check.sh: --commit needs a commit id" >&2; exit 2; }; COMMIT=$2; shift 2 ;;
    --commit=*) COMMIT=${1#--commit=}; shift ;;
    -*) echo "gpu_check.sh: unknown option $1 (usage: gpu_check.sh [--dry-run] [--commit ID] [report-dir])" >&2; exit 2 ;;
    *) break ;;
  esac
done
if [[ -z "$COMMIT" ]] && git rev-parse --git-dir >/dev/null 2>&1; then COMMIT=$(git rev-parse HEAD); fi
export GPU_CHECK_COMMIT="${COMMIT:-unknown (no .git here: pass --commit ID or GPU_CHECK_COMMIT)}"
OUTDIR="${OUT:-${1:-outputs/gpu_check}}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
STEPS=(lossless accepted kernels graphs joint_step joint_step_8b)
declare -A LIMIT=([env]=30 [tests]=120 [lossless]=50 [accepted]=60 [kernels]=60 [graphs]=60 [joint_step]=75 [joint_step_8b]=90 [timing]=50)

if (( DRY )); then
  echo "gpu_check.sh --dry-run: is each step ready here, and would it run (nothing runs on the device)"
  echo "python      $PY ($("$PY" --version 2>&1)); commit $GPU_CHECK_COMMIT"
  if ! cuda=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null); then
    echo "every step NOT READY: $PY cannot import torch (set PYTHON)"; exit 1
  fi
  notready=0
  if env_line=$("$PY" benchmarks/gpu/env_info.py --dry-run 2>&1); then
    echo "env         ready; would run (${LIMIT[env]} s) — $env_line"
  else
    echo "env         NOT READY: ${env_line##*$'\n'}"; notready=1
  fi
  if collected=$("$PY" -m pytest -q -p no:cacheprovider --collect-only tests/gpu/test_cuda.py tests/model/test_kernels.py 2>&1 | tail -1) \
     && [[ "$collected" == *"tests collected"* ]]; then
    echo "tests       ready ($collected); would $([[ "$cuda" == 1 ]] && echo "run (${LIMIT[tests]} s)" || echo "skip here: no CUDA device") — pytest tests/gpu/test_cuda.py tests/model/test_kernels.py on CUDA"
  else
    echo "tests       NOT READY: pytest cannot collect tests/gpu/test_cuda.py tests/model/test_kernels.py ($collected)"; notready=1
  fi
  "$PY" benchmarks/gpu/run_step.py --dry-run --device cuda || notready=1
  echo "            (limits: $(for s in "${STEPS[@]}"; do printf '%s %s s, ' "$s" "${LIMIT[$s]}"; done | sed 's/, $//'))"
  if "$PY" benchmarks/gpu_timing.py --help >/dev/null 2>&1; then
    echo "timing      ready; would $([[ "$cuda" == 1 ]] && echo "run if ≥ ${LIMIT[timing]} s are left" || echo "skip here: no CUDA device") — benchmarks/gpu_timing.py (Qwen3-4B-shaped layers)"
  else
    echo "timing      NOT READY: benchmarks/gpu_timing.py does not start with $PY"; notready=1
  fi
  echo "report      → $OUTDIR/report.md, results.json, gpu_check.log (total limit ${TOTAL_S} s)"
  exit $notready
fi

mkdir -p "$OUTDIR"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
LOG="$OUTDIR/gpu_check.log"
: > "$LOG"
START=$SECONDS

# Run "$@" under min(step limit, time left); its output goes to the log. Returns the exit status.
run_limited() {
  local name=$1; shift
  local left=$(( TOTAL_S - (SECONDS - START) ))
  local limit=${LIMIT[$name]}
  (( left < limit )) && limit=$left
  if (( limit < 10 )); then
    echo "{\"step\": \"$name\", \"ok\": true, \"skipped\": \"no time left in the ${TOTAL_S} s budget\"}" > "$WORK/$name.json"
    return 0
  fi
  echo "=== $name (limit ${limit} s) ===" >> "$LOG"
  timeout --kill-after=5 "$limit" "$@" >> "$LOG" 2>&1
  local rc=$?
  if (( rc == 124 || rc == 137 )); then
    echo "{\"step\": \"$name\", \"ok\": false, \"error\": \"timed out after ${limit} s\"}" > "$WORK/$name.json"
  fi
  echo "$name: exit $rc after $(( SECONDS - START )) s in all" | tee -a "$LOG"
  return $rc
}

run_limited env "$PY" benchmarks/gpu/env_info.py --out "$WORK/env.json"

if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  run_limited tests "$PY" -m pytest -q -p no:cacheprovider \
    tests/gpu/test_cuda.py tests/model/test_kernels.py --junitxml="$WORK/tests.xml"
  "$PY" - "$WORK" <<'EOF'
import json, sys, pathlib, xml.etree.ElementTree as ET
work = pathlib.Path(sys.argv[1])
if not (work / "tests.json").exists():
    xml = work / "tests.xml"
    if xml.exists():
        root = ET.parse(xml).getroot()
        s = root if root.tag == "testsuite" else root.find("testsuite")
        counts = {k: int(s.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        failed = [f"{c.get('classname')}::{c.get('name')}" for c in s.iter("testcase") if c.find("failure") is not None or c.find("error") is not None]
        rec = {"step": "tests", "ok": counts["failures"] + counts["errors"] == 0, "result": {**counts, "failed": failed}}
    else:
        rec = {"step": "tests", "ok": False, "error": "pytest wrote no report"}
    (work / "tests.json").write_text(json.dumps(rec, indent=2))
EOF
else
  echo '{"step": "tests", "ok": true, "skipped": "no CUDA device"}' > "$WORK/tests.json"
fi

for step in "${STEPS[@]}"; do
  run_limited "$step" "$PY" benchmarks/gpu/run_step.py "$step" --device cuda --out "$WORK/$step.json"
done

if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  run_limited timing "$PY" benchmarks/gpu_timing.py --out "$WORK/timing.txt" \
    && "$PY" -c "import json,sys; json.dump({'step': 'timing', 'ok': True, 'result': open(sys.argv[1]).read().splitlines()}, open(sys.argv[2], 'w'))" \
         "$WORK/timing.txt" "$WORK/timing.json"
fi

"$PY" benchmarks/gpu/report.py "$WORK" "$OUTDIR" --seconds $(( SECONDS - START ))
