"""`drelay jobs {list,logs,stop,check}`: the cluster's Ray jobs and the platform/cluster specs; the
work is in `pipelines/cluster/jobs.py`."""

from __future__ import annotations

from pipelines.cluster.jobs import add_parser

__all__ = ["add_parser"]
