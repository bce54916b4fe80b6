"""Serve configs: one strict YAML file per endpoint under platform/serve/.

    drelay serve --config platform/serve/smollm2-135m.yaml

Unknown keys are rejected and values range-checked, so a typo is a one-line error naming the field.
Secrets never live in the file: `auth.api_key_env` names an environment variable holding the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from deploy.vllm.serve import VllmSection
from drelay_model.decoding.admission import DEFAULT_PREFILL_BUDGET
from drelay_model.decoding.generation import DEFAULT_MAX_NEW_TOKENS, MAX_TEMPERATURE
from pipelines.common.config_base import StrictConfig, validate_config
from pipelines.common.yaml_file import read_mapping


class EngineSection(StrictConfig):
    """The project's own engine (CPU or GPU) with any registered selector, or `ar`."""

    target: str = "smollm2-135m"
    method: str = "drelay"
    checkpoint: str | None = None  # default: the drafter bundled for the target (checkpoints/<target>)
    random_drafter: bool = False  # an untrained drafter (tests and timing only)
    tokenizer: str | None = None  # default: the target's own; else a HF directory or 'smollm2-135m'
    device: Literal["cpu", "cuda", "auto"] = "cpu"  # auto: CUDA when present
    dtype: Literal["float32", "bfloat16"] = "float32"
    max_batch: int = Field(16, ge=1, le=1024)  # rows decoded together (continuous batching)
    # torch's intra-op threads in each replica. Default (None): the engine's auto policy, the cores of the
    # replica's CPU affinity that other processes leave free, re-measured as it decodes
    # (drelay_model/kernels/threads.py), never Ray's OMP_NUM_THREADS = the replica's `num_cpus` (1 in
    # the shipped configs); `num_cpus` stays Ray's scheduling reservation. A count fixes it.
    threads: int | None = Field(None, ge=1, le=1024)
    # prompt tokens the continuous batcher prefills per step, first in first out, between the running
    # rows' rounds; a prompt longer than it is prefilled in chunks over several steps
    # (drelay_model/decoding/admission.py, docs/serving.md). It bounds how long a burst of arrivals
    # stalls the rows already decoding, and how long an arrival waits for the prefills ahead of it.
    prefill_budget: int = Field(DEFAULT_PREFILL_BUDGET, ge=16, le=1_000_000)
    # cost (default): each round verifies as many drafts as pay off on this machine at the batch's
    # current size (0: an AR round for the whole batch; the cost surface over batch sizes 1 … max_batch
    # is measured once per machine at the first start and cached, `drelay costs`); fixed: the
    # selector's whole path (the paper's setting). Greedy output and seeded samples are the same
    # either way (docs/verification-length.md).
    verify_length: Literal["fixed", "cost"] = "cost"


class SGLangSection(StrictConfig):
    """An SGLang server subprocess with the DRelay algorithm (GPU hosts), run by SGLang's own
    interpreter: SGLang pins torch and transformers versions this project's environment cannot
    share, so the replica (this environment) starts `<python> -m sglang.launch_server`."""

    model_path: str  # the target: a HF directory or hub id
    # models:/<name>@<alias> or models:/<name>/<version> (MLflow registry), a drafter checkpoint folder
    # (both exported to SGLang's format on first use, cached per version), or an SGLang export.
    draft_model_path: str
    # SGLang's interpreter (a venv or the container image's Python holding sglang and this project
    # `--no-deps`); default $DRELAY_SGLANG_PYTHON, else <repo>/.venv-sglang/bin/python.
    python: str | None = None
    algorithm: str = "DRELAY"
    num_draft_tokens: int = Field(16, ge=2, le=64)
    context_length: int | None = Field(None, ge=1)  # default: the target config's max_position_embeddings
    draft_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"  # of the export (the target's serving dtype)
    tokenizer: str | None = None  # the replica's tokenizer: default the target's; else a HF directory or 'smollm2-135m'
    port: int = Field(30000, ge=1024, le=65535)
    mem_fraction_static: float = Field(0.8, gt=0.0, le=1.0)
    extra_args: tuple[str, ...] = ()
    startup_timeout_s: float = Field(900.0, gt=0)
    log_file: str | None = None  # the server's stdout/stderr; default: the replica's (Ray's worker log)


