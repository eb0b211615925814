"""How the GPT is spread over devices: its tensor-parallel plan, FSDP2/HSDP sharding per block,
activation checkpointing and torch.compile per block, float8 linear layers, meta-device materialisation.

`parallelize` is the `parallelize_fn` Fabric's ModelParallelStrategy calls with the model and the
device mesh (fsdp2, hsdp); `prepare_blocks` is what the other strategies apply before they wrap the
model. Both live next to the model they shard, not in the training loop.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from {{ cookiecutter.package_name }}.model import GPT
from {{ cookiecutter.package_name }}.strategy_config import StrategyConfig


def tensor_parallel_plan() -> dict[str, ParallelStyle]:
    """The tensor-parallel plan of one block: q/k/v and fc split by columns (heads, hidden units),
    both output projections by rows, so each block needs one all-reduce in attention and one in the MLP."""
    return {
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(),
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(),
    }


def prepare_blocks(model: GPT, config: StrategyConfig) -> GPT:
    """Activation checkpointing (every k-th block) and torch.compile per block, in place."""
    for index, block in enumerate(model.blocks):
        if config.activation_checkpointing and index % config.activation_checkpointing_every == 0:
            # The wrapper's state-dict hooks drop its name, so checkpoints load with it on or off.
            block = checkpoint_wrapper(block)
        if config.compile:
            block.compile()  # in place: parameter names, and so checkpoints, stay the same
        model.blocks[index] = block
    return model


def sharding_meshes(device_mesh: DeviceMesh, config: StrategyConfig, num_nodes: int) -> tuple[DeviceMesh, DeviceMesh]:
    """The (data-parallel, tensor-parallel) meshes: 1-D data parallel for fsdp2, 2-D (replicate, shard) for hsdp."""
    if config.name != "hsdp":
        return device_mesh["data_parallel"], device_mesh["tensor_parallel"]
    data_parallel, tensor_parallel = device_mesh["data_parallel"].size(), device_mesh["tensor_parallel"].size()
    # Same rank order as Fabric's (data_parallel, tensor_parallel) mesh, with data_parallel split in two.
    mesh = init_device_mesh(
        device_mesh.device_type,
        (num_nodes, data_parallel // num_nodes, tensor_parallel),
        mesh_dim_names=("replicate", "shard", "tensor_parallel"),
    )
    return mesh["replicate", "shard"], mesh["tensor_parallel"]


def parallelize(model: GPT, device_mesh: DeviceMesh, config: StrategyConfig, num_nodes: int = 1) -> GPT:
    """Tensor parallel inside a node, then checkpointing/compile, then fully_shard per block and the root.

    A 2-D data-parallel mesh (hsdp) makes fully_shard shard inside a node and replicate across nodes.
    """
    data_mesh, tensor_mesh = sharding_meshes(device_mesh, config, num_nodes)
    if config.float8:
        convert_to_float8(model)
    if tensor_mesh.size() > 1:
        for block in model.blocks:
            parallelize_module(block, tensor_mesh, tensor_parallel_plan())
    prepare_blocks(model, config)
    for block in model.blocks:
        fully_shard(block, mesh=data_mesh)
    # The root is gathered for the whole step anyway; keeping it unsharded after forward saves
    # one all-gather per step (as torchtitan does).
    fully_shard(model, mesh=data_mesh, reshard_after_forward=False)
    if config.meta_init:
        materialize(model, device_mesh.device_type)
    return model


def materialize(model: GPT, device_type: str) -> None:
    """Allocate a meta-device model's local shards and initialise them with the model's own init."""
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    model.to_empty(device=device)
    # GPT.reset_parameters (GPT-2 init) rather than Fabric's per-layer defaults; each rank fills its shards.
    with torch.no_grad():
        model.reset_parameters()


def init_zero3_partitioned(model: GPT) -> None:
    """GPT-2 init of a model built under DeepSpeed ZeRO-3's `deepspeed.zero.Init`, one parameter gathered at a time.

    zero.Init partitions each layer's parameters as soon as the layer is built, so the init at the end of
    GPT's constructor only sees empty placeholders. Each parameter is gathered whole, initialised, and
    partitioned again (rank 0's values are kept); every rank draws the same numbers, so the random
    streams stay equal on all ranks and the weights equal an unsharded build's with the same seed.
    """
    import deepspeed  # GPU-strategy extra: imported only for deepspeed recipes

    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0), torch.no_grad():
            model.init_parameter(name, param)


def convert_to_float8(model: GPT) -> None:
    """Swap the blocks' linear layers for torchao's float8 training layers (the head stays in high precision)."""
    from torchao.float8 import convert_to_float8_training  # GPU-only extra: imported only when asked for

    def in_blocks(module: nn.Module, name: str) -> bool:
        return name.startswith("blocks.") and isinstance(module, nn.Linear)

    convert_to_float8_training(model, module_filter_fn=in_blocks)


def clip_grad_norm(
    parameters: Iterable[nn.Parameter], max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = True
) -> torch.Tensor:
    """torch's clip_grad_norm_ for parameters spread over several device meshes; returns the total norm.

    Under tensor parallel the blocks' split layers live on the 2-D (data, tensor) mesh and the
    other parameters on the 1-D data mesh, and torch's version cannot combine norms across meshes.
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
    for params in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def local_training_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this process holds (its local shards)."""

    def size(tensor: torch.Tensor) -> int:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        return local.numel() * local.element_size()

    params = list(model.parameters())
    state = [value for values in optimizer.state.values() for value in values.values() if torch.is_tensor(value)]
    return {
        "parameters": sum(size(p) for p in params),
        "gradients": sum(size(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(size(value) for value in state),
    }
