"""Trained drafters in the MLflow model registry, and `models:/…` wherever a checkpoint is accepted.

    register_checkpoint(run_id, "drelay-smollm2-135m")        # version N of the training run's drafter/,
                                                              # alias `champion` → N
    drelay eval --checkpoint models:/drelay-smollm2-135m@champion
    drelay eval --checkpoint drelay=models:/drelay-smollm2-135m/3

A version's source is the training run's `drafter/` artifact folder (logged by `drelay train`, with
provenance.json naming the run). `resolve_checkpoint` downloads a version once into
`<output root>/cache/models/<name>/<version>` (atomically) and returns that folder; any other string
comes back unchanged. Registry errors are one line naming the reference.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from drelay_model.errors import DRelayError
from pipelines.common.outputs import join, local_dir, output_root

CHAMPION = "champion"
MODELS = "models:/"
_REF = re.compile(r"^models:/(?P<name>[A-Za-z0-9][\w.+-]*)(?:@(?P<alias>[\w-]+)|/(?P<version>\d+))$")
_NAME = re.compile(r"^[A-Za-z0-9][\w.+-]{0,99}$")


def register_checkpoint(
    run_id: str, name: str, *, artifact_path: str = "drafter", alias: str | None = CHAMPION, client=None
) -> str:
    """Register the run's `artifact_path` folder as a new version of model `name`; point `alias` at it.
    Returns the version (a string, as MLflow numbers them)."""
    from mlflow.exceptions import MlflowException

    from pipelines.common.tracking import get_client

    if not _NAME.match(name):
        raise DRelayError(f"model name {name!r}: use letters, digits, '.', '_', '+', '-'")
    client = client or get_client()
    try:
        run = client.get_run(run_id)
        folder = _checkpoint_folder(client, run_id, artifact_path)
        try:
            client.create_registered_model(name, tags={"drelay.kind": "drafter"})
        except MlflowException:
            pass  # exists already
        source = f"{run.info.artifact_uri.rstrip('/')}/{folder}"
        version = client.create_model_version(name, source, run_id=run_id, tags={"drelay.run_name": run.info.run_name or ""})
        if alias:
            client.set_registered_model_alias(name, alias, version.version)
    except MlflowException as exc:
        raise DRelayError(f"registering run {run_id} as '{name}': {str(exc).splitlines()[0][:200]}") from exc
    return str(version.version)


def _checkpoint_folder(client, run_id: str, artifact_path: str) -> str:
    """The artifact folder holding drafter_config.json: `artifact_path` or one level below it
    (`log_artifact` of a folder nests it under its own name: drafter/drafter/)."""
    for folder in (artifact_path, *(f.path for f in client.list_artifacts(run_id, artifact_path) if f.is_dir)):
        if any(f.path.endswith("/drafter_config.json") for f in client.list_artifacts(run_id, folder)):
            return folder
    raise DRelayError(f"run {run_id} has no drafter checkpoint under '{artifact_path}' to register")


def is_model_ref(ref: str | None) -> bool:
    return bool(ref) and ref.startswith(MODELS)


def resolve_checkpoint(ref: str, *, client=None) -> str:
    """A local checkpoint folder for `ref`: `models:/<name>@<alias>` or `models:/<name>/<version>` is
    downloaded (once) from the registry; anything else is returned unchanged."""
    if not is_model_ref(ref):
        return ref
    m = _REF.match(ref)
    if m is None:
        raise DRelayError(f"checkpoint '{ref}': expected models:/<name>@<alias> or models:/<name>/<version>")
    from mlflow.exceptions import MlflowException

    from pipelines.common.tracking import get_client

    client = client or get_client()
    name = m["name"]
    try:
        mv = client.get_model_version_by_alias(name, m["alias"]) if m["alias"] else client.get_model_version(name, m["version"])
    except MlflowException as exc:
        raise DRelayError(
            f"checkpoint '{ref}': not in the registry at {client.tracking_uri} ({str(exc).splitlines()[0][:160]})"
        ) from exc
    dest = local_dir(join(output_root(), "cache", "models", name, str(mv.version)), "checkpoint cache")
    if not (dest / "drafter_config.json").is_file():
        _download(client, mv.source, dest, ref)
    return str(dest)


def _download(client, source: str, dest: Path, ref: str) -> None:
    """Download a version's files into `dest` through a temporary sibling, renamed into place."""
    import mlflow.artifacts
    from mlflow.exceptions import MlflowException

    from drelay_model.atomic import atomic_directory

    try:
        with atomic_directory(dest) as tmp:
            got = Path(
                mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=str(tmp), tracking_uri=client.tracking_uri)
            )
            if got != Path(tmp):  # downloaded as tmp/<last component>: flatten
                for item in got.iterdir():
                    shutil.move(str(item), tmp)
                got.rmdir()
            if not (Path(tmp) / "drafter_config.json").is_file():
                raise DRelayError(f"checkpoint '{ref}': version source {source} holds no drafter_config.json")
    except (MlflowException, OSError) as exc:
        raise DRelayError(f"checkpoint '{ref}': download from {source} failed ({str(exc).splitlines()[0][:160]})") from exc
