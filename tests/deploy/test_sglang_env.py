"""SGLang lives in its own venv (`make sglang-env`): it pins torch 2.14.1 and transformers 5.19.0,
which our package's own requirements exclude, so no extra of ours may depend on it."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_no_extra_of_ours_requires_sglang():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project.get("optional-dependencies", {})
    assert not [(name, req) for name, reqs in extras.items() for req in reqs if re.match(r"sglang\b", req)]
    assert "sglang.srt.plugins" in project["entry-points"]  # the plugin is still found by SGLang


def test_sglang_env_installs_sglangs_own_pins():
    make = (REPO / "Makefile").read_text()
    reqs = (REPO / "deploy" / "sglang" / "requirements-cpu.txt").read_text().split()
    assert "sglang==0.5.23" in make and "torch==2.14.1 torchvision==0.29.1" in make and "test-sglang:" in make
    assert {"transformers==5.19.0", "tokenizers==0.23.2", "openai==2.8.0", "apache-tvm-ffi==0.1.11"} <= set(reqs)
