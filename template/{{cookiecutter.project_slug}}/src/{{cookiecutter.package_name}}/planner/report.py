"""What `plan` prints, returns as JSON and writes as a recipe."""

from __future__ import annotations

import copy
from typing import Any

import yaml

from ..recipe.library import recipes_dir
from . import context
from .measured import MeasuredCost
from .options import PlanOption
from .plan import Candidate, Inputs, Plan, device_word
from .units import GB, GIB, count, size

POWERS = {"GiB": "2^30", "MiB": "2^20", "KiB": "2^10", "B": "1"}


def library_recipes(option: PlanOption) -> tuple[str, str, str]:
    """The library recipes that show an option's way of holding the state, which a written plan starts from:
    (on CPUs, on one node, on several). Read from the option's layout, so that no strategy names a recipe."""
    if option.pipeline_parallel > 1:
        return "cpu-pp-debug", "llama-70b-pp-fsdp2-tp-multinode", "llama-70b-pp-fsdp2-tp-multinode"
    if option.tensor_parallel > 1:
        return "cpu-tp-debug", "fsdp2-tp-multinode", "fsdp2-tp-multinode"
    if option.hybrid:
        return "cpu-hsdp-debug", "hsdp-multinode", "hsdp-multinode"
    if option.expert_parallel > 1:
        return "cpu-moe-debug", "fsdp2-node", "fsdp2-multinode"
    if option.context_parallel > 1:
        return "cpu-cp-debug", "fsdp2-node", "llama-8b-cp-128k-multinode"
    if option.stage == 0:
        return "cpu-debug", "ddp-node", "ddp-node"
    if not option.runs_on_cpu:  # ZeRO's stages as DeepSpeed runs them: the one GPU-only runtime plan weighs
        if option.offload == "cpu":
            return "cpu-debug", "deepspeed-zero3-offload-node", "deepspeed-zero3-offload-multinode"
        node = "deepspeed-zero3-nvme-node" if option.offload == "nvme" else f"deepspeed-zero{option.stage}-node"
        return "cpu-debug", node, node
    return "cpu-debug", "fsdp2-node", "fsdp2-multinode"


def library_recipe(candidate: Candidate, inputs: Inputs) -> str | None:
    """The library recipe a written plan starts from (one per layout, `library_recipes`), or None when this
    project's library has no recipe of that name (another task's library) or that recipe is of another task than
    the one planned (a task added beside the project's): its model and data sections would not be the plan's."""
    cpu, one_node, several_nodes = library_recipes(candidate.option)
    name = cpu if inputs.cpu else several_nodes if inputs.num_nodes > 1 else one_node
    path = recipes_dir() / f"{name}.yaml"
    if not path.is_file():
        return None
    return name if (yaml.safe_load(path.read_text()) or {}).get("task") == inputs.task else None


def strategy_section(
    candidate: Candidate, base: dict[str, Any], checkpointing: bool, cpu: bool, micro_batch: int
) -> dict[str, Any]:
    """The nested `strategy:` section for a candidate, keeping the base recipe's timeout, compile and meta_init; a
    pipeline feeds each micro-batch of `micro_batch` samples through in pieces of one sample."""
    section: dict[str, Any] = {
        "name": None,  # the family's section below fills it in
        "process_group_backend": "gloo" if cpu else "nccl",
        "timeout_minutes": base.get("timeout_minutes", 30),
        "activation_checkpointing": checkpointing,
        "activation_checkpointing_every": 1,
        "compile": base.get("compile", False),
        "meta_init": base.get("meta_init", False) and candidate.strategy.supports_meta_init,
    }
    section |= candidate.strategy.plan_section(candidate.option, base)
    context.write_degree({"strategy": section}, candidate.option)
    options_key = candidate.strategy.options_key
    if candidate.option.pipeline_parallel > 1 and options_key:
        section[options_key]["pipeline_microbatches"] = micro_batch
    return section


