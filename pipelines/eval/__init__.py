"""Evaluation: decode the benchmarks with each method, measure, compare, track and report.

    runner.py       EvalConfig and Evaluation: (benchmark, method) cells, resumable
    results.py      cell records and their JSON store
    prompts.py      conversation turns → prompt ids (chat template, or a hash stand-in for tests)
    metrics.py      flat metric dicts from cells (what MLflow stores)
    session.py      one `drelay eval` session: cells → MLflow runs, files, table, plots
    tracking.py     the MLflow layout of an evaluation, and reading it back for `drelay report`
    report.py       the Table-1 comparison (Markdown, CSV)
    plots.py        matplotlib figures (evaluation and comparison)
    compare.py      replay τ of checkpoint variants over AR's continuations, and the summary
    compare_run.py  one `drelay compare` job end to end

May import: pipelines.common, pipelines.data, drelay_model. Never train, study, cli or deploy.
"""
