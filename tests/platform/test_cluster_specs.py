"""platform/cluster/: every spec validates against pipelines/cluster/specs.py and every repo path
it names exists; broken specs fail in one line naming the file and the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from drelay_model.errors import DRelayError
from cli import main
from pipelines.cluster.specs import check_spec_file, referenced_paths

REPO = Path(__file__).resolve().parents[2]
SPECS = sorted((REPO / "platform" / "cluster").glob("*.yaml"))


def test_every_kind_of_spec_is_there():
    names = {p.name for p in SPECS}
    assert {"ray-cluster.yaml", "runtime_env.yaml", "rayjob-train.yaml", "rayjob-tune.yaml", "rayjob-eval.yaml",
            "rayservice-serve.yaml", "mlflow-server.yaml"} <= names  # fmt: skip
    assert not (REPO / "platform" / "__init__.py").exists()  # would shadow the standard library's `platform`


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.name)
def test_spec_validates_and_its_references_exist(path):
    assert check_spec_file(path)


def test_referenced_paths_are_found_in_nested_yaml():
    doc = yaml.safe_load((REPO / "platform/cluster/rayjob-train.yaml").read_text())
    assert "platform/experiments/qwen3-4b/train.yaml" in referenced_paths(doc)
    serve = yaml.safe_load((REPO / "platform/cluster/rayservice-serve.yaml").read_text())
    assert {"deploy/serve/app.py", "platform/serve/qwen3-4b.yaml"} <= referenced_paths(serve)


def _mutate(tmp_path, name, edit) -> Path:
    docs = list(yaml.safe_load_all((REPO / "platform/cluster" / name).read_text()))
    edit(docs[0])
    out = tmp_path / name
    out.write_text(yaml.safe_dump_all(docs))
    return out


def _env(doc, **changes):
    env = yaml.safe_load(doc["spec"]["runtimeEnvYAML"])
    env["env_vars"].update(changes)
    for k, v in list(env["env_vars"].items()):
        if v is None:
            del env["env_vars"][k]
    doc["spec"]["runtimeEnvYAML"] = yaml.safe_dump(env)


@pytest.mark.parametrize("name, edit, message", [
    ("rayjob-train.yaml", lambda d: d["spec"].update(entrypoint="python -m cli train --config platform/experiments/nope.yaml"),
     "references 'platform/experiments/nope.yaml', which does not exist"),
    ("rayjob-train.yaml", lambda d: d["spec"].pop("entrypoint"), "spec.entrypoint: Field required"),
    ("rayjob-train.yaml", lambda d: d["spec"].update(entrypoint="bash -c 'rm -rf /'"), "spec.entrypoint: must run a drelay command"),
    ("rayjob-eval.yaml", lambda d: d.update(apiVersion="ray.io/v1alpha1"), "apiVersion: Input should be 'ray.io/v1'"),
    ("rayjob-eval.yaml", lambda d: d["metadata"].pop("name"), "metadata.name: Field required"),
    ("rayjob-eval.yaml", lambda d: _env(d, DRELAY_OUTPUT_ROOT=None), "env_vars must set DRELAY_OUTPUT_ROOT"),
    ("rayjob-eval.yaml", lambda d: _env(d, DRELAY_OUTPUT_ROOT="outputs"), "DRELAY_OUTPUT_ROOT must be an absolute path or a URI"),
    ("rayjob-train.yaml", lambda d: d["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].update(minReplicas=5),
     "need minReplicas ≤ replicas ≤ maxReplicas"),
    ("rayjob-train.yaml", lambda d: d["spec"]["rayClusterSpec"].pop("headGroupSpec"), "rayClusterSpec.headGroupSpec: Field required"),
    ("mlflow-server.yaml", lambda d: d["spec"]["template"]["spec"]["containers"][0].update(
        args=["mlflow server --backend-store-uri sqlite:///db --artifacts-destination s3://b/a"]), "must be a postgresql:// URI"),
    ("ray-cluster.yaml", lambda d: d.update(head_node_type="nope"), "head_node_type 'nope' is not in available_node_types"),
    ("ray-cluster.yaml", lambda d: d["available_node_types"]["gpu_h100x8"]["resources"].pop("GPU"), "no node type has GPU resources"),
    ("runtime_env.yaml", lambda d: d["env_vars"].update(OMP_NUM_THREADS=8), "values must be strings"),
    ("runtime_env.yaml", lambda d: d.update(pip_extra=["x"]), "pip_extra: Extra inputs are not permitted"),
])  # fmt: skip
def test_broken_specs_fail_in_one_line(tmp_path, name, edit, message):
    with pytest.raises(DRelayError) as err:
        check_spec_file(_mutate(tmp_path, name, edit))
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_cli_check_exits_2_on_a_missing_config(tmp_path, capsys):
    bad = _mutate(
        tmp_path,
        "rayjob-train.yaml",
        lambda d: d["spec"].update(entrypoint="python -m cli train --config platform/x.yaml"),
    )
    assert main(["jobs", "check", str(REPO / "platform/cluster/rayjob-eval.yaml")]) == 0
    rc = main(["jobs", "check", str(bad)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and "platform/x.yaml" in err, err