def written_recipe(base: dict[str, Any], model: dict[str, Any], result: Plan) -> dict[str, Any]:
    """The recommended recipe: `base` (the planned recipe as plain data: its task, model, data, train and the rest)
    with the plan's model, layout, precision, micro batch (the global batch kept by gradient accumulation), strategy
    and an out_dir of its own filled in."""
    best, inputs = result.recommended, result.inputs
    if best is None:
        raise ValueError("nothing fits: there is no recipe to write")
    recipe = copy.deepcopy(base)
    recipe.update(
        accelerator="cpu" if inputs.cpu else "cuda",
        devices=inputs.devices,
        num_nodes=inputs.num_nodes,
        precision=inputs.precision,
        out_dir=f"runs/planned-{best.candidate.name}",
    )
    strategy = base.get("strategy") or {}
    recipe["strategy"] = strategy_section(best.candidate, strategy, best.checkpointing, inputs.cpu, result.micro_batch)
    recipe["model"] = {**recipe.get("model", {}), **model}
    sequences = inputs.micro_batch * inputs.grad_accum
    recipe.setdefault("train", {}).update(
        micro_batch_size=result.micro_batch, grad_accum_steps=max(1, sequences // result.micro_batch)
    )
    return recipe


def render(result: Plan) -> str:
    """The plan as a table and a recommendation, for a terminal."""
    inputs, word = result.inputs, device_word(result.inputs)
    largest = max(e.total for e in result.estimates)
    unit, scale = next(((u, s) for u, s in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)) if largest >= s), ("B", 1))
    gpu = inputs.gpu
    width = max(14, 1 + max(len(e.candidate.name) for e in result.estimates))
    lines = [
        f"model: {count(inputs.parameters)} parameters ({inputs.cost.describe()}),"
        f" micro batch {inputs.micro_batch}, precision {inputs.precision}, AdamW",
        f"layout: {inputs.devices} {word}({'es' if inputs.cpu else 's'}) x {inputs.num_nodes} node(s) = {inputs.world_size} ranks;"
        f" {gpu.name}: {gpu.memory_bytes / GIB:.1f} GiB = {gpu.memory_bytes / GB:.1f} GB per {word},"
        f" {inputs.budget / GIB:.1f} GiB usable ({inputs.margin:.0%} margin)",
        f"bytes per {word} in {unit} ({POWERS[unit]} bytes); params/grads/optim: the ZeRO paper's model"
        " states; runtime: what the runtime adds; act/act-ckpt: activations without / with checkpointing;"
        " comm: volume vs ddp; step: lower bound (s) of one optimizer step",
        "",
        f"{'strategy':<{width}}{'params':>9}{'grads':>9}{'optim':>9}{'runtime':>9}{'act':>9}{'act-ckpt':>9}"
        f"{'total':>9}{'total GB':>10}{'offload/node':>14}  {'fits':<5}{'comm':>6}{'step':>9}",
    ]
    for e in result.estimates:
        cells = [e.states.parameters, e.states.gradients, e.states.optimizer, e.runtime_extra]
        cells += [e.activations.peak, e.activations.checkpointed_peak, e.total]
        row = "".join(f"{value / scale:9.2f}" for value in cells)
        offloaded = f"{e.offloaded / GIB:.1f} GiB" if e.offloaded else "-"
        fits = "yes" if e.fits else ("n/a" if e.unavailable else "no")
        step = f"{e.step_seconds:9.3f}" if e.step_seconds is not None else f"{'-':>9}"
        mark = "*" if e.checkpointing else " "
        lines.append(
            f"{e.candidate.name:<{width}}{row}{mark}{e.total / GB:9.3g}{offloaded:>14}  {fits:<5}{e.comm_vs_ddp:5.2f}x{step}"
        )
    lines.append("(* total with activation checkpointing; n/a: cannot run this layout)")
    for e in result.estimates:
        if (pipeline := e.pipeline) is not None:
            option = e.candidate.option
            lines.append(
                f"{e.candidate.name}: {pipeline.stages} stages ({option.pipeline_schedule}, {result.micro_batch or inputs.micro_batch}"
                f" pieces), bubble {pipeline.bubble:.1%}, the first stage holds {pipeline.pieces_held:g} pieces;"
                f" the worst is pipeline rank {pipeline.rank} ({pipeline.layers} blocks, {size(e.total)}), sends"
                f" {pipeline.p2p_elements:.3g} elements per micro-batch"
            )
    lines.append("")
    if result.recommended is None:
        lines.append(result.reason)
    else:
        recipe = library_recipe(result.recommended.candidate, inputs)
        origin = f" (from recipe {recipe})" if recipe else ""
        lines.append(f"recommended: {result.recommended.candidate.name}{origin}: {result.reason}")
        best = result.recommended
        if gathers := context.describe(inputs, best.candidate.option, result.micro_batch):
            lines.append(gathers)
    if result.longest_context is not None:
        length, name = result.longest_context
        lines.append(
            f"longest context that fits: {length:,} tokens per sequence ({name}, micro batch 1, on"
            f" {inputs.world_size} {gpu.name} {device_word(inputs, plural=inputs.world_size > 1)})"
        )
    return "\n".join(lines)


