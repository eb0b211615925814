"""Every bad input is refused before work starts: exit code 2, one line on stderr naming the field or path and
what is allowed, no traceback, nothing written, in under 10 s; damaged or mismatched state is refused, never
overwritten. Inputs a recipe alone decides are refused before torch is imported.

The machinery's own test: its recipes are the toy task's (tests/toy_task/, tests/toy-debug.yaml), so it runs in
every project; a task's own fields and data have their own table under tests/tasks/<task>/."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import (
    PACKAGE,
    RECIPES,
    TOY_RECIPE,
    assert_one_line_refusal,
    assert_refused_before_launch,
    cli_env,
    outcomes_without_torch,
)

TOY = "task: vector_regression\n"  # a recipe of the toy task names it, as tests/toy-debug.yaml does

# (id, recipe text or None for tests/toy-debug.yaml, overrides, what the one line must say)
RECIPE_ONLY: list[tuple[str, str | None, list[str], str]] = [
    ("unknown top-level key with an empty mapping", TOY + "optimiser: {}\n", [], "unknown key 'optimiser' (allowed: "),
    (
        "unknown nested key with an empty mapping",
        TOY + "train:\n  lr_schedule: {}\n",
        [],
        "unknown key 'train.lr_schedule'",
    ),
    ("misspelt top-level key", TOY + "devicez: 2\n", [], "unknown key 'devicez'"),
    (
        "misspelt sibling key",
        TOY + "train:\n  max_step: 5\n",
        [],
        "unknown key 'train.max_step': did you mean 'train.max_steps'? (allowed in train: max_steps",
    ),
    (
        "misspelt options key",
        TOY + "strategy:\n  name: deepspeed\n  deepspeed:\n    stagee: 3\n",
        [],
        "'strategy.deepspeed.stagee'",
    ),
    ("abbreviated flag", None, ["--train.max_step", "5"], "unknown option '--train.max_step'"),
    ("abbreviated flag of a float", None, ["--train.learning", "0.5"], "unknown option '--train.learning'"),
    ("flag of an unknown section", None, ["--trian.max_steps", "5"], "unknown option '--trian.max_steps'"),
    ("empty recipe file", "", [], "the file is empty"),
    ("recipe that is a list", "- devices\n- 2\n", [], "must be a mapping of keys"),
    ("recipe that is a scalar", "fsdp2\n", [], "must be a mapping of keys"),
    ("YAML syntax error", TOY + "devices: 2\ntrain: [1\n", [], "line 4, column 1: "),
    ("tab indentation", TOY + "train:\n\tmax_steps: 5\n", [], "line 3, column 1: "),
    ("devices of the wrong type", TOY + "devices: two\n", [], "devices: expected int, got 'two'"),
    ("no devices", None, ["--devices", "0"], "devices=0 must be >= 1"),
    ("no nodes", None, ["--num_nodes", "0"], "num_nodes=0 must be >= 1"),
    ("unknown precision", None, ["--precision", "fp8"], "precision: 'fp8' is not allowed (choose one of"),
    ("unknown accelerator", None, ["--accelerator", "tpu"], "accelerator: 'tpu' is not allowed"),
    ("unknown strategy", None, ["--strategy.name", "zero9"], "strategy.name='zero9' is not one of: ddp, fsdp2"),
    (
        "ZeRO stage 4",
        None,
        ["--strategy.deepspeed.stage", "4"],
        "--strategy.deepspeed.stage: 4 is not allowed (choose one of 1, 2, 3)",
    ),
    ("options of another strategy", None, ["--strategy.deepspeed.stage", "3"], "strategy.deepspeed applies only to"),
    ("FSDP1 options on fsdp2", None, ["--strategy.fsdp.sharding", "HYBRID_SHARD"], "strategy.fsdp applies only to"),
    (
        "tensor parallel not dividing devices",
        None,
        ["--strategy.fsdp2.tensor_parallel_size", "3"],
        "does not divide devices=2",
    ),
    (
        "tensor parallel of 0",
        None,
        ["--strategy.fsdp2.tensor_parallel_size", "0"],
        "tensor_parallel_size=0 must be >= 1",
    ),
    ("tensor parallel of a non-number", None, ["--strategy.fsdp2.tensor_parallel_size", "x"], "expected int, got 'x'"),
    ("hsdp on one node", None, ["--strategy.name", "hsdp"], "strategy.name=hsdp needs num_nodes >= 2"),
    ("deepspeed on CPU", None, ["--strategy.name", "deepspeed"], "strategy.name=deepspeed needs CUDA GPUs"),
    ("FSDP1 on CPU", None, ["--strategy.name", "fsdp"], "strategy.name=fsdp needs CUDA GPUs"),
    ("float8 on CPU", None, ["--strategy.fsdp2.float8", "true"], "strategy.fsdp2.float8=true needs GPUs"),
    (
        "meta init under ddp",
        None,
        ["--strategy.name", "ddp", "--strategy.meta_init", "true"],
        "strategy.meta_init=True applies only",
    ),
    ("no timeout", None, ["--strategy.timeout_minutes", "0"], "strategy.timeout_minutes=0 must be >= 1"),
    (
        "nccl on CPU",
        None,
        ["--strategy.process_group_backend", "nccl"],
        "strategy.process_group_backend=nccl needs GPUs",
    ),
    (
        "16-bit precision on CPU",
        None,
        ["--strategy.name", "ddp", "--precision", "16-mixed"],
        "precision=16-mixed needs a GPU",
    ),
    ("16-bit precision under fsdp2", None, ["--precision", "16-mixed"], "precision=16-mixed is not supported with"),
    ("checkpointing every 0th block", None, ["--strategy.activation_checkpointing_every", "0"], "must be >= 1"),
    (
        "tensor parallel not dividing the task's width",
        None,
        ["--strategy.fsdp2.tensor_parallel_size", "2", "--model.width", "33"],
        "strategy.fsdp2.tensor_parallel_size=2 does not divide model.width=33",
    ),
    (
        "a field of the task's model of the wrong type",
        None,
        ["--model.width", "wide"],
        "model.width: expected int, got 'wide'",
    ),
    (
        "a field of the task's data of the wrong type",
        None,
        ["--data.noise", "loud"],
        "data.noise: expected float, got 'loud'",
    ),
    ("another task's model field", None, ["--model.n_head", "2"], "unknown option '--model.n_head'"),
    (
        "misspelt key of the task's model",
        TOY + "model:\n  widht: 32\n",
        [],
        "unknown key 'model.widht': did you mean 'model.width'?",
    ),
    ("unknown task", None, ["--task", "speech"], "task='speech' is not one of: "),
    ("zero learning rate", None, ["--train.learning_rate", "0"], "train.learning_rate=0.0 must be > 0"),
    ("floor above the peak", None, ["--train.min_learning_rate", "1"], "train.min_learning_rate=1.0 must not exceed"),
    ("beta2 of 1", None, ["--train.beta2", "1.0"], "train.beta2=1.0 must be in [0, 1)"),
    ("negative steps", None, ["--train.max_steps", "-5"], "train.max_steps=-5 must be >= 1"),
    ("no micro-batches", None, ["--train.grad_accum_steps", "0"], "train.grad_accum_steps=0 must be >= 1"),
    ("negative clipping", None, ["--train.grad_clip", "-1"], "train.grad_clip=-1.0 must be >= 0"),
    ("unknown non-finite policy", None, ["--train.on_nonfinite_loss", "ignore"], "'ignore' is not allowed"),
    ("no validation batches", None, ["--eval.batches", "0"], "eval.batches=0 must be >= 1"),
    ("negative retention", None, ["--checkpoint.keep_last", "-1"], "checkpoint.keep_last=-1 must be >= 0"),
    (
        "async save without sharded checkpoints",
        None,
        ["--strategy.name", "ddp", "--checkpoint.async_save", "true"],
        "checkpoint.async_save=true needs",
    ),
    (
        "blank resume path",
        TOY + "checkpoint:\n  resume: ' '\n",
        [],
        "checkpoint.resume must be null, auto, or a checkpoint path",
    ),
    ("unknown logger", None, ["--logger.name", "mlflow"], "logger.name: 'mlflow' is not allowed"),
    ("logging every 0 steps", None, ["--logger.log_every_steps", "0"], "logger.log_every_steps=0 must be >= 1"),
    ("negative peak", None, ["--logger.peak_tflops", "-1"], "logger.peak_tflops=-1.0 must be > 0"),
    (
        "artifact upload without W&B",
        None,
        ["--logger.name", "csv", "--logger.upload_final_weights", "true"],
        "needs logger.name=wandb",
    ),
]


@pytest.fixture(scope="module")
def refused_without_torch(tmp_path_factory: pytest.TempPathFactory, toy_source: Path) -> dict[str, dict]:
    """case id -> (exit code, stderr, seconds) of every recipe-only case, run where torch cannot be imported."""
    folder = tmp_path_factory.mktemp("recipe_only")
    cases = {}
    for index, (case_id, text, overrides, _) in enumerate(RECIPE_ONLY):
        recipe = TOY_RECIPE
        if text is not None:
            recipe = folder / f"case-{index}.yaml"
            recipe.write_text(text)
        out_dir = folder / f"out-{index}"
        cases[case_id] = ["train", "--config", str(recipe), "--out_dir", str(out_dir), *overrides]
    outcomes = outcomes_without_torch(cases, folder, toy_source)
    assert not [path for path in folder.iterdir() if path.name.startswith("out-")], "an out_dir was created"
    return outcomes


def test_there_are_at_least_forty_bad_inputs() -> None:
    """The machinery's table alone holds over forty (a task adds its own fields' and data's)."""
    assert len(RECIPE_ONLY) + len(STATE_CASES) >= 40


