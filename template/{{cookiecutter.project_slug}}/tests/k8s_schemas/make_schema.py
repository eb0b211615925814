"""Write podtemplatespec-v1.37.0.json from the schemas that kubernetes-validate 1.37.0 ships (see SOURCE.md).

    pip download --no-deps kubernetes-validate==1.37.0 && unzip kubernetes_validate-1.37.0-py3-none-any.whl
    python make_schema.py kubernetes_validate/kubernetes-json-schema/v1.37.0-local-strict

Keeps the PodTemplateSpec schema and every definition it reaches, unchanged except: descriptions dropped,
references pointed into the one file, written compact (one line).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

PREFIXES = ("/api/_definitions.json#/$defs/", "#/$defs/")
OUT = Path(__file__).with_name("podtemplatespec-v1.37.0.json")


def main(folder: Path) -> None:
    definitions = json.loads((folder / "_definitions.json").read_text())["$defs"]
    schema = json.loads((folder / "podtemplatespec-v1.json").read_text())
    kept: dict[str, Any] = {}
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

    localize(schema)
    while pending:
        name = pending.pop()
        kept[name] = definitions[name]
        localize(kept[name])
    schema["$defs"] = dict(sorted(kept.items()))
    text = json.dumps(schema, sort_keys=True, separators=(",", ":"))
    OUT.write_text(text + "\n")
    print(f"{OUT.name}: {len(kept)} definitions, {OUT.stat().st_size} bytes")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
