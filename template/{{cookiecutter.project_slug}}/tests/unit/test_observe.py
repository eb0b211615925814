"""What a run reports: the MFU arithmetic, the GPU peak table, FLOPs per sample, progress output, loggers.

The machinery's own test: its runs are of the toy task (tests/toy_task/), so it runs in every project; the project
task's FLOPs per unit are tested in tests/tasks/<task>/.
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import io
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import logged_metrics
from lightning.fabric import Fabric
from lightning.fabric.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from toy_task.config import MlpConfig, VectorRecipe
from toy_task.model import Mlp
from toy_task.sizing import MlpShape
from toy_task.task import VectorRegression

from {{ cookiecutter.package_name }}.errors import RecipeError
from {{ cookiecutter.package_name }}.planner.hardware import gpu_model, peak_tflops
from {{ cookiecutter.package_name }}.recipe.schema import LoggerConfig, TrainConfig
from {{ cookiecutter.package_name }}.tasks import task_class, task_names
from {{ cookiecutter.package_name }}.training.loggers import build_loggers, finish_loggers, log_config, wandb_offline
from {{ cookiecutter.package_name }}.training.metrics_csv import MetricsCsv
from {{ cookiecutter.package_name }}.training.monitor import Monitor, Progress, model_flops_utilization


def test_mfu_is_achieved_model_flops_over_the_dense_peak() -> None:
    # A 1B-parameter model (6e9 FLOPs per token) at 50,000 tokens/s on one H100 SXM (989.4 TFLOP/s).
    assert model_flops_utilization(6e9, 50_000, 989.4) == pytest.approx(3e14 / 989.4e12)
    assert model_flops_utilization(6e9, 50_000, 989.4) == pytest.approx(0.30321, abs=1e-5)


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true", "16-mixed", "16-true"])
def test_h200_and_h100_sxm_half_precision_peak_is_the_dense_989_not_the_sparse_1979(precision: str) -> None:
    for name in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA GH200 480GB"):
        assert peak_tflops(name, precision) == 989.4, name


@pytest.mark.parametrize(
    ("device_name", "row"),
    [
        ("NVIDIA H200", "H200 SXM"),
        ("NVIDIA H200 NVL", "H200 NVL"),
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA A100 80GB PCIe", "A100"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA L40", "L40"),
        ("NVIDIA A10", "A10"),
        ("NVIDIA RTX A6000", "RTX A6000"),
        ("NVIDIA B200", "B200"),
        ("Tesla V100-SXM2-32GB", "V100 SXM"),
        ("Tesla V100-PCIE-16GB", "V100 PCIe"),
        ("NVIDIA A10G", "A10G"),
        ("Tesla T4", "T4"),
        ("NVIDIA GeForce RTX 4090", "RTX 4090"),
        ("NVIDIA A40", "A40"),
        ("NVIDIA GB200", "GB200"),
        ("NVIDIA H20", "H20"),
        ("NVIDIA H800", "H800 SXM"),
        ("NVIDIA H800 PCIe", "H800 PCIe"),
        ("NVIDIA GeForce GTX 1080", None),
        ("NVIDIA RTX A1000", None),
    ],
)
def test_device_names_as_torch_reports_them_find_their_row(device_name: str, row: str | None) -> None:
    assert gpu_model(device_name) == row


def test_table_peaks_per_precision() -> None:
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "bf16-mixed") == 312.0
    assert peak_tflops("NVIDIA L4", "bf16-mixed") == 121.0
    assert peak_tflops("NVIDIA H100 PCIe", "16-mixed") == 756.0
    # 32-true runs on tensor cores only when TF32 matmuls are allowed.
    assert peak_tflops("NVIDIA H100 80GB HBM3", "32-true", tf32=True) == 494.7
    assert peak_tflops("NVIDIA H100 80GB HBM3", "32-true", tf32=False) == 67.0
    # A GPU without bf16, or one missing from the table, gives no peak (and no MFU) rather than a wrong one.
    assert peak_tflops("Tesla V100-SXM2-32GB", "bf16-mixed") is None
    assert peak_tflops("NVIDIA GeForce GTX 1080", "bf16-mixed") is None


@pytest.mark.parametrize(
    ("device_name", "precision", "peak"),
    [
        ("NVIDIA A10G", "bf16-mixed", 125.0),
        ("Tesla T4", "16-mixed", 65.0),
        ("NVIDIA GeForce RTX 4090", "bf16-mixed", 165.2),  # tensor cores, fp32 accumulate; not the 82.6 shader rate
        ("NVIDIA A40", "bf16-mixed", 149.7),
        ("NVIDIA GB200", "bf16-true", 2500.0),
        ("NVIDIA H20", "bf16-mixed", 148.0),
        ("NVIDIA H800", "bf16-mixed", 989.4),
        ("NVIDIA H800 PCIe", "16-mixed", 756.0),
        ("Tesla T4", "bf16-mixed", None),  # Turing has no bf16 tensor cores
    ],
)
def test_dense_peaks_of_the_added_gpus(device_name: str, precision: str, peak: float | None) -> None:
    assert peak_tflops(device_name, precision) == peak


def test_a_gpu_missing_from_the_table_falls_back_to_lightnings_rows_that_are_right() -> None:
    # Not in PEAK_TFLOPS; Lightning's table has them with their datasheet figures.
    assert gpu_model("Tesla V100S-PCIE-32GB") is None
    assert peak_tflops("Tesla V100S-PCIE-32GB", "16-mixed") == pytest.approx(130.0)
    assert peak_tflops("Quadro RTX 5000", "16-true") == pytest.approx(89.2)
    # Lightning lists the non-tensor rate as bf16 for GeForce cards (35.6 for the 3090): not used.
    assert peak_tflops("NVIDIA GeForce RTX 3090", "bf16-mixed") is None
    # Whole names only: the RTX A1000 is not an A100.
    assert peak_tflops("NVIDIA RTX A1000", "bf16-mixed") is None


def test_the_toy_tasks_flops_per_vector_are_six_per_matmul_parameter() -> None:
    """The FLOPs the monitor's MFU of a toy run divides by: 2 per multiply-add forward, 4 backward."""
    config = MlpConfig(width=16, depth=2)
    with torch.device("meta"):
        matmul_parameters = sum(p.numel() for p in Mlp(config).parameters() if p.dim() == 2)
    assert MlpShape(config).training_flops_per_sample() == 6 * matmul_parameters


