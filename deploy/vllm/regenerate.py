"""`drelay data regenerate --engine vllm`: the target's greedy answers from vLLM through Ray Data LLM.

Our venv never imports vLLM or Ray Data LLM (vLLM pins its own transformers): each call of
`RayDataVllmGenerator` writes the prompts (token ids rendered by our chat template, so both engines see
the same ids) to a request, runs `deploy/vllm/ray_data_job.py` with the vLLM venv's Python
(`make vllm-env`) in its own process group, and reads the generated ids back. The regeneration loop,
its output format and its resumption are `pipelines/data/regenerate.py`'s; with this engine a batch is
one Ray Data job (one vLLM start-up, about a minute on CPU), so batches are large (`JOB_SIZE`
conversations) and a resumed run restarts the job that was cut.

On a GPU cluster the same job runs with `accelerator="gpu"` and a Ray address (`ray_address`): Ray Data
schedules one engine per GPU (`concurrency`). There the target decodes in bf16, and batched bf16 kernels
differ in rounding from our engine's, so greedy answers can fork from ours after a near-tie; in float32
on CPU they are equal token for token (tests/deploy/test_vllm_peer.py).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from deploy.vllm.peer import run_in_group
from drelay_model.errors import DRelayError

JOB = Path(__file__).resolve().parents[2] / "deploy" / "vllm" / "ray_data_job.py"
JOB_SIZE = 512  # conversations per Ray Data job (one vLLM start-up each)


@dataclass(frozen=True)
class VllmJobSettings:
    python: Path  # the vLLM venv's interpreter
    model: str  # what vLLM loads: an HF directory (the bundled target's cache) or a hub id
    max_new_tokens: int
    stop_token_ids: tuple[int, ...]
    dtype: str = "float32"
    accelerator: str = "cpu"  # "cpu" | "gpu"
    engine_batch_size: int = 16  # rows per call of Ray Data's engine stage
    concurrency: int = 1  # engine replicas (GPUs on a cluster)
    ray_address: str = "local"  # "local": a Ray instance of its own; else a cluster's address
    kv_cache_gib: int = 2
    timeout_s: float = 6 * 3600
    log: Path | None = None  # the job's output (Ray Data progress, vLLM's log); default discarded


class RayDataVllmGenerator:
    """`generate(prompts) -> answers`: one Ray Data LLM job per call, greedy, token ids in and out."""

    def __init__(self, settings: VllmJobSettings) -> None:
        self.settings = settings

    def __call__(self, prompts: list[list[int]]) -> list[list[int]]:
        s = self.settings
        request = {"model": s.model, "rows": [{"key": str(i), "prompt_token_ids": p} for i, p in enumerate(prompts)],
                   "max_new_tokens": s.max_new_tokens, "stop_token_ids": list(s.stop_token_ids), "dtype": s.dtype,
                   "accelerator": s.accelerator, "batch_size": s.engine_batch_size, "concurrency": s.concurrency,
                   "ray_address": s.ray_address, "kv_cache_gib": s.kv_cache_gib}  # fmt: skip
        with tempfile.TemporaryDirectory(prefix="drelay-raydata-") as tmp:
            req, res = Path(tmp) / "request.json", Path(tmp) / "results.jsonl"
            req.write_text(json.dumps(request))
            log = s.log or Path(tmp) / "job.log"
            env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # the request names the Ray instance
            rc = run_in_group([str(s.python), str(JOB), str(req), str(res)], log, s.timeout_s, cwd=tmp, env=env)
            answers = _read_answers(res, len(prompts))
            if rc != 0 or answers is None:
                tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.is_file() else []
                why = "timed out" if rc is None else f"exit {rc}"
                raise DRelayError(f"Ray Data vLLM job failed ({why}): {(tail or ['no output'])[0][:300]}")
        return answers


def _read_answers(path: Path, n: int) -> list[list[int]] | None:
    """The answers in prompt order, or None unless the job finished every row (its summary line)."""
    if not path.is_file():
        return None
    by_key, finished = {}, False
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "summary" in record:
            finished = True
        else:
            by_key[int(record["key"])] = record["token_ids"]
    if not finished or sorted(by_key) != list(range(n)):
        return None
    return [by_key[i] for i in range(n)]


def require_vllm_python() -> Path:
    """The vLLM venv's interpreter; one line saying how to get it when it is missing."""
    from deploy.vllm.peer import vllm_python

    python = vllm_python()
    if python is None:
        raise DRelayError("--engine vllm needs the vLLM venv: run `make vllm-env` (or set DRELAY_VLLM_PYTHON)")
    return python


def vllm_settings(target, spec: str, max_new_tokens: int, dtype: str, device: str, log: Path | None) -> VllmJobSettings:
    """Settings for `target` (loaded in our venv for its chat template and EOS ids)."""
    from deploy.vllm.serve import target_dir

    accelerator = "gpu" if device.startswith("cuda") else "cpu"
    return VllmJobSettings(python=require_vllm_python(), model=target_dir(spec), max_new_tokens=max_new_tokens,
                           stop_token_ids=tuple(target.eos_token_ids), dtype=dtype, accelerator=accelerator, log=log)  # fmt: skip
