"""`drelay submit`: run a `drelay` command as a Ray job on a cluster (Ray's Job Submission API).

    drelay submit --address http://head:8265 --output-root /mnt/shared/drelay eval --limit 8
    drelay submit train --config platform/experiments/smollm2-135m/train.yaml ray.num_workers=4

The job's entrypoint is the same `drelay` command (`python -m cli COMMAND ARGS…`), run in
a copy of this checkout (Ray's `working_dir`, minus outputs, the venv, caches and .git) with
`$DRELAY_OUTPUT_ROOT` set, so everything it writes lands on the cluster's shared storage, never in
the temporary working directory Ray unpacks it into. `$MLFLOW_TRACKING_URI` is forwarded when set.
The address comes from `--address` or `$RAY_ADDRESS` (the dashboard, port 8265). Prints the job
id, then follows the job's logs until it ends (`--no-wait` returns at once); exit 0 iff SUCCEEDED.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shlex
import sys
import time
from pathlib import Path


from drelay_model.errors import DRelayError
from pipelines.common.outputs import OUTPUT_ROOT_ENV, REPO_ROOT, is_uri
from pipelines.common.yaml_file import read_mapping

ADDRESS_ENV = "RAY_ADDRESS"
# Commands a job may run; any other registered `drelay` command works the same way once listed here.
SUBMITTABLE = ("train", "tune", "eval", "study", "compare", "serve-bench")
EXCLUDES = (".git", ".venv", "outputs", "mlruns", "mlflow.db", "**/__pycache__", "*.egg-info", ".pytest_cache",
            ".ruff_cache", ".cache")  # fmt: skip
FORWARDED_ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN",
                 "MLFLOW_S3_ENDPOINT_URL", "DRELAY_CACHE_DIR")  # fmt: skip
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


def add_address_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", help=f"Ray dashboard address, e.g. http://head:8265 (default: ${ADDRESS_ENV})")


def add_parser(sub) -> None:
    p = sub.add_parser("submit", help="run a drelay command as a Ray job on a cluster", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_address_flag(p)
    p.add_argument("--output-root", help=f"shared storage for the job's outputs (default: ${OUTPUT_ROOT_ENV})")
    p.add_argument("--runtime-env", help="YAML runtime env merged into the job's (e.g. platform/cluster/runtime_env.yaml)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra environment variable (repeatable)")
    p.add_argument("--exclude", action="append", default=[], metavar="PATTERN", help="more working_dir excludes (repeatable)")
    p.add_argument("--num-gpus", type=float, default=0, help="GPUs reserved for the entrypoint (default 0: workers ask)")
    p.add_argument("--python", default="python", help="interpreter on the cluster's nodes (default: python)")
    p.add_argument("--no-wait", action="store_true", help="print the job id and return; do not follow the logs")
    p.add_argument("command", choices=SUBMITTABLE, help="the drelay command the job runs")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments, as for a local run")
    p.set_defaults(run=run)


def job_output_root(flag: str | None) -> str:
    """The job's output root: absolute or a URI (a relative path would land in the job's working dir)."""
    root = (flag or os.environ.get(OUTPUT_ROOT_ENV, "")).strip()
    if not root:
        raise DRelayError(f"--output-root: not set (nor ${OUTPUT_ROOT_ENV}); a job needs shared storage every node can reach")
    if not is_uri(root) and not Path(root).expanduser().is_absolute():
        raise DRelayError(f"--output-root: '{root}' must be an absolute path or a URI (s3://…, gs://…)")
    return root if is_uri(root) else str(Path(root).expanduser())


def runtime_env(output_root: str, *, extra_file: str | None, env: list[str], excludes: list[str]) -> dict:
    """working_dir = this checkout (minus EXCLUDES), env_vars = output root + forwarded MLflow settings,
    merged over the runtime env file (validated against pipelines/cluster/specs.py)."""
    base: dict = {}
    if extra_file:
        from pipelines.cluster.specs import load_runtime_env

        base = load_runtime_env(extra_file).model_dump(exclude_none=True)
    env_vars = dict(base.pop("env_vars", {}) or {})
    env_vars.update({k: os.environ[k] for k in FORWARDED_ENV if os.environ.get(k)})
    for item in env:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise DRelayError(f"--env {item!r}: expected KEY=VALUE")
        env_vars[key.strip()] = value
    env_vars.update({OUTPUT_ROOT_ENV: output_root, "PYTHONUNBUFFERED": "1"})
    all_excludes = [*EXCLUDES, *(base.pop("excludes", None) or []), *excludes]
    return {**base, "working_dir": str(REPO_ROOT), "excludes": all_excludes, "env_vars": env_vars}


def connect(address: str | None):
    """A `JobSubmissionClient`; no address or an unreachable one is a one-line `DRelayError`."""
    address = address or os.environ.get(ADDRESS_ENV)
    if not address:
        raise DRelayError(f"--address: not set (nor ${ADDRESS_ENV}); give the Ray dashboard, e.g. http://head:8265")
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(address, headers=auth_headers())
    except Exception as exc:  # noqa: BLE001 - connection, auth and version errors all mean "cannot submit"
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise DRelayError(f"--address {address}: cannot reach the Ray job server ({first[:200]})") from exc


def auth_headers() -> dict[str, str]:
    """Ray 2.60 turns token auth on for clusters started by `ray start`; its SDK sends the token
    only when `$RAY_AUTH_MODE=token` is set in the client. We send it whenever one is available:
    `$RAY_AUTH_TOKEN`, else the file `$RAY_AUTH_TOKEN_PATH`, else `~/.ray/auth_token` (where
    `ray start` writes it). A server without auth ignores the header."""
    token = os.environ.get("RAY_AUTH_TOKEN", "").strip()
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    if not token and path.is_file():
        token = path.read_text().strip()
    return {"Authorization": f"Bearer {token}"} if token else {}


def entrypoint(python: str, command: str, args: list[str]) -> str:
    return shlex.join([python, "-m", "cli", command, *args])


def run(args: argparse.Namespace) -> int:
    root = job_output_root(args.output_root)
    env = runtime_env(root, extra_file=args.runtime_env, env=args.env, excludes=args.exclude)
    client = connect(args.address)
    job_id = f"drelay-{args.command}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
    from pipelines.common.tracking import git_commit

    submit_with_retry(
        client, entrypoint=entrypoint(args.python, args.command, list(args.args)), submission_id=job_id, runtime_env=env,
        entrypoint_num_gpus=args.num_gpus or None, metadata={"drelay.command": args.command, "drelay.git_commit": git_commit()},
    )  # fmt: skip
    print(job_id, flush=True)
    print(f"drelay: submitted {args.command} as {job_id}; outputs → {root}", file=sys.stderr)
    if args.no_wait:
        return 0
    return follow(client, job_id)


def submit_with_retry(client, *, timeout_s: float = 120.0, **job) -> None:
    """`submit_job`, retried while a freshly started head has no job agent yet (HTTP 500 "No available
    agent"); other refusals (bad runtime env, duplicate id, auth) are one-line errors."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.submit_job(**job)
            return
        except RuntimeError as exc:
            text = str(exc)
            if "No available agent" in text and time.monotonic() < deadline:
                time.sleep(2)
                continue
            raise DRelayError(f"the job server refused the job: {text.strip().splitlines()[0][:240]}") from exc


def follow(client, job_id: str) -> int:
    """Stream the job's logs to stdout until it ends; exit 0 iff it SUCCEEDED (Ctrl-C detaches)."""

    async def tail() -> None:
        async for lines in client.tail_job_logs(job_id):
            print(lines, end="", flush=True)

    try:
        asyncio.run(tail())
        status = wait(client, job_id)
    except KeyboardInterrupt:
        print(f"drelay: detached; the job keeps running (drelay jobs stop {job_id})", file=sys.stderr)
        return 130
    print(f"drelay: job {job_id} {status}", file=sys.stderr)
    return 0 if status == "SUCCEEDED" else 1


def wait(client, job_id: str, *, timeout_s: float = 60.0) -> str:
    """The job's terminal status (the log stream can close a moment before the status is final)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = str(client.get_job_status(job_id).value)
        if status in TERMINAL or time.monotonic() > deadline:
            return status
        time.sleep(0.5)


def load_yaml(path: str, field: str) -> dict:
    return read_mapping(path, f"{field}: file")