def tiny_recipe(tmp_path: Path, **logger: object) -> VectorRecipe:
    return VectorRecipe(
        task=VectorRegression.name,
        accelerator="cpu",
        devices=1,
        out_dir=str(tmp_path),
        model=MlpConfig(),
        train=TrainConfig(max_steps=100, micro_batch_size=4),
        logger=dataclasses.replace(LoggerConfig(), log_every_steps=10, **logger),
    )


def monitor_of(
    fabric: Fabric,
    flops_per_unit: float,
    tmp_path: Path,
    unit: str = "vector",
    units_per_sample: int = 1,
    **logger: object,
) -> Monitor:
    """The monitor of a run of the toy recipe, 4 samples a step; `unit`, `units_per_sample`: what the task counts."""
    recipe = tiny_recipe(tmp_path, **logger)
    return Monitor(
        fabric, recipe, 0, samples_per_step=4, unit=unit, units_per_sample=units_per_sample,
        flops_per_unit=flops_per_unit,
    )  # fmt: skip


def test_monitor_throughput_gives_the_expected_mfu_from_known_flops_time_and_peak(tmp_path: Path) -> None:
    # A task whose sample is a sequence of 16 tokens, so that units and samples differ.
    fabric = Fabric(accelerator="cpu", devices=1)
    monitor = monitor_of(fabric, 1_000_000, tmp_path, unit="token", units_per_sample=16, peak_tflops=2.0)
    metrics = monitor.throughput(steps=10, seconds=2.0)
    tokens_per_second = 10 * 4 * 16 / 2.0  # steps * samples * tokens per sample / seconds
    assert metrics["throughput/tokens_per_second"] == tokens_per_second
    assert metrics["throughput/samples_per_second"] == 20.0
    assert metrics["throughput/tflops_per_second_per_device"] == pytest.approx(tokens_per_second * 1e6 / 1e12)
    assert metrics["throughput/mfu"] == pytest.approx(tokens_per_second * 1e6 / 2e12)


def test_without_a_known_peak_tflops_are_logged_but_no_mfu(tmp_path: Path) -> None:
    monitor = monitor_of(Fabric(accelerator="cpu", devices=1), 1_000_000, tmp_path)
    metrics = monitor.throughput(steps=10, seconds=2.0)
    assert "throughput/tflops_per_second_per_device" in metrics and "throughput/mfu" not in metrics


