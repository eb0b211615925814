"""What a folder of lm-eval task YAML files (`evaluate --include_path`, `eval.tasks_include_path`) would make this
process do, read before lm-eval sees it.

A task YAML may name Python with the `!function module.name` tag: lm-eval imports `module.py` from beside the
file and runs it (to build prompts, filter answers, score). That is code the folder brings, so it runs only when
asked for by name (`evaluate --allow_code_in_tasks`, or the recipe's own switch beside its folder). A data file given as a URL would be
downloaded: nothing is downloaded here, so such a task is refused before lm-eval could fetch it. Files a YAML
includes (`include: other.yaml`) are read the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ...errors import RecipeError

CODE_TAG = "!function"
URL_PREFIXES = ("http://", "https://", "ftp://", "s3://", "gs://", "hf://")
DATA_KEYS = ("dataset_path", "dataset_kwargs", "data_files", "data_dir")  # where lm-eval finds a task's data


def check_task_folder(folder: str, allow_code: bool, where: str, code_option: str) -> None:
    """Refuse a task folder whose YAML runs Python (unless `allow_code`) or downloads a data file; one line naming
    the file, what it does and `code_option`, the option that allows code."""
    import yaml

    root = Path(folder)
    if not root.is_dir():
        raise RecipeError(f"{where}={folder} is not a folder (of lm-eval task YAML files)")
    seen: set[Path] = set()
    pending = sorted(path for suffix in ("*.yaml", "*.yml") for path in root.rglob(suffix))
    while pending:
        path = pending.pop().resolve()
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        try:
            document = yaml.compose(path.read_text(encoding="utf-8"), Loader=yaml.SafeLoader)
        except (yaml.YAMLError, UnicodeDecodeError, OSError) as error:
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise RecipeError(f"{where}: {path} is not readable YAML ({reason})") from None
        for key, node in _nodes(document, ""):
            if node.tag == CODE_TAG and not allow_code:
                raise RecipeError(
                    f"{where}: {path} runs Python from the folder ({key}: {CODE_TAG} {node.value}); task folders"
                    f" may hold code only when allowed by name: {code_option} (run only folders you trust)"
                )
            value = node.value if isinstance(node, yaml.ScalarNode) else ""
            if key.split(".")[0] in DATA_KEYS and isinstance(value, str) and value.lower().startswith(URL_PREFIXES):
                raise RecipeError(
                    f"{where}: {path} reads its data from {value[:100]!r}, which would be downloaded; nothing is"
                    " downloaded here: put the file in the folder and name it by its path"
                )
            if key == "include" and isinstance(value, str):
                pending.append(path.parent / value)


def _nodes(node: Any, key: str) -> Iterator[tuple[str, Any]]:
    """Every node of a composed YAML document with its dotted key (the top-level key first)."""
    import yaml

    if node is None:
        return
    yield key, node
    if isinstance(node, yaml.MappingNode):
        for name, child in node.value:
            label = str(name.value) if isinstance(name, yaml.ScalarNode) else "?"
            yield from _nodes(child, f"{key}.{label}" if key else label)
    elif isinstance(node, yaml.SequenceNode):
        for child in node.value:
            yield from _nodes(child, key)
