"""vLLM as a peer engine, driven from our venv: `run_vllm` writes a request, runs `runner.py` with the
vLLM venv's Python (`make vllm-env`) and reads its result (see runner.py for both formats).

    python = vllm_python()            # $DRELAY_VLLM_PYTHON, else <repo>/.venv-vllm/bin/python; None if absent
    result = run_vllm(python, {...})  # {"load_s": …, "runs": [{"batch_size", "tokens", "seconds", …}]}
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from drelay_model.errors import DRelayError

REPO = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("runner.py")
VENV_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


def vllm_python() -> Path | None:
    """The vLLM venv's interpreter, if it exists: $DRELAY_VLLM_PYTHON, else <repo>/.venv-vllm."""
    path = Path(os.environ.get("DRELAY_VLLM_PYTHON", VENV_PYTHON)).absolute()  # not resolve(): keep the venv's link
    return path if path.is_file() else None


def mean_acceptance_length(drafts: int, accepted: int) -> float:
    """vLLM's mean acceptance length: tokens per drafted round, 1 + accepted drafts per round."""
    return 1.0 + accepted / drafts if drafts else 0.0


def run_vllm(python: Path, request: dict, *, timeout_s: float = 1800) -> dict:
    """Run `runner.py` on `request` in a child process (its own venv); the parsed result."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    with tempfile.TemporaryDirectory(prefix="drelay-vllm-") as tmp:
        req, res = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps(request))
        proc = subprocess.run([str(python), str(RUNNER), str(req), str(res)], env=env, cwd=tmp,
                              capture_output=True, text=True, timeout=timeout_s)  # fmt: skip
        if proc.returncode != 0 or not res.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise DRelayError(f"vLLM runner failed (exit {proc.returncode}): {tail[0][:300]}")
        return json.loads(res.read_text())


def our_engine(target, method: str, checkpoint: str | None):
    """Our engine for `method` (`ar` or a selector over `checkpoint`) at fixed verification length
    (no measured costs: every round verifies the whole block, as vLLM's DFlash does)."""
    from drelay_model.decoding import SpeculativeEngine
    from pipelines.common.methods import load_method, resolve_method

    spec = resolve_method(method, target_spec=target.name, checkpoint=checkpoint)
    drafter, selector = load_method(spec, target)
    return SpeculativeEngine(target, drafter, selector)
