"""Orchestration: Ray Train/Tune, evaluation, data preparation, configs, MLflow tracking, the `drelay` CLI."""
