"""`drelay submit {train,tune,eval,study,compare,serve-bench} …`: run a command as a Ray job on a
cluster (Ray's Job Submission API); the work is in `pipelines/cluster/submit.py`."""

from __future__ import annotations

from pipelines.cluster.submit import add_parser

__all__ = ["add_parser"]
