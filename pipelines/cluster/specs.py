"""Schemas of the platform/cluster/ specs: the fields the project relies on, checked strictly, plus
the manifests' required Kubernetes/KubeRay fields (apiVersion, kind, metadata.name, spec.entrypoint,
rayClusterSpec, serveConfigV2 …). KubeRay manifests (RayCluster, RayJob, RayService) are first checked
against KubeRay's own CRD schemas (`crds.py`: unknown fields, types, required fields, enums); other
Kubernetes objects allow other keys (their full schema is Kubernetes'); the project's own files
(runtime env) forbid unknown keys.

    drelay jobs check platform/cluster/*.yaml     # every file valid, every referenced repo path exists
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from drelay_model.errors import DRelayError
from pipelines.cluster.crds import check_manifest
from pipelines.common.config_base import StrictConfig, validate_config
from pipelines.common.outputs import REPO_ROOT

ENTRYPOINT = re.compile(r"^python -m cli (train|tune|eval|study|compare|serve-bench)\b")
# A repo path a spec names: a config/data file under the project's folders.
REPO_REF = re.compile(r"(?<![\w/.:-])((?:platform|data|checkpoints|benchmarks)/[\w./+-]+\.(?:ya?ml|jsonl?|json))")
JOB_ENV = ("DRELAY_OUTPUT_ROOT", "MLFLOW_TRACKING_URI")  # every job needs both (docs/cluster.md)


class _Open(BaseModel):
    """A Kubernetes object: the fields the project relies on are checked, other keys pass (the
    KubeRay CRD schemas check those, in `pipelines/cluster/crds.py`)."""

    model_config = ConfigDict(extra="allow", frozen=True)


class RuntimeEnvSpec(StrictConfig):
    """A Ray runtime env as the project writes it (platform/cluster/runtime_env.yaml, RayJob runtimeEnvYAML)."""

    working_dir: str | None = None
    env_vars: dict[str, str] = Field(default_factory=dict)
    excludes: list[str] | None = None
    pip: list[str] | None = None

    @field_validator("env_vars", mode="before")
    @classmethod
    def _strings(cls, v: Any) -> Any:
        if isinstance(v, dict) and any(not isinstance(x, str) for x in v.values()):
            raise ValueError("values must be strings (quote numbers in YAML)")
        return v


class JobRuntimeEnv(RuntimeEnvSpec):
    """A job's runtime env: must say where outputs go and which MLflow server to log to."""

    @model_validator(mode="after")
    def _job_env(self) -> "JobRuntimeEnv":
        missing = [k for k in JOB_ENV if k not in self.env_vars]
        if missing:
            raise ValueError(f"env_vars must set {', '.join(missing)}")
        root = self.env_vars["DRELAY_OUTPUT_ROOT"]
        if not (root.startswith("/") or "://" in root):
            raise ValueError("env_vars.DRELAY_OUTPUT_ROOT must be an absolute path or a URI")
        return self


class NodeType(StrictConfig):
    resources: dict[str, float]
    min_workers: int = Field(ge=0)
    max_workers: int = Field(ge=0)
    node_config: dict[str, Any]


class ClusterLauncherSpec(_Open):
    """`ray up` config: a head type that exists, at least one GPU node type, `ray start` commands."""

    cluster_name: str
    max_workers: int = Field(ge=0)
    provider: dict[str, Any]
    head_node_type: str
    available_node_types: dict[str, NodeType]
    head_start_ray_commands: list[str]
    worker_start_ray_commands: list[str]

    @model_validator(mode="after")
    def _consistent(self) -> "ClusterLauncherSpec":
        if "type" not in self.provider:
            raise ValueError("provider.type is required")
        if self.head_node_type not in self.available_node_types:
            raise ValueError(f"head_node_type '{self.head_node_type}' is not in available_node_types")
        if not any(t.resources.get("GPU", 0) > 0 for t in self.available_node_types.values()):
            raise ValueError("available_node_types: no node type has GPU resources")
        for field in ("head_start_ray_commands", "worker_start_ray_commands"):
            if not any("ray start" in c for c in getattr(self, field)):
                raise ValueError(f"{field}: no 'ray start' command")
        return self


