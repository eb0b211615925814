"""The in-process half of fsdp2/hsdp/tensor parallel (model_parallel.py): Fabric's ModelParallelStrategy,
the `parallelize_fn` it calls with the model and the device mesh, and gradient clipping across meshes.

The model brings its own facts (models/): `model.blocks`, the unit that is sharded, checkpointed and
compiled, `model.tensor_parallel_plan()`, how one block is split, and under expert parallelism each
mixture-of-experts layer's `parallelize_experts(mesh)`, how its experts are split by expert.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from lightning.fabric.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from ..precision import mixed_precision_policy
from ..recipe.schema import StrategyConfig
from ..tasks.base import init_parameters
from .base import prepare_blocks
from .pipeline import PipelineRank
from .pipeline_checks import ZERO_BUBBLE_SCHEDULES


class ModelParallel(ModelParallelStrategy):
    """Fabric's ModelParallelStrategy, clipping gradients that live on several device meshes (tensor parallel), and
    with `pipeline_parallel_size` > 1 on a (pipeline, data_parallel, tensor_parallel) mesh."""

    def __init__(
        self, *args: Any, pipeline_parallel_size: int = 1, context_parallel_size: int = 1, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.pipeline_parallel_size = pipeline_parallel_size
        self.context_parallel_size = context_parallel_size

    def setup_environment(self) -> None:
        if self.pipeline_parallel_size == 1 and self.context_parallel_size == 1:
            return super().setup_environment()
        super(ModelParallelStrategy, self).setup_environment()
        self._setup_distributed()
        # Pipeline outermost: a stage's data- and tensor-parallel ranks are neighbours (tensor parallel inside
        # a node), the stages cross the slower links, and the last rank holds the last stage. A context-parallel
        # group sits between data and tensor parallel (as torchtitan's dp_shard x cp): its ranks exchange keys and
        # values every layer, so they are neighbours too. "data_parallel" stays the ranks with their own samples
        # (Fabric's sampler reads it).
        dims = {
            "pipeline": self.pipeline_parallel_size,
            "data_parallel": int(self._data_parallel_size),
            "context_parallel": self.context_parallel_size,
            "tensor_parallel": int(self._tensor_parallel_size),
        }
        dims = {name: size for name, size in dims.items() if size > 1 or name in ("data_parallel", "tensor_parallel")}
        self._device_mesh = init_device_mesh(self.root_device.type, tuple(dims.values()), mesh_dim_names=tuple(dims))
        return None

    def load_checkpoint(
        self,
        path: Any,
        state: Any = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Fabric's load, with each optimizer's parameter groups matched to this rank's parameters.

        A sharded checkpoint stores the groups' parameter names once, as one rank listed them; under pipeline
        parallel every stage lists only its own, so the names saved are one stage's. The groups' settings are
        the same on every rank: they are loaded, and this rank's own names put in.
        """
        from lightning.fabric.strategies.model_parallel import _has_dtensor_modules, _is_sharded_checkpoint
        from torch.distributed.checkpoint import load as load_distributed
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        path = Path(self.broadcast(path))
        optimizers = {key: value for key, value in (state or {}).items() if isinstance(value, torch.optim.Optimizer)}
        if not optimizers or not _is_sharded_checkpoint(path):
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        others = {key: value for key, value in state.items() if key not in optimizers}
        remaining = super().load_checkpoint(path, others, strict=strict, weights_only=weights_only)
        state.update(others)
        module = next(value for value in others.values() if _has_dtensor_modules(value))
        for key, optimizer in optimizers.items():
            wanted: Any = get_optimizer_state_dict(module, optimizer)
            own = [group["params"] for group in wanted["param_groups"]]
            request = {key: wanted}
            load_distributed(request, checkpoint_id=path)
            for group, names in zip(request[key]["param_groups"], own, strict=True):
                group["params"] = names
            options = StateDictOptions(cpu_offload=True)
            set_optimizer_state_dict(module, optimizer, optim_state_dict=request[key], options=options)
        return remaining

    def clip_gradients_norm(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """Clip the global gradient norm over all meshes."""
        self.precision.unscale_gradients(optimizer)
        pipeline = self.device_mesh.get_group("pipeline") if self.pipeline_parallel_size > 1 else None
        return clip_grad_norm(self.precision.main_params(optimizer), max_norm, norm_type, error_if_nonfinite, pipeline)


def sharding_meshes(device_mesh: DeviceMesh, replicas: int) -> tuple[DeviceMesh, DeviceMesh]:
    """The (data-parallel, tensor-parallel) meshes: 1-D data parallel, or 2-D (replicate, shard) for hsdp with
    `replicas` replica groups (one per node, or under pipeline parallel one per node of the nodes a stage spans).

    Under context parallel, parameters are sharded, and gradients averaged, over the data x context ranks: every rank
    holds a shard; under hsdp over those of its node, replicated across the nodes."""
    names = device_mesh.mesh_dim_names or ()
    context = {"context_parallel": device_mesh["context_parallel"].size()} if "context_parallel" in names else {}
    if replicas == 1:
        if not context:
            return device_mesh["data_parallel"], device_mesh["tensor_parallel"]
        data_context = device_mesh["data_parallel", "context_parallel"]._flatten("data_context_parallel")
        return data_context, device_mesh["tensor_parallel"]
    # The device mesh's rank order (the pipeline outermost where there is one), with data_parallel split in two.
    dims = {
        **({"pipeline": device_mesh["pipeline"].size()} if "pipeline" in names else {}),
        "replicate": replicas,
        "shard": device_mesh["data_parallel"].size() // replicas,
        **context,
        "tensor_parallel": device_mesh["tensor_parallel"].size(),
    }
    mesh = init_device_mesh(device_mesh.device_type, tuple(dims.values()), mesh_dim_names=tuple(dims))
    if not context:
        return mesh["replicate", "shard"], mesh["tensor_parallel"]
    mesh["shard", "context_parallel"]._flatten("shard_context_parallel")
    return mesh["replicate", "shard_context_parallel"], mesh["tensor_parallel"]


def parallelize(
    model: Any,
    device_mesh: DeviceMesh,
    config: StrategyConfig,
    precision: str = "32-true",
    replicas: int = 1,
) -> Any:
    """Tensor parallel inside a node, then checkpointing/compile, then fully_shard per block and the root.

    With `replicas` > 1 (hsdp) a 2-D data-parallel mesh of one replica group per node makes fully_shard
    shard inside a node and replicate across nodes. Under bf16-mixed each block is gathered in bf16
    and computes in bf16 (`mixed_precision_policy`).
    """
    data_mesh, tensor_mesh = sharding_meshes(device_mesh, replicas)
    return shard_model(model, data_mesh, tensor_mesh, device_mesh.device_type, config, precision)


def shard_model(
    model: Any, data_mesh: DeviceMesh, tensor_mesh: DeviceMesh, device_type: str, config: StrategyConfig, precision: str
) -> Any:
    """`parallelize` on the meshes it chose: tensor parallel, checkpointing/compile, fully_shard, materialize."""
    if config.fsdp2 is not None and config.fsdp2.float8:
        convert_to_float8(model)
    if tensor_mesh.size() > 1:
        for block in model.blocks:
            parallelize_module(block, tensor_mesh, model.tensor_parallel_plan())
        for module in model.modules():  # a mixture of experts' tokens shared out over the tensor-parallel ranks
            if callable(parallelize_over_tensor := getattr(module, "parallelize_over_tensor", None)):
                parallelize_over_tensor(tensor_mesh)
    prepare_blocks(model, config)
    offload = config.fsdp2 is not None and config.fsdp2.cpu_offload
    policy = CPUOffloadPolicy() if offload else OffloadPolicy()  # OffloadPolicy(): fully_shard's default, none
    mixed = mixed_precision_policy(precision)
    # A zero-bubble schedule computes a block's weight gradients after its input gradients, from the weights its
    # forward gathered: resharded after forward, the block would find other tensors there. Its stage's blocks stay
    # gathered until the schedule's last backward (as torchtitan keeps them under any pipeline).
    options = config.fsdp2
    keep = (
        options is not None
        and options.pipeline_parallel_size > 1
        and options.pipeline_schedule in ZERO_BUBBLE_SCHEDULES
    )
    # Under tensor parallel a mixture of experts' experts are sharded over the tensor-parallel ranks too (each rank's
    # gradient holds its share of the tokens only: the reduce-scatter sums them), even at expert-parallel degree 1.
    if options is not None and (options.expert_parallel_size > 1 or tensor_mesh.size() > 1):
        sharding = dict(reshard_after_forward=not keep, offload_policy=policy, mp_policy=mixed)
        degree, stages = options.expert_parallel_size, options.pipeline_parallel_size
        shard_experts(model, data_mesh, degree, stages, tensor_mesh.size(), **sharding)
    for block in model.blocks:
        fully_shard(block, mesh=data_mesh, reshard_after_forward=not keep, offload_policy=policy, mp_policy=mixed)
    # The root is gathered for the whole step anyway; keeping it unsharded after forward saves
    # one all-gather per step (as torchtitan does).
    fully_shard(model, mesh=data_mesh, reshard_after_forward=False, offload_policy=policy, mp_policy=mixed)
    if config.meta_init:
        materialize(model, "cpu" if offload else device_type)  # offloaded shards live in host memory
    return model


def shard_experts(
    model: Any, data_mesh: DeviceMesh, degree: int, stages: int = 1, tensor: int = 1, **sharding: Any
) -> None:
    """Expert parallelism over the data-parallel ranks as (replicate, expert_shard, expert): each group of `degree`
    neighbouring ranks splits every mixture-of-experts layer's experts by expert (the layer's `parallelize_experts`),
    and the ranks holding the same experts shard them further with fully_shard (torchtitan's dp_shard_in_ep). Under
    hsdp (`data_mesh` 2-D, (replicate, shard)) the groups lie inside a replica group, a node, so the all-to-alls stay
    on its links, and the experts are replicated across the replica groups as every other parameter (fully_shard on
    (replicate, expert_shard)). Under a pipeline of `stages` (the mesh's outermost dimension) each stage's ranks do
    the same for the stage's layers. Under tensor parallel over `tensor` ranks (the innermost dimension), which share
    out the tokens of the routed experts (token_split.py), those ranks count as data-parallel ones here: the groups
    are taken from the data x tensor-parallel ranks, a tensor-parallel group's ranks first. The blocks' fully_shard
    then leaves the experts to theirs."""
    layers = [module for module in model.modules() if callable(getattr(module, "parallelize_experts", None))]
    if not layers:
        return
    ranks = data_mesh.size() * tensor
    replicas = data_mesh.size(0) if data_mesh.ndim == 2 else 1
    dims = {"pipeline": stages, "replicate": replicas, "expert_shard": ranks // replicas // degree, "expert": degree}
    mesh = init_device_mesh(data_mesh.device_type, tuple(dims.values()), mesh_dim_names=tuple(dims))
    holders = mesh["replicate", "expert_shard"] if replicas > 1 else mesh["expert_shard"]
    for layer in layers:
        experts = fully_shard(layer.parallelize_experts(mesh["expert"]), mesh=holders, **sharding)
        # A local expert's gradient already sums its group's tokens (the all-to-all brought them): summed over
        # the ranks holding the same experts and divided by all the data-parallel ranks, it is the mean
        # fully_shard makes of the other parameters' gradients. A reduce-scatter over several ranks sums, then
        # divides (NCCL's PREMUL_SUM, the default for a divide factor, is not in gloo); with none to shard with
        # (expert_shard of 1) fully_shard divides as it copies, and a forced sum would divide a second time.
        experts.set_gradient_divide_factor(float(data_mesh.size()))  # a token's rows on one tensor rank
        experts.set_force_sum_reduction_for_comms(dims["expert_shard"] > 1)


def materialize(model: Any, device_type: str) -> None:
    """Allocate a meta-device model's local shards and initialise them with the model's own init."""
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    model.to_empty(device=device)
    # The model's own init (its init_parameter) rather than Fabric's per-layer defaults; each rank fills its shards.
    with torch.no_grad():
        init_parameters(model)


def convert_to_float8(model: nn.Module) -> None:
    """Swap the blocks' linear layers for torchao's float8 training layers (the head stays in high precision)."""
    from torchao.float8 import convert_to_float8_training  # GPU-only extra: imported only when asked for

    def in_blocks(module: nn.Module, name: str) -> bool:
        return name.startswith("blocks.") and isinstance(module, nn.Linear)

    convert_to_float8_training(model, module_filter_fn=in_blocks)


def clip_grad_norm(
    parameters: Iterable[nn.Parameter],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = True,
    pipeline: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """torch's clip_grad_norm_ for parameters spread over several device meshes; returns the total norm.

    Under tensor parallel the blocks' split layers live on the 2-D (data, tensor) mesh and the
    other parameters on the 1-D data mesh, and torch's version cannot combine norms across meshes.
    Under pipeline parallel each stage holds only its own parameters: their norms are combined over
    the `pipeline` group, so every stage clips by the whole model's norm.
    """
    by_mesh: dict[DeviceMesh | None, list[nn.Parameter]] = {}
    for param in parameters:
        if param.grad is not None:
            by_mesh.setdefault(param.grad.device_mesh if isinstance(param.grad, DTensor) else None, []).append(param)
    norms = []
    for params in by_mesh.values():
        grads = [cast(torch.Tensor, p.grad) for p in params]  # every one is set: grouped above
        norm = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.zeros(())
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    if pipeline is not None:
        if norm_type == float("inf"):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pipeline)
        else:
            total = total.pow(norm_type)
            dist.all_reduce(total, group=pipeline)
            total = total.pow(1.0 / norm_type)
    for params in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def parallelize_pipeline(
    model: PipelineRank,
    device_mesh: DeviceMesh,
    config: StrategyConfig,
    precision: str = "32-true",
    replicas: int = 1,
) -> PipelineRank:
    """Each stage a rank holds parallelized as a model of its own (tensor parallel, checkpointing, fully_shard over
    the stage's data-parallel ranks, replicated `replicas` times under hsdp), then gathered again under the rank's
    module."""
    data_mesh, tensor_mesh = sharding_meshes(device_mesh, replicas)
    for stage in model.stages:
        shard_model(stage, data_mesh, tensor_mesh, device_mesh.device_type, config, precision)
    model.gather()
    return model
