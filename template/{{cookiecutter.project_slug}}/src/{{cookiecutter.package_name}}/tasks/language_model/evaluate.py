"""Downstream evaluation through lm-evaluation-harness (`pip install .[eval]`): `evaluate CHECKPOINT --tasks ...`
and, during training, `eval.tasks` every `eval.tasks_every_steps`.

The project's own model answers lm-eval's three requests (`ProjectLM`): the log-likelihood of a continuation,
the rolling log-likelihood of a text, and greedy generation until a stop string. It tokenizes as `sample`
does (the prepared folder's tokenizer, or UTF-8 bytes) and scores as lm-eval's Hugging Face backend does
(the same context/continuation split and left truncation), so a checkpoint and its `export --format hf`
get the same scores. Tasks come from lm-eval's own library or from local YAML files (`include_path`);
nothing is downloaded: a task whose data set is not in the local Hugging Face cache is refused in one line.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ...errors import RecipeError
from ...progress import counted
from ...recipe.schema import Recipe, field_path

RESULTS_SUFFIX = ".eval.json"  # step-00000100.eval.json beside checkpoints/step-00000100


def import_lm_eval() -> Any:
    """lm_eval, or a one-line refusal saying how to install it."""
    try:
        import lm_eval
        import lm_eval.evaluator
        import lm_eval.tasks
    except ImportError:
        raise RecipeError("evaluation needs lm-evaluation-harness: pip install .[eval]") from None
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    return lm_eval


# The switches that keep each library off the Hugging Face Hub: environment variables, read when the library is
# imported, and the module attributes they were read into (set too where the library is imported already).
OFFLINE_SWITCHES = {
    "HF_HUB_OFFLINE": [("huggingface_hub.constants", "HF_HUB_OFFLINE"), ("datasets.config", "HF_HUB_OFFLINE")],
    "HF_DATASETS_OFFLINE": [("datasets.config", "HF_DATASETS_OFFLINE")],
    "HF_EVALUATE_OFFLINE": [("evaluate.config", "HF_EVALUATE_OFFLINE")],  # metrics lm-eval loads through evaluate
}


@contextmanager
def offline() -> Iterator[None]:
    """The Hugging Face Hub out of reach within: data sets and metrics come from the local cache or not at all
    (nothing is downloaded at run time); every switch is as it was afterwards."""
    saved_environment = {name: os.environ.get(name) for name in OFFLINE_SWITCHES}
    switches = [switch for switches in OFFLINE_SWITCHES.values() for switch in switches]
    modules = [(sys.modules[module], name) for module, name in switches if module in sys.modules]
    saved_attributes = [getattr(module, name) for module, name in modules]
    os.environ.update(dict.fromkeys(OFFLINE_SWITCHES, "1"))
    for module, name in modules:
        setattr(module, name, True)
    try:
        yield
    finally:
        for (module, name), value in zip(modules, saved_attributes, strict=True):
            setattr(module, name, value)
        for name, value in saved_environment.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def load_tasks(names: list[str], include_path: str | None, where: str = "--tasks") -> dict[str, Any]:
    """lm-eval's loaded tasks (TaskManager.load) of these names; a name that is unknown or whose data must be
    downloaded is refused in one line."""
    lm_eval = import_lm_eval()
    if not names:
        raise RecipeError(f"{where} is empty: name at least one lm-eval task")
    if include_path is not None and not Path(include_path).is_dir():
        raise RecipeError(f"include_path {include_path!r} is not a folder (of lm-eval task YAML files)")
    # Indexing lm-eval's own library of tasks takes seconds: only when a name is not among the local ones.
    manager = lm_eval.tasks.TaskManager(include_path=include_path, include_defaults=False) if include_path else None
    if manager is None or any(name not in manager.all_tasks for name in names):
        manager = lm_eval.tasks.TaskManager(include_path=include_path)
    if unknown := [name for name in names if name not in manager.all_tasks]:
        raise RecipeError(
            f"{where}: {unknown[0]!r} is not an lm-eval task"
            + (f" nor in {include_path}" if include_path else " (local YAML tasks: include_path)")
        )
    try:
        with offline():
            return manager.load(names)
    except ConnectionError as error:  # datasets' "Couldn't reach 'X' on the Hub (OfflineModeIsEnabled)"
        raise RecipeError(
            f"{where}: {', '.join(names)} needs a data set that is not in the local Hugging Face cache ({error});"
            " nothing is downloaded here: fetch it once with datasets.load_dataset on a machine online, or"
            " define the task in a local YAML file with local data files (include_path)"
        ) from None


def project_lm(
    model: Callable[[torch.Tensor], torch.Tensor],
    recipe: Recipe,
    device: torch.device,
    batch_size: int,
    show_progress: bool = True,
) -> Any:
    """lm-eval's model interface over `model` (token ids [batch, time] -> logits), tokenizing as the run did."""
    from lm_eval.api.model import TemplateLM
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    from .sample import text_codec

    encode, decode, eos_id = text_codec(recipe)
    block_size = recipe.model.block_size

    class ProjectLM(TemplateLM):
        @property
        def eot_token_id(self) -> int:
            return eos_id if eos_id is not None else encode("\n")[0]  # byte-level data: a newline ends documents

        @property
        def max_length(self) -> int:
            return block_size

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
            return encode(string)

        def tok_decode(self, tokens: list[int], **kwargs: Any) -> str:
            return decode(tokens)

        def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[Any]:
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not show_progress)

        def _loglikelihood_tokens(self, requests: list[Any], disable_tqdm: bool = False, **kwargs: Any) -> list[Any]:
            """(sum of the continuation's log-probabilities, whether it is the greedy continuation) of each request."""
            # As lm-eval's Hugging Face backend: the last max_length tokens of context + continuation feed the model.
            windows = [
                ((context + continuation)[-(block_size + 1) :][:-1], continuation)
                for _, context, continuation in requests
            ]
            order = sorted(range(len(windows)), key=lambda index: -len(windows[index][0]))  # similar lengths batched
            results: list[Any] = [None] * len(windows)
            batches = [order[start : start + batch_size] for start in range(0, len(order), batch_size)]
            for batch in self._progress(batches, "Scoring continuations", "batches", disable_tqdm):
                inputs = [windows[index][0] for index in batch]
                log_probs = self._log_probs(inputs)
                for row, index in enumerate(batch):
                    continuation = windows[index][1]
                    end = len(inputs[row])
                    picked = log_probs[row, end - len(continuation) : end]
                    target = torch.tensor(continuation, device=picked.device)
                    greedy = bool((picked.argmax(dim=-1) == target).all())
                    results[index] = (float(picked.gather(-1, target[:, None]).sum()), greedy)
                    self.cache_hook.add_partial("loglikelihood", requests[index][0], results[index])
            return results

        def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
            """The log-likelihood of each whole text, over disjoint windows of at most max_length tokens."""
            scores = []
            texts = [text for (text,) in [request.args for request in requests]]
            for text in self._progress(texts, "Scoring texts", "texts", disable_tqdm):
                windows = map(
                    make_disjoint_window,
                    get_rolling_token_windows(encode(text), self.prefix_token_id, block_size, context_len=1),
                )
                parts = self._loglikelihood_tokens([((text, ""), *window) for window in windows], disable_tqdm=True)
                scores.append(sum(score for score, _ in parts))
            return scores

        def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
            """Greedy continuations, cut at the first stop string (no KV cache: every rank runs the same forwards)."""
            outputs = []
            arguments = [request.args for request in requests]
            for context, settings in self._progress(arguments, "Generating", "texts", disable_tqdm):
                stops = settings.get("until") or [decode([self.eot_token_id])]
                stops = [stops] if isinstance(stops, str) else list(stops)
                ids = encode(context)
                new: list[int] = []
                text = ""
                for _ in range(int(settings.get("max_gen_toks", 256))):
                    next_id = int(self._log_probs([(ids + new)[-block_size:]])[0, -1].argmax())
                    if next_id == self.eot_token_id:
                        break
                    new.append(next_id)
                    text = decode(new)
                    if any(stop in text for stop in stops):
                        break
                for stop in stops:
                    text = text.split(stop)[0]
                outputs.append(text)
                self.cache_hook.add_partial("generate_until", (context, settings), text)
            return outputs

        @torch.no_grad()
        def _log_probs(self, inputs: list[list[int]]) -> torch.Tensor:
            """Log-probabilities [batch, time, vocab] of right-padded inputs (a causal model: padding changes nothing
            before it)."""
            width = max(len(ids) for ids in inputs)
            batch = torch.tensor([ids + [0] * (width - len(ids)) for ids in inputs], device=device)
            logits = model(batch)
            logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits  # tensor parallel: a DTensor
            return F.log_softmax(logits.float(), dim=-1)

        def _progress(self, items: list[Any], what: str, unit: str, disable: bool) -> Iterable[Any]:
            return counted(items, what, len(items), unit) if show_progress and not disable else items

    return ProjectLM()


