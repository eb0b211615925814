"""How the GPT is sharded: FSDP2 (`fully_shard`) per transformer block, then the root.

This is the `parallelize_fn` Fabric's ModelParallelStrategy calls with the model and the device
mesh; it lives next to the model it shards, not in the training loop.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from {{ cookiecutter.package_name }}.config import StrategyConfig
from {{ cookiecutter.package_name }}.model import GPT


def parallelize(model: GPT, device_mesh: DeviceMesh, config: StrategyConfig) -> GPT:
    """Shard each block over the data-parallel mesh dimension, then the embeddings and head."""
    data_parallel_mesh = device_mesh["data_parallel"]
    for block in model.blocks:
        fully_shard(block, mesh=data_parallel_mesh)
    # The root is gathered for the whole step anyway; keeping it unsharded after forward saves
    # one all-gather per step (as torchtitan does).
    fully_shard(model, mesh=data_parallel_mesh, reshard_after_forward=False)
    return model