@pytest.mark.parametrize(("case_id", "message"), [(case[0], case[3]) for case in RECIPE_ONLY], ids=lambda v: v)
def test_a_bad_recipe_is_refused_in_one_line_before_torch_is_imported(
    refused_without_torch: dict[str, dict], case_id: str, message: str
) -> None:
    outcome = refused_without_torch[case_id]
    assert_one_line_refusal(outcome["code"], outcome["stderr"], message)
    assert outcome["seconds"] < 10


def fake_checkpoint(
    out_dir: Path, step: int, model_overrides: dict, damaged: bool = False, strategy: str | None = None
) -> Path:
    """A checkpoint folder as the Checkpointer writes it (meta.json last), for the toy task's model with these
    overrides (the toy task known in this process: `toy_task_here`)."""
    from {{ cookiecutter.package_name }}.recipe.load import dump_recipe, load_recipe

    recipe = load_recipe(TOY_RECIPE)
    for key, value in model_overrides.items():
        setattr(recipe.model, key, value)
    folder = out_dir / "checkpoints" / f"step-{step:08d}"
    (folder / "state").mkdir(parents=True)
    (folder / "state" / "__0_0.distcp").write_bytes(os.urandom(1000))
    (folder / "config.yaml").write_text(dump_recipe(recipe))
    files = {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*") if p.is_file()}
    if damaged:
        files["state/__0_0.distcp"] = 5000  # as if the shard were cut short after the rename
    meta = {"step": step, "tokens_seen": 0, "files": files} | ({"strategy": strategy} if strategy else {})
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


def out_dir_is_a_file(tmp: Path) -> tuple[list[str], Path]:
    (tmp / "run").write_text("not a folder")
    return ["--out_dir", str(tmp / "run")], tmp / "run"


def out_dir_below_a_file(tmp: Path) -> tuple[list[str], Path]:
    (tmp / "plain").write_text("not a folder")
    return ["--out_dir", str(tmp / "plain" / "run")], tmp / "plain" / "run"


def resume_another_model_shape(tmp: Path) -> tuple[list[str], Path]:
    fake_checkpoint(tmp / "run", 4, {"width": 64})
    return ["--out_dir", str(tmp / "run"), "--checkpoint.resume", "auto"], tmp / "run"


def resume_a_layout_this_strategy_cannot_read(tmp: Path) -> tuple[list[str], Path]:
    fake_checkpoint(tmp / "run", 4, {}, strategy="deepspeed")  # DeepSpeed's own layout, under the toy's fsdp2
    return ["--out_dir", str(tmp / "run"), "--checkpoint.resume", "auto"], tmp / "run"


def resume_auto_with_only_a_damaged_checkpoint(tmp: Path) -> tuple[list[str], Path]:
    fake_checkpoint(tmp / "run", 4, {}, damaged=True)
    return ["--out_dir", str(tmp / "run"), "--checkpoint.resume", "auto"], tmp / "run"


def resume_a_missing_checkpoint(tmp: Path) -> tuple[list[str], Path]:
    return ["--out_dir", str(tmp / "run"), "--checkpoint.resume", str(tmp / "nope")], tmp / "run"


def resume_an_incomplete_checkpoint(tmp: Path) -> tuple[list[str], Path]:
    (tmp / "step-00000004").mkdir()
    return ["--out_dir", str(tmp / "run"), "--checkpoint.resume", str(tmp / "step-00000004")], tmp / "run"


def wandb_online_without_credentials(tmp: Path) -> tuple[list[str], Path]:
    return ["--logger.name", "wandb", "--out_dir", str(tmp / "run")], tmp / "run"


def cuda_on_a_machine_without(tmp: Path) -> tuple[list[str], Path]:
    return ["--accelerator", "cuda", "--out_dir", str(tmp / "run")], tmp / "run"


def gpu_strategy_where_auto_means_cpu(tmp: Path) -> tuple[list[str], Path]:
    return ["--accelerator", "auto", "--strategy.name", "fsdp", "--strategy.process_group_backend", "null", "--out_dir", str(tmp / "run")], tmp / "run"  # fmt: skip


STATE_CASES = [
    (out_dir_is_a_file, "is a file, not a folder"),
    (out_dir_below_a_file, "is not a writable folder"),
    (resume_another_model_shape, "was saved for another model (model.width=64 there, 32 here)"),
    (resume_a_layout_this_strategy_cannot_read, "was saved by strategy.name=deepspeed, whose layout strategy.name="),
    (resume_auto_with_only_a_damaged_checkpoint, "no complete checkpoint under"),
    (resume_a_missing_checkpoint, "no such checkpoint folder"),
    (resume_an_incomplete_checkpoint, "not a complete checkpoint"),
    (wandb_online_without_credentials, "needs W&B credentials: set WANDB_API_KEY or run `wandb login`"),
    (cuda_on_a_machine_without, "accelerator=cuda but no CUDA GPU is visible"),
    (gpu_strategy_where_auto_means_cpu, "strategy.name=fsdp needs CUDA GPUs and this machine has none"),
]


@pytest.mark.slow  # each case starts a process that imports torch
@pytest.mark.usefixtures("toy_task_here")
@pytest.mark.parametrize(("make", "message"), STATE_CASES, ids=lambda v: getattr(v, "__name__", ""))
def test_bad_paths_and_state_are_refused_before_launch_and_leave_everything_as_it_was(
    make, message: str, tmp_path: Path, toy_source: Path
) -> None:
    overrides, out_dir = make(tmp_path)
    online = {"WANDB_MODE": "online"} if make is wandb_online_without_credentials else {}
    args = ["train", "--config", str(TOY_RECIPE), *overrides]
    assert_refused_before_launch(args, message, out_dir, tmp_path, toy_source, **online)


@pytest.mark.slow
@pytest.mark.usefixtures("toy_task_here")
def test_an_older_complete_checkpoint_is_used_and_the_newer_damaged_one_named(tmp_path: Path, toy_source: Path) -> None:
    from {{ cookiecutter.package_name }}.checkpoint.layout import resolve_resume
    from {{ cookiecutter.package_name }}.recipe.load import parse_recipe

    older = fake_checkpoint(tmp_path / "run", 4, {})
    fake_checkpoint(tmp_path / "run", 8, {}, damaged=True)
    recipe = parse_recipe(["--config", str(TOY_RECIPE), "--out_dir", str(tmp_path / "run")])
    script = (
        f"from {PACKAGE}.checkpoint.layout import resolve_resume\n"
        f"from {PACKAGE}.recipe.load import parse_recipe\n"
        f"print(resolve_resume(parse_recipe(['--config', {str(TOY_RECIPE)!r}, '--out_dir', {str(tmp_path / 'run')!r}])))"
    )
    result = subprocess.run([sys.executable, "-c", script], env=cli_env(toy_source), capture_output=True, text=True)
    assert result.stdout.strip() == str(older), result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "skipping incomplete checkpoint" in lines[0] and "step-00000008" in lines[0], lines
    assert "resuming from step-00000004" in lines[0]
    assert resolve_resume(recipe) == older  # in-process as well


def test_a_listing_cut_short_by_its_reader_ends_quietly() -> None:
    read, write = os.pipe()
    os.close(read)  # the reader has gone, as with `recipes list | head -1` once head has its line
    result = subprocess.run([sys.executable, "-m", PACKAGE, "recipes", "list"], env=cli_env(), stdout=write, stderr=subprocess.PIPE, text=True)  # fmt: skip
    os.close(write)
    assert result.returncode == 0 and "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr, (
        result.stderr
    )


def test_every_recipe_of_the_library_still_parses_through_the_key_check() -> None:
    """The project's library (recipes/: its task's recipes) passes the checks the table above exercises."""
    from {{ cookiecutter.package_name }}.recipe.load import load_recipe

    recipes = sorted(RECIPES.glob("*.yaml"))
    assert recipes, f"no recipes in {RECIPES}"
    for path in recipes:
        assert isinstance(yaml.safe_load(path.read_text()), dict)
        load_recipe(path)
