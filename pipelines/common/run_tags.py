"""The MLflow tag vocabulary every run of the platform carries, so a team can filter one server.

    drelay.kind        train | tune | eval | compare | study | serve-bench
    drelay.target      the target spec (`smollm2-135m`, a HF path, `tiny-llama`)
    drelay.method      the method / selector (`native`, `drelay`, …; a comma list for multi-method runs)
    drelay.git_commit  the code's commit (`-dirty` when the tree has changes)
    drelay.hardware    the compute that did the work — for Ray Train runs, rank 0 of the workers
                       overwrites the driver's value with its own (`… × N workers`)
    drelay.checkpoint_run  on eval runs: the MLflow run id that produced the evaluated checkpoint

Filter in the UI or the client: `tags."drelay.kind" = 'eval' and tags."drelay.target" = 'smollm2-135m'`.
"""

from __future__ import annotations

from drelay_model.errors import DRelayError

KIND, TARGET, METHOD = "drelay.kind", "drelay.target", "drelay.method"
GIT_COMMIT, HARDWARE, CHECKPOINT_RUN = "drelay.git_commit", "drelay.hardware", "drelay.checkpoint_run"
KINDS = ("train", "tune", "eval", "compare", "study", "serve-bench")
REQUIRED = (KIND, TARGET, METHOD, GIT_COMMIT, HARDWARE)


def run_tags(kind: str, *, target: str, method: str, hardware: str | None = None) -> dict[str, str]:
    """The five required tags of a run of `kind` (commit and hardware measured here unless given)."""
    from pipelines.common.tracking import git_commit, hardware_description

    if kind not in KINDS:
        raise DRelayError(f"drelay.kind: unknown kind '{kind}' (choose from: {', '.join(KINDS)})")
    return {KIND: kind, TARGET: target, METHOD: method, GIT_COMMIT: git_commit(),
            HARDWARE: hardware if hardware is not None else hardware_description()}  # fmt: skip


def worker_hardware(world_size: int) -> str:
    """`drelay.hardware` as seen by a Ray Train worker: its own compute × the number of workers."""
    from pipelines.common.tracking import hardware_description

    return f"{hardware_description()} × {world_size} worker{'s' if world_size != 1 else ''}"
