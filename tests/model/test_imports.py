"""drelay_model is a pure PyTorch library: it never imports orchestration or serving packages."""

from __future__ import annotations

import ast
from pathlib import Path

FORBIDDEN = {"ray", "mlflow", "sglang", "pipelines", "deploy", "pydantic"}
ROOT = Path(__file__).resolve().parents[2]


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def test_model_package_imports_no_orchestration():
    files = sorted((ROOT / "drelay_model").rglob("*.py"))
    assert files
    offenders = {str(f.relative_to(ROOT)): sorted(_imported_roots(f) & FORBIDDEN) for f in files}
    assert {f: bad for f, bad in offenders.items() if bad} == {}


def test_platform_is_not_a_python_package():
    """A package named `platform` would shadow the standard library and break torch and ray."""
    assert not (ROOT / "platform" / "__init__.py").exists()


def test_source_files_stay_small():
    big = {}
    for folder in ("drelay_model", "pipelines", "deploy", "cli", "benchmarks", "analysis", "tests"):
        for f in (ROOT / folder).rglob("*.py"):
            n = len(f.read_text().splitlines())
            if n >= 400:
                big[str(f.relative_to(ROOT))] = n
    assert big == {}
