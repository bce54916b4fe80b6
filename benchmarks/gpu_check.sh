#!/usr/bin/env bash
# The GPU check: one command, at most 8 minutes on one GPU, report under $OUT (or the given folder).
#
#     bash benchmarks/gpu_check.sh [--dry-run] [report-dir]     (report-dir: $OUT, else outputs/gpu_check)
#
# Steps, each under its own time limit (and all under TOTAL_S):
#   env         versions, device, and that drelay_model imports without ray, mlflow, pydantic
#   tests       pytest on CUDA: tests/gpu/test_cuda.py (every selector lossless fp32/bf16 on tiny
#               targets, per-request sampling, a bf16 joint step) and tests/model/test_kernels.py
#               (the Triton kernels compiled, against PyTorch)
#   lossless    benchmarks/gpu/check_lossless.py   (Qwen3 vocabulary, fp32 = HF generate, bf16)
#   kernels     benchmarks/gpu/check_kernels.py    (Triton vs PyTorch, paper-sized selector, timed)
#   graphs      benchmarks/gpu/check_graphs.py     (CUDA graph of draft + select, B = 1/8/32)
#   joint_step  benchmarks/gpu/check_joint_step.py (Qwen3-4B per-worker step, peak vs the plan)
#   timing      benchmarks/gpu_timing.py           (verify(1) vs verify(16), AR vs speculative), if time is left
# What comes back: report.md (the summary), results.json (every step's record), gpu_check.log
# (all output). Python: $PYTHON (default python). Imports: drelay_model, torch, triton,
# transformers, numpy, safetensors, pytest only — what the GPU machine has.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
TOTAL_S="${GPU_CHECK_TOTAL_S:-470}"
DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY=1; shift; fi
OUTDIR="${OUT:-${1:-outputs/gpu_check}}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
STEPS=(lossless kernels graphs joint_step)
declare -A LIMIT=([env]=30 [tests]=120 [lossless]=60 [kernels]=75 [graphs]=75 [joint_step]=110 [timing]=60)

if (( DRY )); then
  echo "gpu_check.sh --dry-run: what a run would do here (nothing is run)"
  if ! cuda=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null); then
    echo "every step would fail: $PY cannot import torch (set PYTHON)"; exit 0
  fi
  echo "env         would run (${LIMIT[env]} s) — versions, device, drelay_model imports without ray/mlflow/pydantic"
  if [[ "$cuda" == 1 ]]; then
    echo "tests       would run (${LIMIT[tests]} s) — pytest tests/gpu/test_cuda.py tests/model/test_kernels.py on CUDA"
  else
    echo "tests       would skip: no CUDA device (the gpu tests skip themselves; test_kernels.py would run interpreted on CPU)"
  fi
  "$PY" benchmarks/gpu/run_step.py --dry-run --device cuda
  echo "            (limits: lossless ${LIMIT[lossless]} s, kernels ${LIMIT[kernels]} s, graphs ${LIMIT[graphs]} s, joint_step ${LIMIT[joint_step]} s)"
  echo "timing      would $([[ "$cuda" == 1 ]] && echo "run if ≥ ${LIMIT[timing]} s are left" || echo "skip: no CUDA device") — benchmarks/gpu_timing.py"
  echo "report      → $OUTDIR/report.md, results.json, gpu_check.log (total limit ${TOTAL_S} s)"
  exit 0
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

run_limited env "$PY" - "$WORK/env.json" <<'EOF'
import importlib.metadata as md, json, subprocess, sys
import drelay_model.decoding, drelay_model.selectors, drelay_model.target, drelay_model.training.step  # noqa: E401
import torch
leaked = sorted(m for m in ("ray", "mlflow", "pydantic", "pipelines", "deploy", "sglang", "vllm") if m in sys.modules)
info = {"python": sys.version.split()[0], "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "device_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if torch.cuda.is_available() else None,
        "imported_by_drelay_model": leaked}
for dist in ("torch", "triton", "transformers", "numpy", "safetensors", "pytest", "PyYAML", "ray", "mlflow", "pydantic", "sglang", "vllm"):
    try:
        info[dist] = md.version(dist)
    except md.PackageNotFoundError:
        info[dist] = None
info["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or None
json.dump({"step": "env", "ok": not leaked, "result": info}, open(sys.argv[1], "w"), indent=2)
print(json.dumps(info))
EOF

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