class Metadata(_Open):
    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)


class _PodTemplate(_Open):
    spec: dict[str, Any]

    @field_validator("spec")
    @classmethod
    def _containers(cls, v: dict) -> dict:
        if not v.get("containers") or any(not c.get("image") for c in v["containers"]):
            raise ValueError("template.spec.containers: every container needs an image")
        return v


class HeadGroup(_Open):
    rayStartParams: dict[str, Any]
    template: _PodTemplate


class WorkerGroup(_Open):
    groupName: str
    replicas: int = Field(ge=0)
    minReplicas: int = Field(ge=0)
    maxReplicas: int = Field(ge=0)
    rayStartParams: dict[str, Any]
    template: _PodTemplate

    @model_validator(mode="after")
    def _bounds(self) -> "WorkerGroup":
        if not self.minReplicas <= self.replicas <= self.maxReplicas:
            raise ValueError(f"workerGroupSpecs '{self.groupName}': need minReplicas ≤ replicas ≤ maxReplicas")
        return self


class RayClusterSpec(_Open):
    rayVersion: str = Field(pattern=r"^2\.6\d\.\d+$")  # the Ray the project is tested with (2.60–2.69)
    headGroupSpec: HeadGroup
    workerGroupSpecs: list[WorkerGroup] = Field(min_length=1)


class RayJobBody(_Open):
    entrypoint: str
    runtimeEnvYAML: str
    rayClusterSpec: RayClusterSpec
    shutdownAfterJobFinishes: bool

    @field_validator("entrypoint")
    @classmethod
    def _drelay(cls, v: str) -> str:
        if not ENTRYPOINT.match(v):
            raise ValueError("must run a drelay command: 'python -m cli <train|tune|eval|…> …'")
        return v

    @field_validator("runtimeEnvYAML")
    @classmethod
    def _env(cls, v: str) -> str:
        JobRuntimeEnv.model_validate(yaml.safe_load(v) or {})
        return v


class RayJob(_Open):
    apiVersion: Literal["ray.io/v1"]
    kind: Literal["RayJob"]
    metadata: Metadata
    spec: RayJobBody


class ServeApp(_Open):
    name: str
    import_path: str = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    route_prefix: str = Field(pattern=r"^/")
    runtime_env: JobRuntimeEnv


class ServeConfigV2(_Open):
    applications: list[ServeApp] = Field(min_length=1)


class RayServiceBody(_Open):
    serveConfigV2: str
    rayClusterConfig: RayClusterSpec

    @field_validator("serveConfigV2")
    @classmethod
    def _serve(cls, v: str) -> str:
        ServeConfigV2.model_validate(yaml.safe_load(v) or {})
        return v


class RayCluster(_Open):
    apiVersion: Literal["ray.io/v1"]
    kind: Literal["RayCluster"]
    metadata: Metadata
    spec: RayClusterSpec


class RayService(_Open):
    apiVersion: Literal["ray.io/v1"]
    kind: Literal["RayService"]
    metadata: Metadata
    spec: RayServiceBody


class Deployment(_Open):
    """The MLflow server: `mlflow server` with a Postgres backend store and object-store artifacts."""

    apiVersion: Literal["apps/v1"]
    kind: Literal["Deployment"]
    metadata: Metadata
    spec: dict[str, Any]

    @model_validator(mode="after")
    def _mlflow(self) -> "Deployment":
        containers = self.spec.get("template", {}).get("spec", {}).get("containers", [])
        command = " ".join(" ".join(c.get("command", []) + c.get("args", [])) for c in containers)
        if "mlflow server" in command:
            if not re.search(r"--backend-store-uri\s+postgresql(\+\w+)?://", command):
                raise ValueError(
                    "mlflow server: --backend-store-uri must be a postgresql:// URI (SQLite cannot take concurrent writers)"
                )
            if not re.search(r"--artifacts-destination\s+(s3|gs|wasbs)://", command):
                raise ValueError("mlflow server: --artifacts-destination must be an object store (s3://, gs://, wasbs://)")
        return self


