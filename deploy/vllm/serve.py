"""`backend: vllm` serve configs: Ray Serve LLM with vLLM and our exported DFlash drafter.

`drelay serve --config platform/serve/smollm2-135m-vllm.yaml` validates the config here (the `vllm:`
section), exports the drafter checkpoint to vLLM's format (deploy/vllm/export.py) into a temp
directory (with `selector: true` the trained selector stays in it and the replica runs with
VLLM_PLUGINS=drelay, so this package's vLLM plugin chooses the drafts; otherwise the selector folder
is dropped and vLLM drafts natively), and runs `serve_llm.py` with the vLLM venv's Python (`make vllm-env`) until SIGINT or
SIGTERM, which it forwards. Ray Serve LLM answers the OpenAI API (`/v1/models`,
`/v1/chat/completions`, `/v1/completions`, streaming) at host:port.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from drelay_model.errors import DRelayError
from pipelines.common.config_base import StrictConfig

SCRIPT = Path(__file__).with_name("serve_llm.py")


class VllmSection(StrictConfig):
    """vLLM behind Ray Serve LLM, with our drafter exported to vLLM's DFlash (or AR without one)."""

    target: str = "smollm2-135m"  # smollm2-135m, a HF directory, or a hub id (GPU hosts)
    checkpoint: str | None = None  # our drafter checkpoint, exported at start; None: AR
    selector: bool = False  # the checkpoint's trained selector chooses the drafts (the DRelay vLLM plugin)
    num_speculative_tokens: int | None = Field(None, ge=1, le=63)  # default: the drafter's block size − 1
    dtype: Literal["float32", "bfloat16", "auto"] = "float32"
    max_model_len: int = Field(2048, ge=64)
    kv_cache_gib: int = Field(2, ge=1)  # VLLM_CPU_KVCACHE_SPACE on CPU
    accelerator: Literal["cpu", "gpu"] = "cpu"
    ray_num_cpus: int = Field(3, ge=3)  # logical CPUs of the local Ray instance: 2 for the LLM server, 1 ingress
    startup_timeout_s: float = Field(600.0, gt=0)

    @model_validator(mode="after")
    def _cpu_dtype(self) -> "VllmSection":
        if self.accelerator == "cpu" and self.dtype == "auto":
            raise ValueError("dtype 'auto' is for GPUs; on CPU say float32 or bfloat16")
        if self.selector and not self.checkpoint:
            raise ValueError("selector: true needs a checkpoint (the selector is the checkpoint's)")
        return self


def target_dir(spec: str) -> str:
    """What vLLM loads as `model_source`: the bundled target's cached HF directory, else `spec`."""
    from drelay_model.target import SMOLLM2, load_target
    from drelay_model.target.loading import cache_root

    if spec == SMOLLM2:
        load_target(SMOLLM2, pack=False)  # converts the bundled GGUF once into the cache
        return str(cache_root() / SMOLLM2)
    return spec


def launch_spec(cfg, draft: Path | None) -> dict:
    """The JSON serve_llm.py reads, from a validated ServeConfig with a `vllm:` section."""
    v = cfg.vllm
    n_spec = v.num_speculative_tokens
    if draft is not None and n_spec is None:
        n_spec = json.loads((draft / "config.json").read_text())["block_size"] - 1
    return {"model_id": cfg.model_id, "model_source": target_dir(v.target), "draft": str(draft) if draft else None,
            "num_speculative_tokens": n_spec, "dtype": v.dtype, "max_model_len": v.max_model_len,
            "kv_cache_gib": v.kv_cache_gib, "accelerator": v.accelerator, "num_replicas": cfg.autoscaling.max_replicas,
            "ray_num_cpus": v.ray_num_cpus, "host": cfg.host, "port": cfg.port,
            "drelay_plugin": bool(draft and v.selector)}  # fmt: skip


def run_vllm_serve(cfg) -> int:
    """Export, start serve_llm.py in the vLLM venv, wait for it; Ctrl-C / SIGTERM stop it."""
    from deploy.vllm.export import export_vllm
    from deploy.vllm.peer import vllm_python
    from deploy.vllm.selector_dir import SELECTOR_DIR
    from drelay_model.target import load_target

    python = vllm_python()
    if python is None:
        raise DRelayError("backend 'vllm' needs the vLLM venv: run `make vllm-env` (or set DRELAY_VLLM_PYTHON)")
    with tempfile.TemporaryDirectory(prefix="drelay-vllm-serve-") as tmp:
        draft = None
        if cfg.vllm.checkpoint:
            target = load_target(cfg.vllm.target, pack=False)
            draft = export_vllm(cfg.vllm.checkpoint, Path(tmp) / "draft", target=target)
            del target
            if cfg.vllm.selector and not (draft / SELECTOR_DIR).is_dir():
                raise DRelayError(f"vllm.selector: checkpoint '{cfg.vllm.checkpoint}' holds no trained selector")
            if not cfg.vllm.selector:
                shutil.rmtree(draft / SELECTOR_DIR, ignore_errors=True)  # native drafting
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(launch_spec(cfg, draft)))
        proc = subprocess.Popen([str(python), str(SCRIPT), str(spec_path)])
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda s, _f: proc.send_signal(s))
        return proc.wait()
