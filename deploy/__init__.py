"""Serving: Ray Serve application and engine backends (reference PyTorch engine, SGLang).

May import: drelay_model, pipelines.common and pipelines' config modules (`pipelines.<pkg>.config`).
Never the rest of pipelines (the `drelay` CLI imports deploy, lazily, not the other way round).
"""
