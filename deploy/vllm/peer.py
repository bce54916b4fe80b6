"""vLLM as a peer engine, driven from our venv: `run_vllm` writes a request, runs `runner.py` with the
vLLM venv's Python (`make vllm-env`) and reads its result (see runner.py for both formats).

    python = vllm_python()            # $DRELAY_VLLM_PYTHON, else <repo>/.venv-vllm/bin/python; None if absent
    result = run_vllm(python, {...})  # {"load_s": …, "runs": [{"batch_size", "tokens", "seconds", …}]}
"""

from __future__ import annotations

import json
import os
import signal
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


def run_vllm(python: Path, request: dict, *, timeout_s: float = 1800, log: Path | None = None, env: dict | None = None) -> dict:
    """Run `runner.py` on `request` in a child process (its own venv and process group); the parsed
    result. The child's output goes to `log` (default: discarded after a failure's last line is shown).
    Past `timeout_s` the whole group (vLLM's engine core and workers too) is killed and whatever
    batch sizes had finished come back, with "timed_out": True; no result at all is an error.
    `env` adds variables (e.g. VLLM_PLUGINS=drelay)."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"), **(env or {})}
    with tempfile.TemporaryDirectory(prefix="drelay-vllm-") as tmp:
        req, res = Path(tmp) / "request.json", Path(tmp) / "result.json"
        log = Path(log) if log else Path(tmp) / "runner.log"
        req.write_text(json.dumps(request))
        rc = run_in_group([str(python), str(RUNNER), str(req), str(res)], log, timeout_s, cwd=tmp, env=env)
        if not res.is_file() or rc not in (0, None):
            lines = log.read_text(errors="replace").strip().splitlines()
            errors = [line for line in lines if "Error" in line or "Exception" in line]
            tail = (errors or lines)[-1:] or ["no output"]
            why = f"no result within {timeout_s:.0f} s" if rc is None else f"exit {rc}"
            raise DRelayError(f"vLLM runner failed ({why}): {tail[0][:300]}")
        return {**json.loads(res.read_text()), "timed_out": rc is None}


def run_in_group(cmd: list[str], log: Path, timeout_s: float, *, cwd: str, env: dict) -> int | None:
    """Run `cmd` in a process group of its own, its output appended to `log`; past `timeout_s` or on
    an interrupt kill the whole group (vLLM starts an engine core and workers, Ray its daemons).
    The exit code; None when it timed out."""
    with Path(log).open("a") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env=env, start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            return None
        except BaseException:
            kill_group(proc)
            raise


def kill_group(proc: subprocess.Popen, grace_s: float = 20) -> None:
    """SIGTERM to `proc`'s process group, up to `grace_s` for `proc` to exit, then SIGKILL to whatever
    is left of the group."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def our_engine(target, method: str, checkpoint: str | None):
    """Our engine for `method` (`ar` or a selector over `checkpoint`) at fixed verification length
    (no measured costs: every round verifies the whole block, as vLLM's DFlash does)."""
    from drelay_model.decoding import SpeculativeEngine
    from pipelines.common.methods import load_method, resolve_method

    spec = resolve_method(method, target_spec=target.name, checkpoint=checkpoint)
    drafter, selector = load_method(spec, target)
    return SpeculativeEngine(target, drafter, selector)
