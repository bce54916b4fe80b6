"""Studies: a declarative set of training runs in stages, then one replay comparison of their results.

    spec.py     the study spec (YAML under platform/studies/): stages, runs, comparison, shipping
    runner.py   train the runs (resumable), compare their checkpoints, ship one

May import: pipelines.common, pipelines.data, pipelines.train and pipelines.eval (a study is the one
place that strings training and evaluation together), drelay_model. Never cli or deploy.
"""