def to_json(result: Plan) -> dict[str, Any]:
    """The plan as data (the schema is in docs/strategies.md, section `plan`)."""
    inputs = result.inputs
    options = []
    for e in result.estimates:
        used = e.activations.checkpointed_peak if e.checkpointing else e.activations.peak
        options.append(
            {
                "strategy": e.candidate.name,
                "available": e.unavailable is None,
                "unavailable_reason": e.unavailable,
                "parameters_bytes": e.states.parameters,
                "gradients_bytes": e.states.gradients,
                "optimizer_bytes": e.states.optimizer,
                "model_state_bytes": e.states.total,
                "runtime_extra_bytes": e.runtime_extra,
                "runtime_extra_terms": dict(e.runtime_terms),
                "activation_bytes": used,
                "activation_bytes_without_checkpointing": e.activations.peak,
                "activation_bytes_with_checkpointing": e.activations.checkpointed_peak,
                "paper_activation_bytes": e.activations.paper,
                "paper_activation_bytes_with_recomputation": e.activations.paper_checkpointed,
                "activation_checkpointing": e.checkpointing,
                "offloaded_bytes_per_node": e.offloaded,
                "total_bytes": e.total,
                "fits": e.fits,
                "comm_volume_vs_ddp": e.comm_vs_ddp,
                "step_time_lower_bound_s": e.step_seconds,
                "pipeline": None
                if e.pipeline is None
                else {
                    "stages": e.pipeline.stages,
                    "schedule": e.candidate.option.pipeline_schedule,
                    "bubble_fraction": e.pipeline.bubble,
                    "pieces_held_by_first_stage": e.pipeline.pieces_held,
                    "blocks_per_rank": e.pipeline.layers,
                    "worst_rank": e.pipeline.rank,
                    "p2p_elements_per_micro_batch": e.pipeline.p2p_elements,
                },
            }
        )
    recommended = None
    if result.recommended is not None:
        best = result.recommended
        recommended = {
            "strategy": best.candidate.name,
            "recipe": library_recipe(best.candidate, inputs),
            "reason": result.reason,
            "activation_checkpointing": best.checkpointing,
            "micro_batch_size": result.micro_batch,
            "tensor_parallel_size": best.candidate.tensor_parallel,
            "expert_parallel_size": best.candidate.option.expert_parallel,
            "context_parallel_size": best.candidate.option.context_parallel,
        }
    longest = None
    if result.longest_context is not None:
        longest = {"sequence_length": result.longest_context[0], "strategy": result.longest_context[1]}
    return {
        "parameters": inputs.parameters,
        "trained_parameters": round(inputs.parameters * inputs.trained),  # fewer under adapters
        "world_size": inputs.world_size,
        "devices": inputs.devices,
        "num_nodes": inputs.num_nodes,
        "device": {"name": inputs.gpu.name, "memory_bytes": inputs.gpu.memory_bytes, "usable_bytes": inputs.budget},
        "precision": inputs.precision,
        "model": inputs.cost.describe(),
        "sizes_from": "rehearsal" if isinstance(inputs.cost, MeasuredCost) else "formulas",
        "micro_batch_size": inputs.micro_batch,
        "options": options,
        "recommended": recommended,
        "reason": result.reason,
        "longest_context": longest,
    }
