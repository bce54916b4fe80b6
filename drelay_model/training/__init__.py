"""Training math for the block drafter and trainable selectors (pure PyTorch; the loop, Ray and MLflow
live in pipelines/train/).

    anchors.py    which positions open a training block: uniform samples + the no-gradient scout
    losses.py     DRelay's objective as tensor math: support CE, Eq. 3, Eq. 5 credit, Eq. 4
    schedules.py  learning rate and per-slot support weights as functions of the step
    step.py       one training step (drafter alone or jointly with a selector) and its metrics

May import: torch, drelay_model.drafter, drelay_model.selectors, drelay_model.decoding.verify. Never ray, mlflow or pipelines.
"""
