"""platform/cluster/'s KubeRay manifests against KubeRay's own CRD schemas (pipelines/cluster/crds.py):
every manifest conforms; unknown fields (what the API server would silently prune), wrong types,
missing required fields and values outside an enum are one-line errors naming the field, through
`check_spec_file` and `drelay jobs check` alike."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import yaml

from drelay_model.errors import DRelayError
from cli import main
from pipelines.cluster.crds import (
    CRD_DIR,
    KUBERAY_RELEASE,
    SCHEMA_FILES,
    KubernetesValidator,
    applies_to,
    check_manifest,
    crd_problems,
    store_schema,
    structural,
)
from pipelines.cluster.specs import check_spec_file

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = [
    (path, i, doc)
    for path in sorted((REPO / "platform" / "cluster").glob("*.yaml"))
    for i, doc in enumerate(d for d in yaml.safe_load_all(path.read_text()) if d)
    if applies_to(doc)
]


def test_the_manifests_are_kuberay_v1_and_the_schemas_are_stored_with_their_source():
    assert {doc["kind"] for _, _, doc in MANIFESTS} == {"RayJob", "RayService"} and len(MANIFESTS) >= 4
    readme = (CRD_DIR / "README.md").read_text()
    assert KUBERAY_RELEASE in readme and "59d663aeec13760646da3db9c1cf8cfe883e30b7" in readme
    assert "Apache License" in (CRD_DIR / "LICENSE").read_text()
    for kind, name in SCHEMA_FILES.items():
        assert name in readme
        schema = json.loads(gzip.decompress((CRD_DIR / name).read_bytes()))
        assert {"apiVersion", "kind", "metadata", "spec", "status"} <= set(schema["properties"]), kind


@pytest.mark.parametrize("path, index, doc", MANIFESTS, ids=[f"{p.name}:{i}" for p, i, _ in MANIFESTS])
def test_every_kuberay_manifest_conforms_to_its_crd(path, index, doc):
    assert crd_problems(doc) == []


def _doc(name: str) -> dict:
    return yaml.safe_load((REPO / "platform/cluster" / name).read_text())


def _rename(node: dict, old: str, new: str) -> None:
    node[new] = node.pop(old)


def _cluster(doc: dict) -> dict:
    return doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]["rayClusterConfig"]


def _head_container(doc: dict) -> dict:
    return _cluster(doc)["headGroupSpec"]["template"]["spec"]["containers"][0]


BROKEN = [
    ("rayjob-train.yaml", lambda d: _rename(_cluster(d)["workerGroupSpecs"][0], "rayStartParams", "rayStartParms"),
     "spec.rayClusterSpec.workerGroupSpecs.0.rayStartParms: unknown field (not in KubeRay v1.7.0's RayJob CRD",
     "did you mean 'rayStartParams'?"),
    ("rayjob-tune.yaml", lambda d: _rename(_cluster(d), "workerGroupSpecs", "workerGroupSpec"),
     "spec.rayClusterSpec.workerGroupSpec: unknown field", "did you mean 'workerGroupSpecs'?"),
    ("rayservice-serve.yaml", lambda d: _rename(d["spec"], "serveConfigV2", "serveConfigv2"),
     "spec.serveConfigv2: unknown field (not in KubeRay v1.7.0's RayService CRD", "did you mean 'serveConfigV2'?"),
    ("rayjob-eval.yaml", lambda d: _head_container(d).update(volumeMount=[]),
     "spec.rayClusterSpec.headGroupSpec.template.spec.containers.0.volumeMount: unknown field", "'volumeMounts'"),
    ("rayjob-train.yaml", lambda d: _cluster(d)["workerGroupSpecs"][0].update(replicas="1"),
     "spec.rayClusterSpec.workerGroupSpecs.0.replicas: must be of type integer, got string '1'", ""),
    ("rayjob-train.yaml", lambda d: _cluster(d)["headGroupSpec"]["rayStartParams"].update({"num-cpus": 0}),
     "spec.rayClusterSpec.headGroupSpec.rayStartParams.num-cpus: must be of type string, got integer 0", ""),
    ("rayjob-train.yaml", lambda d: _head_container(d)["resources"]["limits"].update(cpu=[8]),
     "containers.0.resources.limits.cpu: must be an integer or a string, got array [8]", ""),
    ("rayjob-train.yaml", lambda d: _head_container(d).pop("name"),
     "spec.rayClusterSpec.headGroupSpec.template.spec.containers.0.name: Field required", ""),
    ("rayservice-serve.yaml", lambda d: _cluster(d).update(autoscalerOptions={"upscalingMode": "Eager"}),
     "spec.rayClusterConfig.autoscalerOptions.upscalingMode: must be one of 'Default', 'Aggressive', 'Conservative', got 'Eager'", ""),
    ("rayjob-eval.yaml", lambda d: _cluster(d)["headGroupSpec"]["template"]["spec"]["containers"].append(dict(_head_container(d))),
     "template.spec.containers.1: duplicate entry (name='ray-head') at index 1, first at 0", ""),
]  # fmt: skip


@pytest.mark.parametrize("name, edit, message, hint", BROKEN, ids=[b[2].split(":")[0].split(".")[-1] for b in BROKEN])
def test_a_broken_manifest_fails_in_one_line_naming_the_field(tmp_path, name, edit, message, hint):
    doc = _doc(name)
    edit(doc)
    line = check_manifest(doc)
    assert line is not None and line.partition(":")[0].endswith(message.partition(":")[0]), line  # the first problem
    assert message in line and hint in line, line
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(DRelayError) as err:
        check_spec_file(path, check_refs=False)
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value) and "\n" not in str(err.value)


def test_drelay_jobs_check_reports_a_misspelt_field_and_exits_2(tmp_path, capsys):
    doc = _doc("rayjob-train.yaml")
    _rename(_cluster(doc)["workerGroupSpecs"][0], "rayStartParams", "rayStartParms")
    bad = tmp_path / "rayjob-train.yaml"
    bad.write_text(yaml.safe_dump(doc))
    assert main(["jobs", "check", str(REPO / "platform/cluster/rayjob-eval.yaml")]) == 0
    assert "KubeRay v1.7.0 CRD schema" in capsys.readouterr().out
    assert main(["jobs", "check", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "workerGroupSpecs.0.rayStartParms: unknown field" in err, err


def test_several_problems_report_the_first_and_count_the_rest():
    doc = _doc("rayjob-train.yaml")
    _cluster(doc)["workerGroupSpecs"][0].update(replicas="1", maxReplicas="1", rayStartParms={}, grupName="g")
    assert check_manifest(doc).endswith("(+3 more)")
    assert [p.split(":")[0].rpartition(".")[2] for p in crd_problems(doc)] == [
        "grupName",
        "rayStartParms",
        "maxReplicas",
        "replicas",
    ]


def test_other_kinds_and_api_versions_are_left_to_the_project_schema():
    assert check_manifest({"apiVersion": "apps/v1", "kind": "Deployment", "spec": {"bogus": 1}}) is None
    assert check_manifest({"apiVersion": "ray.io/v1alpha1", "kind": "RayJob", "spec": {"bogus": 1}}) is None


# ---- the structural-schema rules on schemas that use them (the stored KubeRay ones do not all) ------

SCHEMA = {
    "type": "object",
    "properties": {
        "metadata": {"type": "object"},
        "strict": {"type": "object", "properties": {"a": {"type": "integer"}}},
        "open": {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "properties": {"a": {"type": "integer"}}},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "empty": {"type": "object"},
        "maybe": {"type": "string", "nullable": True, "enum": ["x"]},
        "never": {"type": "string"},
        "embedded": {"type": "object", "x-kubernetes-embedded-resource": True, "properties": {"spec": {"type": "object"}}},
        "ports": {"type": "array", "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["port", "protocol"],
                  "items": {"type": "object", "properties": {"port": {"type": "integer"}, "protocol": {"type": "string"}}}},
        "tags": {"type": "array", "x-kubernetes-list-type": "set", "items": {"type": "string"}},
    },
}  # fmt: skip


def _errors(instance: dict) -> list[str]:
    validator = KubernetesValidator(structural(SCHEMA))
    return sorted(f"{'.'.join(map(str, e.absolute_path))}: {e.validator}" for e in validator.iter_errors(instance))


@pytest.mark.parametrize("instance, expected", [
    ({"metadata": {"name": "n", "anything": 1}, "open": {"a": 1, "b": 2}, "labels": {"k": "v"}, "maybe": None,
      "embedded": {"apiVersion": "v1", "kind": "Pod", "metadata": {"x": 1}, "spec": {}}}, []),
    ({"strict": {"a": 1, "b": 2}}, ["strict: additionalProperties"]),
    ({"empty": {"b": 1}}, ["empty: additionalProperties"]),  # no properties, not preserved: all pruned
    ({"embedded": {"spec": {}, "status": {}}}, ["embedded: additionalProperties"]),
    ({"never": None, "maybe": "y"}, ["maybe: enum", "never: type"]),
    ({"labels": {"k": 1}}, ["labels.k: type"]),
    ({"ports": [{"port": 80, "protocol": "TCP"}, {"port": 80, "protocol": "UDP"}], "tags": ["a", "b"]}, []),
    ({"ports": [{"port": 80, "protocol": "TCP"}, {"port": 80, "protocol": "TCP"}], "tags": ["a", "a"]},
     ["ports.1: x-kubernetes-list-type", "tags.1: x-kubernetes-list-type"]),
])  # fmt: skip
def test_structural_rules(instance, expected):
    assert _errors(instance) == expected


def test_storing_a_schema_is_reproducible(tmp_path):
    crd = {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition", "metadata": {"name": "rayjobs.ray.io"},
           "spec": {"names": {"kind": "RayJob"}, "versions": [{"name": "v1alpha1", "schema": {"openAPIV3Schema": {"type": "string"}}},
                                                             {"name": "v1", "schema": {"openAPIV3Schema": {"type": "object", "b": 1}}}]}}  # fmt: skip
    source = tmp_path / "ray.io_rayjobs.yaml"
    source.write_text("---\n" + yaml.safe_dump(crd))
    first = store_schema(source, tmp_path).read_bytes()
    assert store_schema(source, tmp_path).read_bytes() == first
    assert json.loads(gzip.decompress(first)) == {"b": 1, "type": "object"}
