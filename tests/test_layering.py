"""The architecture, checked: layers import only downwards, modules import in no cycle, and no
`drelay` command module imports another. Imports are read with `ast` (nothing is executed), lazy
imports inside functions included.

    drelay_model  ←  pipelines  ←  deploy  ←  cli          (← = "is imported by")
    inside pipelines:  common ← data ← {eval, train} ← {study, cluster, tune}   (siblings in braces)

drelay_model imports none of pipelines, deploy, cli, ray, mlflow, sglang. pipelines imports neither
deploy nor cli; deploy may import drelay_model, pipelines.common and the config modules of pipelines
(`pipelines.<pkg>.config`), never cli. cli, the `drelay` command line, sits on top of everything.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("drelay_model", "pipelines", "deploy", "cli")
MODEL_FORBIDDEN = ("pipelines", "deploy", "cli", "ray", "mlflow", "sglang")
PIPELINES_RANK = {"common": 0, "data": 1, "eval": 2, "train": 2, "study": 3, "cluster": 3, "tune": 3}
CLI_SHARED = {"cli", "cli.main", "cli.__main__", "cli.options"}


@dataclass(frozen=True)
class Edge:
    source: str  # importing module, dotted
    target: str  # imported module (or the closest module above an imported name), dotted
    line: int


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def scan(root: Path, packages=PACKAGES) -> tuple[set[str], list[Edge]]:
    """All modules of `packages` under `root` and every import edge out of them."""
    files = {module_name(f, root): f for pkg in packages if (root / pkg).is_dir() for f in sorted((root / pkg).rglob("*.py"))}
    edges = []
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                edges += [Edge(mod, a.name, node.lineno) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    pkg = pkg[: len(pkg) - node.level + 1]
                    base = ".".join(pkg + ([base] if base else []))
                for a in node.names:  # `from pkg import module` imports pkg.module
                    full = f"{base}.{a.name}"
                    edges.append(Edge(mod, full if full in files else base, node.lineno))
    return set(files), edges


def _pipelines_package(mod: str) -> str | None:
    parts = mod.split(".")
    return parts[1] if parts[0] == "pipelines" and len(parts) > 1 else None


def _is_command(mod: str) -> bool:
    return mod.startswith("cli.") and mod not in CLI_SHARED


def layer_violations(edges: list[Edge]) -> list[str]:
    bad = []
    for e in edges:
        src_root, dst_root = e.source.split(".")[0], e.target.split(".")[0]
        where = f"{e.source}:{e.line} imports {e.target}"
        if src_root == "drelay_model" and dst_root in MODEL_FORBIDDEN:
            bad.append(f"{where} (drelay_model is pure PyTorch)")
        elif src_root in ("pipelines", "deploy") and dst_root == "cli":
            bad.append(f"{where} (only cli imports cli: it sits on top of everything)")
        elif src_root == "pipelines" and dst_root == "deploy":
            bad.append(f"{where} (only cli may import deploy)")
        elif src_root == "deploy" and dst_root == "pipelines":
            pkg = _pipelines_package(e.target)
            if pkg != "common" and not e.target.endswith(".config"):
                bad.append(f"{where} (deploy may import only pipelines.common and pipelines config modules)")
        elif src_root == dst_root == "cli":
            if _is_command(e.source) and _is_command(e.target) and e.source != e.target:
                bad.append(f"{where} (a command module imports another command module)")
        elif src_root == dst_root == "pipelines":
            src, dst = _pipelines_package(e.source), _pipelines_package(e.target)
            if src is None or dst is None or src == dst:
                continue
            if src not in PIPELINES_RANK or dst not in PIPELINES_RANK:
                bad.append(f"{where} (pipelines/{src if src not in PIPELINES_RANK else dst} has no layer in PIPELINES_RANK)")
            elif PIPELINES_RANK[dst] >= PIPELINES_RANK[src]:
                bad.append(f"{where} (pipelines/{src} may not import pipelines/{dst}: same or higher layer)")
    return bad


def cycles(modules: set[str], edges: list[Edge]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), over internal edges."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for e in edges:
        if e.target in modules and e.target != e.source:
            graph[e.source].add(e.target)
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for m in sorted(modules):
        if m not in index:
            visit(m)
    return out


def _package_reexports(modules: set[str], edges: list[Edge]) -> list[Edge]:
    """Drop edges from a package's __init__ to its own submodules: re-exporting is not a dependency
    of the package's code on its users, and Python resolves it without a cycle."""
    return [e for e in edges if not (e.target.startswith(e.source + ".") and e.source in modules)]


