"""`drelay jobs {list,logs,stop}`: the Ray jobs of a cluster (address: `--address` or `$RAY_ADDRESS`).

drelay jobs list                    # id, status, command, start time — newest last
drelay jobs logs JOB_ID [--follow]
drelay jobs stop JOB_ID
drelay jobs check platform/cluster/*.yaml   # validate specs before `kubectl apply` / `ray up` (no cluster needed)
"""

from __future__ import annotations

import argparse
import time

from drelay_model.errors import DRelayError
from pipelines.cluster.submit import add_address_flag, connect, follow


def add_parser(sub) -> None:
    p = sub.add_parser("jobs", help="list, read or stop the Ray jobs of a cluster", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    ls = actions.add_parser("list", help="the cluster's jobs")
    add_address_flag(ls)
    ls.set_defaults(run=run_list)
    logs = actions.add_parser("logs", help="a job's logs")
    add_address_flag(logs)
    logs.add_argument("job_id")
    logs.add_argument("--follow", action="store_true", help="keep streaming until the job ends")
    logs.set_defaults(run=run_logs)
    stop = actions.add_parser("stop", help="stop a job")
    add_address_flag(stop)
    stop.add_argument("job_id")
    stop.set_defaults(run=run_stop)
    check = actions.add_parser("check", help="validate platform/cluster specs (schemas, KubeRay CRDs, referenced repo paths)")
    check.add_argument("files", nargs="+")
    check.set_defaults(run=run_check)


def run_list(args: argparse.Namespace) -> int:
    jobs = sorted(connect(args.address).list_jobs(), key=lambda j: j.start_time or 0)
    print(f"{'JOB ID':<44} {'STATUS':<10} {'COMMAND':<10} STARTED")
    for j in jobs:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime((j.start_time or 0) / 1000))
        command = (j.metadata or {}).get("drelay.command", "-")
        print(f"{j.submission_id or j.job_id:<44} {j.status.value:<10} {command:<10} {started}")
    return 0


def _known(client, job_id: str) -> None:
    try:
        client.get_job_info(job_id)
    except RuntimeError as exc:
        raise DRelayError(f"job '{job_id}' not found ({str(exc).splitlines()[0][:160]})") from exc


def run_logs(args: argparse.Namespace) -> int:
    client = connect(args.address)
    _known(client, args.job_id)
    if args.follow:
        return follow(client, args.job_id)
    print(client.get_job_logs(args.job_id), end="")
    return 0


def run_stop(args: argparse.Namespace) -> int:
    client = connect(args.address)
    _known(client, args.job_id)
    stopped = client.stop_job(args.job_id)
    print(f"{args.job_id}: {'stop requested' if stopped else 'already finished'}")
    return 0


def run_check(args: argparse.Namespace) -> int:
    from pipelines.cluster.crds import KUBERAY_RELEASE, SCHEMA_FILES
    from pipelines.cluster.specs import check_spec_file

    for f in args.files:
        kinds = [type(m).__name__ for m in check_spec_file(f)]
        crd = f"; KubeRay {KUBERAY_RELEASE} CRD schema" if set(kinds) & set(SCHEMA_FILES) else ""
        print(f"{f}: ok ({', '.join(kinds)}{crd})")
    return 0
