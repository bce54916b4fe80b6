"""KubeRay manifests checked against KubeRay's own CRD schemas, as the Kubernetes API server would.

`crds/` holds the `openAPIV3Schema` of the `v1` version of KubeRay's RayCluster, RayJob and RayService
CRDs, exactly as a KubeRay release ships them (provenance and license: `crds/README.md`). A manifest is
validated with `jsonschema` (the schemas are OpenAPI 3.0, a JSON Schema draft-4 dialect) after the
Kubernetes structural-schema rules are made explicit:

- pruning as an error: an object with `properties` takes no other keys unless it says
  `x-kubernetes-preserve-unknown-fields: true` or gives `additionalProperties` (the API server would
  silently drop the key; here a misspelt `rayStartParms` is reported, with the field it resembles);
- `nullable: true` admits null, anything else does not (the server would drop the null);
- `x-kubernetes-list-type: map` lists are unique by their `x-kubernetes-list-map-keys`, `set` lists
  unique.

Types, `required`, `enum`, patterns and bounds are jsonschema's own. The top-level `metadata` is
Kubernetes' ObjectMeta, which the CRD leaves open (`pipelines/cluster/specs.py` checks its name). Not
checked: the CEL `x-kubernetes-validations` rules (immutability and two value rules on fields the
project's manifests do not set) and `format`.

    python -m pipelines.cluster.crds KUBERAY/ray-operator/config/crd/bases/ray.io_{rayclusters,rayjobs,rayservices}.yaml
        # store (or refresh) the schemas from a KubeRay checkout; then update crds/README.md
"""

from __future__ import annotations

import difflib
import functools
import gzip
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import yaml
from jsonschema import Draft4Validator, ValidationError, validators

CRD_DIR = Path(__file__).with_name("crds")
KUBERAY_RELEASE = "v1.7.0"  # the release the stored schemas come from (crds/README.md)
API_VERSION = "ray.io/v1"
SCHEMA_FILES = {
    "RayCluster": "ray.io_rayclusters.v1.schema.json.gz",
    "RayJob": "ray.io_rayjobs.v1.schema.json.gz",
    "RayService": "ray.io_rayservices.v1.schema.json.gz",
}


def applies_to(doc: dict) -> bool:
    """True for a manifest of a KubeRay kind at the stored API version."""
    return doc.get("apiVersion") == API_VERSION and doc.get("kind") in SCHEMA_FILES


# ---- the Kubernetes structural-schema rules, made explicit for jsonschema ---------------------------


EMBEDDED_RESOURCE = {"apiVersion": {"type": "string"}, "kind": {"type": "string"}, "metadata": {"type": "object"}}


def structural(node: dict, *, root: bool = True) -> dict:
    """A copy of an openAPIV3Schema in which pruning is `additionalProperties: false` and `nullable`
    is a type, so that jsonschema enforces what the API server would enforce or drop."""
    out = dict(node)
    if "properties" in out:
        out["properties"] = {
            k: v if root and k == "metadata" else structural(v, root=False) for k, v in out["properties"].items()
        }
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = structural(out["additionalProperties"], root=False)
    if isinstance(out.get("items"), dict):
        out["items"] = structural(out["items"], root=False)
    for key in ("anyOf", "oneOf", "allOf"):
        if key in out:
            out[key] = [structural(s, root=False) for s in out[key]]
    if out.get("x-kubernetes-embedded-resource"):  # a whole object: apiVersion, kind, metadata implied
        out["properties"] = {**EMBEDDED_RESOURCE, **out.get("properties", {})}
    if out.get("type") == "object" and "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    if out.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if out.get("nullable") and "enum" in out:
        out["enum"] = [*out["enum"], None]
    return out


def _list_type(validator, list_type, instance, schema) -> Iterator[ValidationError]:
    """`x-kubernetes-list-type`: `map` items are unique by their map keys, `set` items unique."""
    if not validator.is_type(instance, "array") or list_type not in ("map", "set"):
        return
    keys = schema.get("x-kubernetes-list-map-keys", [])
    seen: dict[str, int] = {}
    for i, item in enumerate(instance):
        key = json.dumps([item.get(k) for k in keys] if list_type == "map" and isinstance(item, dict) else item, sort_keys=True)
        if key in seen:
            what = ", ".join(f"{k}={item.get(k)!r}" for k in keys) if list_type == "map" else repr(item)
            yield ValidationError(f"duplicate entry ({what}) at index {i}, first at {seen[key]}", path=[i])
        seen.setdefault(key, i)


