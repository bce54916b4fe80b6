"""Step `env` of the GPU check: versions, the device, the commit under test, and that importing
drelay_model pulls in none of Ray, MLflow, pydantic, the orchestration packages, SGLang or vLLM.

    python benchmarks/gpu/env_info.py --out FILE.json     (the step's record; exit 1 if something leaked)
    python benchmarks/gpu/env_info.py --dry-run           (one line: ready or not, and the versions)

The commit comes from $GPU_CHECK_COMMIT (benchmarks/gpu_check.sh sets it from --commit or git).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

LEAKS = ("ray", "mlflow", "pydantic", "pipelines", "deploy", "sglang", "vllm")
DISTS = (
    "torch",
    "triton",
    "transformers",
    "numpy",
    "safetensors",
    "pytest",
    "PyYAML",
    "ray",
    "mlflow",
    "pydantic",
    "sglang",
    "vllm",
)


def collect() -> dict:
    import drelay_model.decoding  # noqa: F401
    import drelay_model.selectors  # noqa: F401
    import drelay_model.target  # noqa: F401
    import drelay_model.training.step  # noqa: F401
    import torch

    cuda = torch.cuda.is_available()
    info = {
        "commit": os.environ.get("GPU_CHECK_COMMIT") or "unknown (set GPU_CHECK_COMMIT or pass --commit to gpu_check.sh)",
        "python": sys.version.split()[0],
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if cuda else None,
        "device_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None,
        "imported_by_drelay_model": sorted(m for m in LEAKS if m in sys.modules),
    }
    for dist in DISTS:
        try:
            info[dist] = md.version(dist)
        except md.PackageNotFoundError:
            info[dist] = None
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="env_info.py", description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the step's JSON record here")
    ap.add_argument("--dry-run", action="store_true", help="print one line: ready or not, with the versions")
    args = ap.parse_args(argv)
    info = collect()
    ok = not info["imported_by_drelay_model"]
    if args.dry_run:
        versions = ", ".join(f"{k} {info[k]}" for k in ("torch", "triton", "transformers", "numpy"))
        leaked = ", ".join(info["imported_by_drelay_model"])
        print(f"drelay_model imports without {'/'.join(LEAKS)}; {versions}" if ok else f"drelay_model imports {leaked}")
        return 0 if ok else 1
    if args.out:
        Path(args.out).write_text(json.dumps({"step": "env", "ok": ok, "result": info}, indent=2) + "\n")
    print(json.dumps(info))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
