"""Write the JSON Schemas of tests/k8s_schemas from the packages that publish them (see SOURCE.md).

    pip download --no-deps kubernetes-validate==1.37.0 kubeflow-training==1.9.4
    unzip kubernetes_validate-1.37.0-py3-none-any.whl && unzip kubeflow_training-1.9.4-py3-none-any.whl
    python make_schema.py kubernetes_validate/kubernetes-json-schema/v1.37.0-local-strict kubeflow/training/models

podtemplatespec-v1.37.0.json: kubernetes-validate's PodTemplateSpec schema and every definition it reaches,
unchanged except: descriptions dropped, references pointed into the one file, written compact (one line).

pytorchjob-kubeflow-training-1.9.4.json: the PyTorchJob of Kubeflow's training SDK, read (not imported) from
the models its OpenAPI document generated: each model's properties (`attribute_map`, `openapi_types`) and
required fields (the setters that refuse None) become a strict JSON Schema object (unknown fields refused,
null allowed where an optional field holds a plain value, as in Kubernetes' own strict schemas); the Kubernetes types the models
name (pod template, object metadata, ...) are kubernetes-validate's definitions, as above.
"""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path
from typing import Any

PREFIXES = ("/api/_definitions.json#/$defs/", "#/$defs/")
HERE = Path(__file__).parent
POD_TEMPLATE = HERE / "podtemplatespec-v1.37.0.json"
PYTORCHJOB = HERE / "pytorchjob-kubeflow-training-1.9.4.json"
# The Kubernetes types the training SDK's models name, as kubernetes-validate names their definitions.
KUBERNETES_TYPES = {
    "V1ObjectMeta": "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta",
    "V1PodTemplateSpec": "io.k8s.api.core.v1.PodTemplateSpec",
    "V1LabelSelector": "io.k8s.apimachinery.pkg.apis.meta.v1.LabelSelector",
    "Quantity": "io.k8s.apimachinery.pkg.api.resource.Quantity",
    "K8sIoApiAutoscalingV2MetricSpec": "io.k8s.api.autoscaling.v2.MetricSpec",
}
PRIMITIVES = {
    "str": {"type": "string"},
    "int": {"type": "integer"},
    "bool": {"type": "boolean"},
    "float": {"type": "number"},
    "object": {},
    "datetime": {"type": "string", "format": "date-time"},
}
NOT_NONE = re.compile(r"Invalid value for `(\w+)`, must not be `None`")


def with_definitions(root: dict[str, Any], definitions: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """`root` with `own` definitions and every Kubernetes definition reachable from either under $defs."""
    kept: dict[str, Any] = dict(own)
    pending: list[str] = []

    def localize(node: Any) -> None:
        if isinstance(node, dict):
            node.pop("description", None)
            ref = node.get("$ref", "")
            prefix = next((prefix for prefix in PREFIXES if ref.startswith(prefix)), None)
            if prefix:
                name = ref[len(prefix) :]
                node["$ref"] = "#/$defs/" + name
                if name not in kept:
                    kept[name] = None
                    pending.append(name)
            for value in node.values():
                localize(value)
        elif isinstance(node, list):
            for value in node:
                localize(value)

    localize(root)
    for value in own.values():
        localize(value)
    while pending:
        name = pending.pop()
        kept[name] = definitions[name]
        localize(kept[name])
    return {**root, "$defs": dict(sorted(kept.items()))}


def write(path: Path, schema: dict[str, Any]) -> None:
    path.write_text(json.dumps(schema, sort_keys=True, separators=(",", ":")) + "\n")
    print(f"{path.name}: {len(schema['$defs'])} definitions, {path.stat().st_size} bytes")


def model(path: Path) -> tuple[str, dict[str, str], dict[str, str], set[str]]:
    """(class name, json key -> attribute, attribute -> type, required attributes) of one generated model file."""
    source = path.read_text()
    cls = next(node for node in ast.parse(source).body if isinstance(node, ast.ClassDef))
    tables = {
        node.targets[0].id: ast.literal_eval(node.value)
        for node in cls.body
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
    }
    keys = {key: attribute for attribute, key in tables["attribute_map"].items()}
    return cls.name, keys, tables["openapi_types"], set(NOT_NONE.findall(source))


def type_schema(name: str) -> dict[str, Any]:
    if name in PRIMITIVES:
        return dict(PRIMITIVES[name])
    if name.startswith("list[") and name.endswith("]"):
        return {"type": "array", "items": type_schema(name[5:-1])}
    if name.startswith("dict(str, ") and name.endswith(")"):
        return {"type": "object", "additionalProperties": type_schema(name[10:-1])}
    if name in KUBERNETES_TYPES:
        return {"$ref": "#/$defs/" + KUBERNETES_TYPES[name]}
    if name.startswith("KubeflowOrgV1"):
        return {"$ref": "#/$defs/" + name}
    raise SystemExit(f"make_schema.py: no JSON Schema for the type {name!r}; add it to KUBERNETES_TYPES")


def nullable(schema: dict[str, Any]) -> dict[str, Any]:
    """An optional field's schema: null allowed for a plain value (an object stays as its definition says)."""
    return {**schema, "type": [schema["type"], "null"]} if "type" in schema else schema


def pytorchjob(models: Path, definitions: dict[str, Any]) -> dict[str, Any]:
    found = {
        name: (keys, types, required) for name, keys, types, required in map(model, models.glob("kubeflow_org_v1_*.py"))
    }
    own: dict[str, Any] = {}
    pending = ["KubeflowOrgV1PyTorchJob"]
    while pending:
        name = pending.pop()
        keys, types, required = found[name]
        properties = {}
        for key, attribute in sorted(keys.items()):
            schema = type_schema(types[attribute])
            properties[key] = schema if attribute in required else nullable(schema)
            pending += [n for n in re.findall(r"KubeflowOrgV1\w+", types[attribute]) if n not in own and n != name]
        own[name] = {
            "type": "object",
            "properties": properties,
            "required": sorted(key for key, attribute in keys.items() if attribute in required),
            "additionalProperties": False,
        }
    return with_definitions({"$ref": "#/$defs/KubeflowOrgV1PyTorchJob"}, definitions, own)


def main(kubernetes: Path, kubeflow_models: Path) -> None:
    definitions = json.loads((kubernetes / "_definitions.json").read_text())["$defs"]
    write(
        POD_TEMPLATE,
        with_definitions(json.loads((kubernetes / "podtemplatespec-v1.json").read_text()), definitions, {}),
    )
    write(PYTORCHJOB, pytorchjob(kubeflow_models, definitions))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