@torch.no_grad()
def run_tasks(
    lm: Any, tasks: dict[str, Any], limit: float | None, log_samples: bool, bootstrap_iters: int = 0
) -> dict[str, Any]:
    """lm-eval's results of the loaded tasks (results, per-example samples when asked, configs, versions); standard
    errors of metrics other than means are bootstrapped `bootstrap_iters` times (0: not computed)."""
    import lm_eval.evaluator

    with offline():
        results = lm_eval.evaluator.evaluate(
            lm, tasks, limit=limit, log_samples=log_samples, bootstrap_iters=bootstrap_iters
        )
    return results  # type: ignore[no-any-return]


def scores(results: dict[str, Any]) -> dict[str, float]:
    """The figures to log: {"<task>/<metric>": value} of each task's metrics (lm-eval's "acc,none" is "acc";
    another filter's name is appended), standard errors left out."""
    flat = {}
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            metric, _, filter_name = key.partition(",")
            if filter_name and "_stderr" not in metric and isinstance(value, (int, float)):
                name = metric if filter_name == "none" else f"{metric}_{filter_name}"
                flat[f"{task}/{name}"] = float(value)
    return flat


def write_results(results: dict[str, Any], path: Path) -> None:
    """lm-eval's results as JSON, written to a temporary file and renamed (never half-written)."""
    from lm_eval.utils import handle_non_serializable

    temporary = path.with_name(path.name + ".partial")
    temporary.write_text(json.dumps(results, indent=2, default=handle_non_serializable) + "\n")
    temporary.replace(path)


