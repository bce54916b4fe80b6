"""Ray Tune sweeps over training configs (`drelay tune`; the command is `cli/tune.py`).

    config.py  the sweep config: base training config, search space over dotted paths (validated
               against the training schema), search algorithm, ASHA, metric, resources
    trial.py   one trial = one Ray Train run (run_training with Tune's report callback), unique names
    runner.py  the Tuner: resume, MLflow parent run with nested trial runs, the best config as YAML
    report.py  trial table, parallel-coordinates and τ-vs-parameter plots on the parent run

May import: pipelines.common, pipelines.train, drelay_model, ray.tune, mlflow, matplotlib.
"""