class Service(_Open):
    apiVersion: Literal["v1"]
    kind: Literal["Service"]
    metadata: Metadata
    spec: dict[str, Any]


KINDS: dict[str, type[BaseModel]] = {
    "RayCluster": RayCluster,
    "RayJob": RayJob,
    "RayService": RayService,
    "Deployment": Deployment,
    "Service": Service,
}


# ---- loading and checking files ---------------------------------------------------------------------


def _documents(path: str | Path) -> list[dict]:
    p = Path(path)
    if not p.is_file():
        raise DRelayError(f"{path}: file not found")
    try:
        docs = [d for d in yaml.safe_load_all(p.read_text()) if d is not None]
    except yaml.YAMLError as exc:
        raise DRelayError(f"{path}: not valid YAML: {str(exc).splitlines()[0]}") from exc
    if not docs or any(not isinstance(d, dict) for d in docs):
        raise DRelayError(f"{path}: every YAML document must be a mapping")
    return docs


def load_runtime_env(path: str | Path) -> RuntimeEnvSpec:
    """A runtime env file (one mapping, the project's strict schema); one-line errors."""
    return validate_config(RuntimeEnvSpec, _documents(path)[0], source=str(path), top="document")


def schema_for(path: Path, doc: dict) -> type[BaseModel]:
    if "kind" in doc:
        if doc["kind"] not in KINDS:
            raise DRelayError(f"{path}: kind '{doc['kind']}' is not one of {', '.join(KINDS)}")
        return KINDS[doc["kind"]]
    if "available_node_types" in doc:
        return ClusterLauncherSpec
    if path.name.startswith("runtime_env"):
        return JobRuntimeEnv
    raise DRelayError(f"{path}: unknown spec (no 'kind', not a cluster launcher config, not runtime_env*.yaml)")


def referenced_paths(doc: Any) -> set[str]:
    """Repo paths a document names: config/data files in any string (nested YAML included) and the
    modules of Serve `import_path`s (as `deploy/serve/app.py`)."""
    found: set[str] = set()
    if isinstance(doc, dict):
        for key, value in doc.items():
            if key == "import_path" and isinstance(value, str):
                found.add(value.partition(":")[0].replace(".", "/") + ".py")
            found |= referenced_paths(value)
    elif isinstance(doc, list):
        for value in doc:
            found |= referenced_paths(value)
    elif isinstance(doc, str):
        found |= set(REPO_REF.findall(doc))
        if "\n" in doc and ":" in doc:  # an embedded YAML document (runtimeEnvYAML, serveConfigV2)
            try:
                found |= referenced_paths(yaml.safe_load(doc))
            except yaml.YAMLError:
                pass
    return found


def _exists(ref: str, repo: Path) -> bool:
    p = repo / ref
    return p.exists() or (ref.endswith(".py") and (repo / ref.removesuffix(".py") / "__init__.py").is_file())


def check_spec_file(path: str | Path, *, repo: Path = REPO_ROOT, check_refs: bool = True) -> list[BaseModel]:
    """Validate every document of a spec file (KubeRay kinds against KubeRay's CRD schema first, then
    the project's schema) and that every repo path it names exists.
    Raises a one-line `DRelayError` naming the file and the field."""
    path = Path(path)
    out = []
    for doc in _documents(path):
        schema = schema_for(path, doc)
        problem = check_manifest(doc)
        if problem:
            raise DRelayError(f"{path}: {problem}")
        out.append(validate_config(schema, doc, source=str(path), top="document"))
        for ref in sorted(referenced_paths(doc)) if check_refs else ():
            if not _exists(ref, repo):
                raise DRelayError(f"{path}: references '{ref}', which does not exist in the repository")
    return out
