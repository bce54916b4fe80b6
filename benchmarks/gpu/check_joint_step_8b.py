"""Step `joint_step_8b`: the `joint_step` check (check_joint_step.py) at platform/experiments/qwen3-8b/
train.yaml's per-worker shape: a random-weight Qwen3-8B target (36 layers, width 4,096, untied head,
bf16), its 5-layer drafter and paper-sized selector; measured activations vs the plan's (±15%)."""

from __future__ import annotations

from benchmarks.gpu import check_joint_step

DESCRIPTION = "one bf16 joint step at the Qwen3-8B per-worker shape, measured activations vs the memory plan's (±15%)"
NEEDS = check_joint_step.NEEDS


def run(device: str, scale: str) -> dict:
    return check_joint_step.run(device, scale, model="qwen3-8b")


def ready() -> str | None:
    return check_joint_step.ready("qwen3-8b")
