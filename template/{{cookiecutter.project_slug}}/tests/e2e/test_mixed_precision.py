"""fsdp2 under bf16-mixed: blocks gathered and computed in bf16 (fully_shard's MixedPrecisionPolicy), fp32 master
state, activations as plan estimates them for a 16-bit module, and losses within bf16 noise of ddp's.

The machinery's own test: it trains the toy task (tests/toy_task/: blocks of a LayerNorm and two linear layers),
so it runs in every project."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import PACKAGE, cli_env, run_cli, toy_train_args, train_losses
from toy_task.sizing import MlpShape

from {{ cookiecutter.package_name }}.recipe.load import parse_recipe

pytestmark = pytest.mark.slow

MICRO_BATCH = 2
BF16 = ["--precision", "bf16-mixed", "--logger.name", "none", "--checkpoint.resume", "null"]

MEASURE = """
import json, sys
from pathlib import Path
import torch, torch.nn.functional as F
from torch.distributed.tensor import DTensor
from {package}.errors import exit_process
from {package}.recipe.load import parse_recipe
from {package}.training.run import setup

run = setup(parse_recipe(sys.argv[1:]))
report = dict(block_weights=[], block_inputs=[])
gathered = set()  # storages of the blocks' gathered (unsharded) weights: parameters, not activations

def before_block(module, args):
    weights = [p for p in module.parameters() if p.dim() == 2]
    report["block_weights"] += [str(p.dtype) for p in weights]
    report["block_inputs"].append(str(args[0].dtype))
    gathered.update(p.untyped_storage().data_ptr() for p in module.parameters())

for block in run.model.module.blocks:
    block.register_forward_pre_hook(before_block)
root = run.model.module
# The root's own weights (the input layer and the head), gathered once per step: parameters too.
root.register_forward_pre_hook(lambda module, args: gathered.update(
    p.untyped_storage().data_ptr() for name, p in module.named_parameters() if not name.startswith("blocks.")
))
saved = dict()

def pack(tensor):
    storage = tensor.untyped_storage()
    if storage.data_ptr() not in gathered and storage.nbytes() > 0:
        saved[storage.data_ptr()] = storage.nbytes()
    return tensor

inputs = torch.randn({micro_batch}, run.recipe.model.inputs)
targets = torch.randn({micro_batch}, run.recipe.model.outputs)
with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
    with run.fabric.autocast():
        loss = F.mse_loss(run.model(inputs).float(), targets)
report["saved_bytes"] = sum(size for pointer, size in saved.items() if pointer not in gathered)
run.fabric.backward(loss)
run.optimizer.step()
local = lambda t: t.to_local() if isinstance(t, DTensor) else t
report["master"] = sorted(set(str(local(p).dtype) for p in run.model.parameters()))
report["gradients"] = sorted(set(str(local(p.grad).dtype) for p in run.model.parameters() if p.grad is not None))
report["moments"] = sorted(set(
    str(local(value).dtype) for state in run.optimizer.state.values() for key, value in state.items() if key != "step"
))
Path("{reports}", "rank-%d.json" % run.fabric.global_rank).write_text(json.dumps(report))
run.fabric.barrier()
exit_process(0)
"""


def measure(tmp_path: Path, source: Path) -> list[dict]:
    """What each of 2 fsdp2 ranks saw in one bf16-mixed step of the toy task."""
    script, reports = tmp_path / "measure.py", tmp_path / "reports"
    reports.mkdir()
    script.write_text(MEASURE.format(package=PACKAGE, reports=reports, micro_batch=MICRO_BATCH))
    _, *args = toy_train_args(tmp_path / "run", "--strategy.name", "fsdp2", *BF16)
    result = subprocess.run(
        [sys.executable, str(script), *args], env=cli_env(source), capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-1500:]}\n{result.stderr[-3000:]}"
    return [json.loads((reports / f"rank-{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.usefixtures("toy_task_here")
def test_fsdp2_gathers_and_computes_blocks_in_bf16_and_keeps_fp32_master_state(
    tmp_path: Path, toy_source: Path
) -> None:
    for report in measure(tmp_path, toy_source):
        assert report["block_weights"] and set(report["block_weights"]) == {"torch.bfloat16"}
        assert set(report["block_inputs"]) == {"torch.bfloat16"}  # the residual stream enters each block in bf16
        assert report["master"] == report["gradients"] == report["moments"] == ["torch.float32"]
        # What a 16-bit module saves for backward, as `plan` counts it for fsdp2 under bf16-mixed: no fp32
        # residual stream, no autocast weight copies (the loss's fp32 copy of the outputs aside).
        _, *args = toy_train_args(tmp_path / "run", *BF16)
        estimate = MlpShape(parse_recipe(args).model).activations(MICRO_BATCH, "bf16-true").held
        assert report["saved_bytes"] == pytest.approx(estimate, rel=0.15)
        print(f"saved for backward: {report['saved_bytes']} B, plan's estimate {estimate:.0f} B")


def test_fsdp2_bf16_losses_stay_within_bf16_noise_of_ddp(tmp_path: Path, toy_source: Path) -> None:
    losses = {}
    for strategy in ("ddp", "fsdp2"):
        out_dir = tmp_path / strategy
        steps = ["--train.max_steps", "4", "--eval.every_steps", "0", "--checkpoint.resume", "null"]
        arguments = toy_train_args(out_dir, "--strategy.name", strategy, "--precision", "bf16-mixed", *steps)
        result = run_cli(*arguments, source=toy_source)
        assert result.returncode == 0, result.stderr[-3000:]
        losses[strategy] = train_losses(out_dir)
    assert len(losses["ddp"]) == 4
    # bf16 keeps 8 significant bits: each loss within one bf16 rounding step (2^-8 of its size) of ddp's.
    assert sorted(losses["fsdp2"]) == sorted(losses["ddp"])
    for step, loss in losses["ddp"].items():
        assert abs(losses["fsdp2"][step] - loss) <= 2**-8 * abs(loss), f"step {step}: {losses['fsdp2'][step]} vs {loss}"
