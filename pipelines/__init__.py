"""Orchestration on top of drelay_model: data, training (Ray Train), evaluation, studies, MLflow
tracking. Layers, lowest first — a package imports only from layers below it:

    common/   paths, method spec, chat rendering, MLflow connection, JSON store   (drelay_model only)
    data/     evaluation prompt sets, training corpora, regeneration              (+ common)
    eval/     evaluation runner, results, metrics, plots, report, compare         (+ common, data)
    train/    run config, Ray Train driver and worker, training data, model I/O   (+ common, data)
    study/    staged training runs + their comparison                             (+ eval, train)
    cluster/  Ray job submission, platform/cluster spec schemas                   (+ common)
    tune/     Ray Tune sweeps over training configs                               (+ train)

eval and train are siblings and never import each other. Nothing here imports deploy or the
command line (`cli/`, the layer above both); drelay_model never imports pipelines (tests/test_layering.py checks all of this).
"""
