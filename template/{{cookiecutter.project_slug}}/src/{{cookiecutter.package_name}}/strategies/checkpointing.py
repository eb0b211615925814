"""Activation checkpointing of one block: full (keep only its input, recompute everything in backward) or
selective per operation (torchtitan's `op` policy: keep the outputs of the expensive operations, recompute the
cheap ones).

Selective keeps every attention output, every collective's output (a recomputed collective would cost
communication again) and every other matrix multiply's output: in backward only the norms, activations,
additions and half of the matmuls run again. It sits between full checkpointing (the least memory, about a
third more compute) and none (the most memory): benchmarks/run.py measures the three side by side.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

# Matrix multiplies as autograd dispatches them (a Linear with a bias is addmm, a batched one bmm).
MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
ATTENTION = {
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}
COLLECTIVES = {
    torch.ops._c10d_functional.all_reduce.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_gather_into_tensor.default,
}
# Kept as torchtitan keeps them: a whole-tensor max is float8 training's scale (amax), cheap to keep.
OTHERS_KEPT = {torch.ops.aten.max.default}


def checkpoint_block(block: Any, policy: str) -> Any:
    """`block` wrapped to recompute its activations in backward: all of them (full) or the cheap ones (selective)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    # The wrapper's state-dict hooks drop its name, so checkpoints load with it on or off.
    if policy == "full":
        return checkpoint_wrapper(block)
    return checkpoint_wrapper(block, context_fn=selective_contexts)


def selective_contexts() -> tuple[Any, Any]:
    """The forward and recompute contexts of one checkpointed call under the selective policy."""
    matmuls_seen: dict[bool, int] = defaultdict(int)  # counted apart in forward and in recompute

    def policy(context: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in MATMULS:
            matmuls_seen[context.is_recompute] += 1
            # Every other one: the same matmuls in forward and in recompute, since both count from the first.
            keep = matmuls_seen[context.is_recompute] % 2 == 1
        else:
            keep = op in ATTENTION or op in COLLECTIVES or op in OTHERS_KEPT
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)
