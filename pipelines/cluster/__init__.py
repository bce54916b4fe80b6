"""Running the platform on a shared cluster: job submission through Ray's Job Submission API
(`submit.py`, `jobs.py`) and the schemas of the platform/cluster specs (`specs.py`). Where things are
written (the output root), run tags, checkpoint provenance and the MLflow model registry live in
`pipelines/common/` (every layer needs them).

May import: pipelines.common, drelay_model, ray (lazily), yaml, pydantic.
"""
