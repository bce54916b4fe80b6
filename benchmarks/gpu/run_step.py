"""Run one step of the GPU check (benchmarks/gpu_check.sh), or say what each step would do.

    python benchmarks/gpu/run_step.py STEP [--device cuda] [--scale full] [--out FILE.json]
    python benchmarks/gpu/run_step.py --dry-run [--device cuda]     # every step: ready?, run or skip and why

STEP is one of STEPS (each a module check_<STEP>.py here with DESCRIPTION, NEEDS, run(device, scale) → dict with
"ok", and optionally ready() → None, or why the step cannot run on this machine). The dry run exits 1
when a step is not ready. The result is written as JSON ({"step", "device", "scale", "ok", "seconds", "result"} or
"skipped" / "error") to --out and summarised on stdout; exit 0 when ok or skipped, 1 when a check
failed or raised, 2 on bad arguments. Imports only drelay_model, torch, triton, transformers (and its
pyyaml), so it runs where the GPU machine's packages are all there is.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)  # this folder's modules are imported as benchmarks.gpu.*, never by bare name
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

STEPS = ("lossless", "accepted", "kernels", "graphs", "joint_step", "joint_step_8b")


def skip_reason(needs: tuple[str, ...], device: str, scale: str = "full") -> str | None:
    """Why a step that needs `needs` cannot run here on `device` at `scale`, or None."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    if device == "cpu" and scale == "full" and "cuda" in needs:
        return "the full-size step runs on CUDA (on CPU use --scale tiny)"
    if "triton" in needs and importlib.util.find_spec("triton") is None:
        return "the triton package is not installed"
    return None


def _module(step: str):
    return importlib.import_module(f"benchmarks.gpu.check_{step}")


def run_step(step: str, device: str, scale: str) -> dict:
    mod = _module(step)
    reason = skip_reason(mod.NEEDS, device, scale)
    record = {"step": step, "device": device, "scale": scale, "description": mod.DESCRIPTION}
    if reason:
        return {**record, "ok": True, "skipped": reason}
    start = time.perf_counter()
    try:
        result = mod.run(device, scale)
        record.update(ok=bool(result.get("ok")), result=result)
    except Exception as exc:  # a step that raises is reported (with where), not a lost report
        tb = traceback.extract_tb(exc.__traceback__)[-1]
        record.update(
            ok=False,
            error=f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''} "
            f"({Path(tb.filename).name}:{tb.lineno})",
        )
        traceback.print_exc()
    record["seconds"] = round(time.perf_counter() - start, 1)
    return record


def readiness(mod) -> str | None:
    """Why a step's code is not ready on this machine (whatever the device), or None: its needs
    other than a device (triton), and its own `ready()` where it has one (inputs readable)."""
    missing = skip_reason(tuple(n for n in mod.NEEDS if n != "cuda"), "cpu", "tiny")
    if missing:
        return missing
    check = getattr(mod, "ready", None)
    try:
        return check() if check else None
    except Exception as exc:  # a step that cannot even prepare is not ready, said in one line
        return f"{type(exc).__name__}: {exc}"


def dry_run(device: str) -> tuple[list[str], bool]:
    """One line per step: ready or not (its module imports, its needs are there) and whether it would
    run on `device` or skip, and why → (lines, every step ready)."""
    lines, all_ready = [], True
    for step in STEPS:
        try:
            mod = _module(step)
        except Exception as exc:
            lines.append(f"{step:<11} NOT READY: import failed: {type(exc).__name__}: {exc}")
            all_ready = False
            continue
        why_not = readiness(mod)
        reason = skip_reason(mod.NEEDS, device)
        if why_not:
            state, all_ready = f"NOT READY: {why_not}", False
        else:
            state = "ready; " + ("would skip here: " + reason if reason else "would run")
        lines.append(f"{step:<11} {state} — {mod.DESCRIPTION}")
    return lines, all_ready


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="run_step.py", description=__doc__.splitlines()[0])
    ap.add_argument("step", nargs="?", choices=STEPS)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--scale", default="full", choices=("full", "tiny"), help="tiny: test-sized shapes (CPU checks of the code)")
    ap.add_argument("--out", help="write the JSON record here")
    ap.add_argument("--dry-run", action="store_true", help="list every step and whether it would run here, then exit")
    args = ap.parse_args(argv)
    if args.dry_run:
        lines, all_ready = dry_run(args.device)
        print("\n".join(lines))
        return 0 if all_ready else 1
    if args.step is None:
        ap.error("a STEP is required (or --dry-run)")
    if args.device == "cpu" and args.step == "kernels":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is defined: CPU tensors
    record = run_step(args.step, args.device, args.scale)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    status = "SKIPPED (" + record["skipped"] + ")" if "skipped" in record else ("ok" if record["ok"] else "FAILED")
    print(f"{args.step}: {status}" + (f" — {record['error']}" if "error" in record else "") + f" [{record.get('seconds', 0)} s]")
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