def test_a_skipped_update_is_counted_under_one_name_and_said(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    logged = []
    monkeypatch.setattr(fabric, "log_dict", lambda metrics, step: logged.append((metrics, step)))
    monitor = monitor_of(fabric, 1_000_000, tmp_path)
    monitor.log_skipped_update(step=6, skipped_updates=3)
    assert logged == [({"train/skipped_updates": 3.0}, 6)]
    assert "Skipped the update of step 6: loss is NaN or infinite on some rank" in capsys.readouterr().out


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def drive(progress: Progress, max_steps: int, every: int) -> None:
    """What the loop does: advance every step, report at logging steps."""
    for step in range(1, max_steps + 1):
        progress.advance(step)
        if step % every == 0:
            progress.report(step, {"train/loss": 2.5, "throughput/tokens_per_second": 1234.0}, eta_seconds=60.0)
    progress.close()


def test_progress_off_a_terminal_is_one_plain_line_per_logging_interval() -> None:
    log = io.StringIO()
    drive(Progress(0, 1000, stream=log), max_steps=1000, every=100)
    lines = log.getvalue().splitlines()
    assert len(lines) == 10
    assert "\r" not in log.getvalue()
    assert lines[0] == "step 100/1000 | loss 2.5000 | 1,234 tokens/s | eta 0:01:00"


def test_progress_on_a_terminal_is_a_live_bar_with_loss_throughput_and_eta() -> None:
    terminal = Terminal()
    drive(Progress(0, 50, stream=terminal), max_steps=50, every=10)
    output = terminal.getvalue()
    assert "\r" in output and "50/50" in output
    assert "loss 2.5000, 1,234 tokens/s" in output
    assert re.search(r"\d\d:\d\d<\d\d:\d\d", output), "elapsed<remaining (the ETA) is shown"
    assert "step 10/50 |" not in output


def test_only_rank_zero_shows_progress() -> None:
    log = io.StringIO()
    drive(Progress(0, 100, stream=log, enabled=False), max_steps=100, every=10)
    assert log.getvalue() == ""


def test_csv_and_tensorboard_receive_the_same_metrics(tmp_path: Path) -> None:
    csv_logger, tensorboard = CSVLogger(tmp_path / "csv"), TensorBoardLogger(tmp_path / "tb")
    fabric = Fabric(accelerator="cpu", devices=1, loggers=[csv_logger, tensorboard])
    monitor = monitor_of(fabric, 1000, tmp_path, peak_tflops=1.0)
    for step in range(1, 21):
        monitor.step_end(step, torch.tensor(2.0), torch.tensor(0.5), 1e-3, units_seen=step * 64, epoch=0)
    monitor.log_validation(20, VectorRegression(tiny_recipe(tmp_path)).validation_results({"loss": 1.5}), seconds=0.1)
    monitor.log_checkpoint(20, tmp_path / "step-20", seconds=0.2)
    monitor.close()
    csv_logger.finalize("success")
    tensorboard.finalize("success")

    with (Path(csv_logger.log_dir) / "metrics.csv").open() as handle:
        csv_keys = set(next(csv.reader(handle))) - {"step"}
    events = EventAccumulator(str(tensorboard.log_dir))
    events.Reload()
    assert set(events.Tags()["scalars"]) == csv_keys
    assert csv_keys >= logged_metrics(VectorRegression.unit)


def test_wandb_is_offline_without_credentials_and_online_with_a_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc from `wandb login`
    monkeypatch.delenv("NETRC", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert wandb_offline()
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef")
    assert not wandb_offline()
    monkeypatch.setenv("WANDB_MODE", "offline")  # a cluster without internet access
    assert wandb_offline()


def test_wandb_logs_through_lightnings_logger_with_the_provenance_in_its_config_and_no_version_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """W&B's own Fabric integration warned 'tested and supported for lightning Fabric 2.1.3' on every rank. What made
    the run reaches W&B's config beside the recipe, and the CSV logger's provenance.json (what `report` reads)."""
    from lightning.pytorch.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_SILENT", raising=False)  # the warning must not be hidden, but absent
    recipe = tiny_recipe(tmp_path, name="wandb")
    loggers = build_loggers(recipe, run_id="abcd1234")
    assert [type(logger) for logger in loggers] == [WandbLogger, MetricsCsv]  # CSV: what `report` reads
    made_by = {"commit": "5d6e7f8a", "dirty": False, "versions": {"torch": torch.__version__}, "launcher": "local"}
    log_config(loggers, recipe, made_by)
    assert loggers[0].experiment.config["provenance"] == made_by
    assert loggers[0].experiment.config["train"]["max_steps"] == recipe.train.max_steps
    assert json.loads((Path(loggers[1].log_dir) / "provenance.json").read_text()) == made_by
    loggers[0].log_metrics({"train/loss": 2.0}, step=1)
    finish_loggers(loggers)
    assert "tested and supported" not in "".join(capfd.readouterr())
    assert [path.name.endswith("-abcd1234") for path in (tmp_path / "wandb").glob("offline-run-*")] == [True]


@pytest.mark.parametrize("name", ["wandb", "tensorboard"])
def test_a_missing_logger_package_is_refused_naming_the_install_that_brings_it(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda module: None if module == name else find_spec(module))
    with pytest.raises(RecipeError, match=f"^logger.name={name} needs {name}: pip install ") as refused:
        build_loggers(tiny_recipe(tmp_path, name=name), run_id="abcd1234")
    install = str(refused.value).split("pip install ")[1].split()[0]
    # The default logger's package is a dependency of the project, the others are extras of their name.
    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    dependencies, extras = pyproject.split("[project.optional-dependencies]")
    if install == name:
        assert re.search(rf'^    "{name}>=', dependencies, re.MULTILINE)
    else:
        assert install == f'"{{ cookiecutter.project_slug }}[{name}]"'
        assert re.search(rf'^{name} = \["{name}>=', extras, re.MULTILINE)


@pytest.mark.parametrize("task", task_names())
def test_credentials_are_never_recipe_fields(task: str) -> None:
    """Keys come from the environment or `wandb login`, so no logged config or checkpoint can hold one."""
    secret = re.compile(r"(^|_)(api_?key|key|token|secret|password|credentials?)$")

    def names(cls: type, prefix: str = "") -> list[str]:
        found = []
        for field in dataclasses.fields(cls):
            found.append(prefix + field.name)
            if dataclasses.is_dataclass(field.default_factory if callable(field.default_factory) else None):
                found += names(field.default_factory, f"{prefix}{field.name}.")
        return found

    fields = names(task_class(task).recipe_type)
    assert "logger.project" in fields
    assert not [name for name in fields if secret.search(name.rsplit(".", 1)[-1])]


@pytest.mark.parametrize("when", ["appending rows", "rewriting the header for a new metric"])
def test_a_full_disk_while_logging_ends_like_a_failed_save_and_keeps_the_rows_written(
    when: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    from {{ cookiecutter.package_name }}.errors import ExitCode, TrainingStopped

    logger = MetricsCsv(root_dir=tmp_path / "csv", name="", flush_logs_every_n_steps=1)
    logger.log_metrics({"train/loss": 2.0}, step=1)
    metrics = Path(logger.experiment.metrics_file_path)
    written = metrics.read_text()
    opened = logger.experiment._fs.open

    class Full:
        """A file opened for writing (so truncated, for "w") on a disk with no room: every write fails."""

        def __init__(self, handle: Any) -> None:
            self.handle = handle

        def __enter__(self) -> Full:
            return self

        def __exit__(self, *exc: object) -> None:
            self.handle.close()

        def __getattr__(self, name: str) -> Any:
            return getattr(self.handle, name)

        def write(self, data: object) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    def full(path: str, mode: str = "r", **kwargs: object) -> object:
        handle = opened(path, mode, **kwargs)
        return Full(handle) if "w" in mode or "a" in mode else handle

    monkeypatch.setattr(logger.experiment._fs, "open", full)
    new = {"train/loss": 1.0} if when == "appending rows" else {"train/loss": 1.0, "val/loss": 1.5}
    with pytest.raises(TrainingStopped, match="metrics not written: no space left") as stopped:
        logger.log_metrics(new, step=2)
    assert stopped.value.exit_code == ExitCode.SAVE_FAILED
    assert metrics.read_text() == written and not list(metrics.parent.glob("*.partial"))