class LimitsSection(StrictConfig):
    """Per-request limits: a request over them gets a 400 naming the field."""

    max_tokens: int = Field(1024, ge=1)  # largest max_tokens a request may ask for
    default_max_tokens: int = Field(DEFAULT_MAX_NEW_TOKENS, ge=1)
    max_prompt_tokens: int = Field(4096, ge=1)
    max_temperature: float = Field(2.0, ge=0.0, le=MAX_TEMPERATURE)
    max_waiting: int = Field(32, ge=0)  # requests queued in a replica beyond its batch; more → 503
    retry_after_s: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _defaults_fit(self) -> "LimitsSection":
        if self.default_max_tokens > self.max_tokens:
            raise ValueError(f"default_max_tokens ({self.default_max_tokens}) exceeds max_tokens ({self.max_tokens})")
        return self


class AutoscalingSection(StrictConfig):
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float = Field(4.0, gt=0)
    upscale_delay_s: float = Field(10.0, ge=0)
    downscale_delay_s: float = Field(60.0, ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> "AutoscalingSection":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})")
        return self


class AuthSection(StrictConfig):
    api_key_env: str | None = None  # when set (and the variable is non-empty), requests need `Bearer <key>`


class ServeConfig(StrictConfig):
    model_id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/+-]{0,127}$")  # the name clients send as `model`
    backend: Literal["engine", "sglang", "vllm"] = "engine"
    engine: EngineSection = EngineSection()
    sglang: SGLangSection | None = None
    vllm: VllmSection | None = None  # Ray Serve LLM + vLLM with our exported drafter (deploy/vllm/serve.py)
    limits: LimitsSection = LimitsSection()
    autoscaling: AutoscalingSection = AutoscalingSection()
    max_ongoing_requests: int = Field(48, ge=1)  # per replica (Ray Serve)
    max_queued_requests: int = Field(256, ge=-1)  # at the proxy, across replicas (-1: unbounded)
    num_cpus: float = Field(1.0, gt=0)  # per replica: Ray's scheduling reservation (torch's threads: engine.threads)
    num_gpus: float = Field(0.0, ge=0)
    graceful_shutdown_timeout_s: float = Field(60.0, ge=0)  # in-flight requests get this long to finish
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)  # Ray Serve's HTTP proxy (balances over the replicas)
    # direct (default): each replica also answers on a port of its own from `direct_port` up, with no
    # proxy hop (Ray Serve's throughput-optimized mode, deploy/serve/ingress.py); proxy: `port` only.
    ingress: Literal["direct", "proxy"] = "direct"
    direct_port: int = Field(32000, ge=1024, le=64536)
    route_prefix: str = "/"
    auth: AuthSection = AuthSection()

    @model_validator(mode="after")
    def _backend_section(self) -> "ServeConfig":
        if self.backend == "sglang" and self.sglang is None:
            raise ValueError("backend 'sglang' needs an `sglang:` section")
        if self.backend == "vllm" and self.vllm is None:
            raise ValueError("backend 'vllm' needs a `vllm:` section")
        if self.backend == "engine" and self.max_ongoing_requests < self.engine.max_batch:
            raise ValueError(
                f"max_ongoing_requests ({self.max_ongoing_requests}) is below engine.max_batch ({self.engine.max_batch})"
            )
        return self

    @property
    def method(self) -> str:
        """What the response reports as the decoding method."""
        if self.backend == "vllm":
            return ("drelay" if self.vllm.selector else "dflash") if self.vllm.checkpoint else "ar"
        return self.engine.method if self.backend == "engine" else self.sglang.algorithm.lower()


def parse_config(doc: dict, *, source: str = "serve config") -> ServeConfig:
    return validate_config(ServeConfig, doc, source=source, top="(top level)")


def load_serve_config(path: str | Path, overrides: dict | None = None) -> ServeConfig:
    """Read a YAML serve config (plus top-level overrides) into a validated `ServeConfig`."""
    doc = read_mapping(path, "serve config")
    return parse_config({**doc, **(overrides or {})}, source=str(path))