def check(root: Path) -> list[str]:
    modules, edges = scan(root)
    problems = layer_violations(edges)
    problems += ["import cycle: " + " → ".join(c) for c in cycles(modules, _package_reexports(modules, edges))]
    return problems


def test_the_repository_keeps_its_layers():
    assert check(ROOT) == []


def test_every_pipelines_package_has_a_layer_and_says_what_it_may_import():
    for pkg in sorted(p for p in (ROOT / "pipelines").iterdir() if (p / "__init__.py").exists()):
        assert pkg.name in PIPELINES_RANK, pkg
        doc = ast.get_docstring(ast.parse((pkg / "__init__.py").read_text())) or ""
        assert "May import" in doc, pkg


# ---- the checker itself, on a synthetic tree ---------------------------------------------------------


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        f = tmp_path / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return tmp_path


CLEAN = {
    "drelay_model/__init__.py": "",
    "drelay_model/core.py": "import torch\n",
    "pipelines/__init__.py": "",
    "pipelines/common/__init__.py": "",
    "pipelines/common/paths.py": "from drelay_model import core\n",
    "pipelines/data/__init__.py": "",
    "pipelines/data/sets.py": "from pipelines.common.paths import X\n",
    "pipelines/eval/__init__.py": "",
    "pipelines/eval/run.py": "from pipelines.data import sets\nfrom . import report\n",
    "pipelines/eval/report.py": "",
    "pipelines/train/__init__.py": "",
    "pipelines/train/config.py": "",
    "cli/__init__.py": "from cli.main import main\n",
    "cli/main.py": "",
    "cli/options.py": "",
    "cli/serve.py": "from cli.options import x\n\ndef run():\n    import deploy.serve\n",
    "cli/eval.py": "from pipelines.eval.run import Y\nfrom cli import options\n",
    "deploy/__init__.py": "",
    "deploy/plugin.py": "",
    "deploy/serve.py": "from pipelines.common.paths import X\nfrom pipelines.train.config import C\nimport drelay_model.core\n",
}


def test_checker_passes_a_clean_tree(tmp_path):
    assert check(_tree(tmp_path, CLEAN)) == []


def test_checker_catches_each_kind_of_violation(tmp_path):
    cases = {
        "drelay_model/core.py": ("import mlflow\n", "drelay_model is pure PyTorch"),
        "pipelines/data/sets.py": ("from pipelines.eval import report\n", "pipelines/data may not import pipelines/eval"),
        "pipelines/eval/report.py": ("from pipelines.train import config\n", "pipelines/eval may not import pipelines/train"),
        "pipelines/common/paths.py": ("def f():\n    from deploy import plugin\n", "only cli may import deploy"),
        "deploy/serve.py": ("from pipelines.eval.run import Y\n", "deploy may import only pipelines.common"),
        "deploy/plugin.py": ("from cli.options import x\n", "only cli imports cli"),
        "pipelines/train/config.py": ("from cli import main\n", "only cli imports cli"),
        "cli/eval.py": ("from cli.serve import run\n", "a command module imports another command module"),
    }
    for rel, (text, expected) in cases.items():
        root = _tree(tmp_path / rel.replace("/", "_"), {**CLEAN, rel: text})
        problems = check(root)
        assert len(problems) == 1 and expected in problems[0], (rel, problems)


def test_checker_catches_an_import_cycle(tmp_path):
    root = _tree(tmp_path, {**CLEAN, "pipelines/eval/report.py": "from pipelines.eval.run import Z\n"})
    assert check(root) == ["import cycle: pipelines.eval.report → pipelines.eval.run"]