KubernetesValidator = validators.extend(Draft4Validator, {"x-kubernetes-list-type": _list_type})


@functools.cache
def validator_for(kind: str) -> Draft4Validator:
    """The validator of one KubeRay kind (its stored schema, made structural)."""
    with gzip.open(CRD_DIR / SCHEMA_FILES[kind], "rt", encoding="utf-8") as f:
        return KubernetesValidator(structural(json.load(f)))


# ---- one line per problem ---------------------------------------------------------------------------

_JSON_TYPES = {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer", float: "number", type(None): "null"}


def _where(path) -> str:
    return ".".join(str(p) for p in path)


def _describe(err: ValidationError, kind: str) -> list[str]:
    """`field.path: message` lines for one jsonschema error (one per unknown or missing field)."""
    path, schema, instance = list(err.absolute_path), err.schema, err.instance
    if err.validator == "additionalProperties" and err.validator_value is False:
        known = list(schema.get("properties", {}))
        lines = []
        for extra in sorted(set(instance) - set(known)):
            close = difflib.get_close_matches(extra, known, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            why = f"not in KubeRay {KUBERAY_RELEASE}'s {kind} CRD: Kubernetes would silently drop it"
            lines.append(f"{_where([*path, extra])}: unknown field ({why}){hint}")
        return lines
    if err.validator == "required":
        missing = [r for r in err.validator_value if r not in instance]
        return [f"{_where([*path, r])}: Field required (KubeRay {KUBERAY_RELEASE}'s {kind} CRD)" for r in missing]
    got = _JSON_TYPES.get(type(instance), type(instance).__name__)
    if err.validator == "type":
        wanted = " or ".join(err.validator_value) if isinstance(err.validator_value, list) else err.validator_value
        message = f"must be of type {wanted}, got {got} {instance!r:.60}"
    elif err.validator == "anyOf" and schema.get("x-kubernetes-int-or-string"):
        message = f"must be an integer or a string, got {got} {instance!r:.60}"
    elif err.validator == "enum":
        message = f"must be one of {', '.join(map(repr, err.validator_value))}, got {instance!r:.60}"
    else:
        message = err.message.splitlines()[0][:200]
    return [f"{_where(path)}: {message}"]


def crd_problems(doc: dict) -> list[str]:
    """Every way `doc` (a RayCluster/RayJob/RayService at ray.io/v1) breaks its KubeRay CRD schema, as
    `field.path: message` lines in document-path order; [] when it conforms."""
    kind = doc["kind"]
    errors = sorted(validator_for(kind).iter_errors(doc), key=lambda e: [str(p) for p in e.absolute_path])
    return list(dict.fromkeys(line for e in errors for line in _describe(e, kind)))


def check_manifest(doc: dict) -> str | None:
    """The first problem of a KubeRay manifest as one line (with how many more there are); None when
    it conforms or is not a KubeRay kind at the stored API version."""
    if not applies_to(doc):
        return None
    problems = crd_problems(doc)
    if not problems:
        return None
    more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
    return problems[0] + more


# ---- storing the schemas from a KubeRay checkout ----------------------------------------------------


def extract_schema(crd: dict, version: str = "v1") -> dict:
    """The `openAPIV3Schema` of one version of a CustomResourceDefinition document."""
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            return v["schema"]["openAPIV3Schema"]
    raise ValueError(f"{crd['metadata']['name']}: no version {version}")


def store_schema(crd_yaml: Path, out_dir: Path = CRD_DIR) -> Path:
    """Write the v1 schema of a KubeRay CRD file as compact, sorted, reproducible gzipped JSON."""
    crd = next(d for d in yaml.safe_load_all(crd_yaml.read_text()) if d)
    kind = crd["spec"]["names"]["kind"]
    data = json.dumps(extract_schema(crd), sort_keys=True, separators=(",", ":")).encode()
    out = out_dir / SCHEMA_FILES[kind]
    out.write_bytes(gzip.compress(data, compresslevel=9, mtime=0))
    return out


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(store_schema(Path(arg)))
