"""A mixture of experts under tensor parallel: the tensor-parallel ranks share out its tokens.

Tensor parallel splits attention by heads and a dense MLP by hidden units; a block's input and output are the same
on every rank of a tensor-parallel group. The routed experts are not split that way (the shared experts are: the
model's tensor-parallel plan). Instead each rank of the group computes the routed experts of its own share of the
tokens (a contiguous range, `token_share`), so every routed row is computed once in the group, and under expert
parallelism the group's ranks hold different experts (they are ranks of the expert mesh like data-parallel ones:
Megatron's expert tensor parallel of 1, torchtitan's expert parallel borrowing the tensor-parallel ranks).

The router runs on every token on every rank (a matmul n_embd x num_experts, replicated like the norms), so which
pairs are kept and the auxiliary loss are those of the whole micro-batch. The collectives are those a dense MLP's
tensor parallel makes, one all-reduce each way: the rank's part of the output (zero outside its tokens) is summed
over the group in forward (`sum_over`), and the gradients of the routed rows' input and of their routing weights
(zero outside its tokens) are summed in backward (`gradient_summed_over`), so every rank holds the whole gradient of
the block's input and of the router, as without tensor parallel. Each token's sum has one nonzero term: the results
equal those without tensor parallel.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def token_share(tokens: int, group: dist.ProcessGroup) -> tuple[int, int]:
    """The tokens this rank of `group` computes the routed experts of: lo to hi - 1, an even contiguous share."""
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    return tokens * rank // ranks, tokens * (rank + 1) // ranks


class _SumOver(torch.autograd.Function):
    """Forward: the sum over the group; backward: the gradient as it is (it is the same on every rank)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        summed = x.clone()
        dist.all_reduce(summed, group=group)
        return summed

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GradientSummedOver(torch.autograd.Function):
    """Forward: the tensor as it is; backward: the gradient summed over the group (each rank holds a part)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        summed = grad.contiguous().clone()
        dist.all_reduce(summed, group=ctx.group)
        return summed, None


def sum_over(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`x` summed over the ranks of `group`; its gradient passes through unchanged."""
    return _SumOver.apply(x, group)


def gradient_summed_over(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`x` unchanged; in backward, its gradient summed over the ranks of `group`."""
    return _GradientSummedOver.apply(x, group)
