"""Drafter (and selector) training on Ray Train.

    config.py     the strict run config (YAML + dotted overrides, ranges checked)
    driver.py     validate inputs, open the MLflow run, run the TorchTrainer, export the checkpoint
    worker.py     the per-worker training loop (DDP), validation, checkpoints
    data.py       training sequences from regenerated data, batching, validation split
    features.py   target context features (computed or cached on disk)
    model_io.py   build the trainable module; save and restore training checkpoints

May import: pipelines.common, pipelines.data, drelay_model. Never eval, study, cli or deploy.
"""