def evaluate_checkpoint(
    checkpoint: Path,
    task_names: list[str],
    include_path: str | None = None,
    limit: float | None = None,
    batch_size: int = 8,
    device: str = "cpu",
    log_samples: bool = False,
    out: Path | None = None,
    allow_code: bool = False,
) -> tuple[dict[str, Any], Path]:
    """Evaluate a checkpoint's model (sharded or whole, read directly; one process) on lm-eval tasks and write the
    results as JSON beside it; (the results, the file written)."""
    from ...checkpoint.tensors import load_model
    from .task_folder import check_task_folder

    if include_path is not None:
        check_task_folder(include_path, allow_code, "--include_path", "--allow_code_in_tasks")
    if batch_size < 1:
        raise RecipeError(f"--batch_size {batch_size} must be >= 1")
    if limit is not None and limit <= 0:
        raise RecipeError(f"--limit {limit:g} must be > 0 (examples per task, or a fraction of them below 1)")
    try:
        target = torch.device(device)
    except RuntimeError:
        raise RecipeError(f"--device {device!r} is not a device (cpu, cuda, cuda:1, ...)") from None
    if target.type == "cuda" and not torch.cuda.is_available():
        raise RecipeError(f"--device {device} but no CUDA GPU is visible on this machine (use --device cpu)")
    out = out or checkpoint.with_name(checkpoint.name + RESULTS_SUFFIX)
    tasks = load_tasks(task_names, include_path)  # refused before the model is read
    model, recipe = load_model(checkpoint)
    lm = project_lm(model.to(target), recipe, target, batch_size)
    results = run_tasks(lm, tasks, limit, log_samples, bootstrap_iters=100_000)  # lm-eval's default
    results["config"] = {"checkpoint": str(checkpoint), "limit": limit, "batch_size": batch_size, "device": device}
    write_results(results, out)
    return results, out


class TrainingEvaluation:
    """`eval.tasks` during training: loaded once before the first step, run on every rank (a sharded model's
    forward is collective: all ranks run the same requests in the same order) with the model as it trains."""

    def __init__(self, recipe: Any) -> None:
        self.recipe = recipe
        config = recipe.eval
        self.every = config.tasks_every_steps or config.every_steps
        self.tasks = load_tasks(config.tasks, config.tasks_include_path, where=field_path(config, "tasks"))

    def due(self, step: int, max_steps: int) -> bool:
        """Whether the tasks run after this step: every `every` steps and at the end."""
        return bool(self.every) and (step % self.every == 0 or step == max_steps)

    def run(self, fabric: Any, model: Any) -> dict[str, float]:
        """The tasks' scores ({"<task>/<metric>": value}) of the model now; training's random streams untouched."""
        from ...checkpoint.rng import rng_state, set_rng_state

        saved = rng_state()
        model.eval()
        try:
            lm = project_lm(
                model, self.recipe, fabric.device, self.recipe.train.micro_batch_size, fabric.global_rank == 0
            )
            results = run_tasks(lm, self.tasks, self.recipe.eval.tasks_limit, log_samples=False)
        finally:
            model.train()
            set_rng_state(saved)
        return scores(results)
