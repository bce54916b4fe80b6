"""The memory figures the docs and the shipped Qwen3 configs quote are `drelay plan`'s output today:
docs/devices.md's plan listing (verbatim) and its sentence on other paths, and each config's comment."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from drelay_model.attention import MATH
from drelay_model.training import memory_plan as mp
from cli import main as drelay
from pipelines.train.config import load_config
from pipelines.train.plan import plan_from_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ("qwen3-4b", "qwen3-8b")
LISTING = "$ for c in qwen3-4b qwen3-8b; do drelay plan --config platform/experiments/$c/train.yaml; done\n"


def _config(name: str) -> str:
    return f"platform/experiments/{name}/train.yaml"


def _gib(n: int) -> str:
    return f"{n / mp.GiB:.1f}"


def test_the_docs_listing_is_drelay_plans_output(capsys):
    outputs = []
    for name in CONFIGS:
        assert drelay(["plan", "--config", _config(name)]) == 0
        outputs.append(capsys.readouterr().out)
    doc = (ROOT / "docs/devices.md").read_text()
    start = doc.index(LISTING) + len(LISTING)
    assert doc[start : doc.index("```", start)] == "".join(outputs)


def test_the_docs_figures_for_other_paths_and_settings_are_the_plans():
    plans = {name: plan_from_config(load_config(_config(name))) for name in CONFIGS}
    math = {n: mp.estimate(*r.shapes, attention=MATH, ddp=r.ddp).total for n, r in plans.items()}
    cpu = {n: plan_from_config(load_config(_config(n)), device="cpu").plan.total for n in CONFIGS}
    one = plan_from_config(load_config(_config("qwen3-4b"), ["train.micro_batches=1"]))
    buckets = {n: r.plan.components["DDP gradient buckets"] for n, r in plans.items()}
    assert not one.fits and all(r.ddp for r in plans.values())
    text = " ".join((ROOT / "docs/devices.md").read_text().split())
    expected = [
        f"would need {_gib(math['qwen3-4b'])} GiB (4B) and {_gib(math['qwen3-8b'])} GiB (8B) per GPU",
        f"on the CPU path {_gib(cpu['qwen3-4b'])} and {_gib(cpu['qwen3-8b'])} GiB",
        f"the 4B plan needs {_gib(one.plan.total)} GiB",
        f"{buckets['qwen3-4b'] / mp.GiB:.2f} GiB for 4B, {buckets['qwen3-8b'] / mp.GiB:.2f} GiB for 8B",
    ]
    for phrase in expected:
        assert phrase in text


@pytest.mark.parametrize("name", CONFIGS)
def test_each_config_quotes_its_plan(name):
    comment = " ".join(
        line.strip().lstrip("#").strip()
        for line in (ROOT / _config(name)).read_text().splitlines()
        if line.strip().startswith("#")
    )
    quoted = re.findall(r"`drelay plan` on CUDA .*? gives ([\d.]+) GiB per GPU", comment)
    assert quoted == [_gib(plan_from_config(load_config(_config(name))).plan.total)]
