"""The rules strategy.fsdp2.expert_parallel_size must follow; no torch.

Expert parallelism splits each mixture-of-experts layer's experts over groups of data-parallel ranks (fully_shard.py
builds the mesh): the degree divides the data-parallel ranks (with context parallel, the data x context ranks; under
hsdp those of a replica group, a node: the all-to-alls stay inside it; under a pipeline those of a stage) and the
experts, and composes with fsdp2's and hsdp's sharding, context parallel, tensor parallel (whose ranks share out
the tokens, so they count here as data-parallel ones) and the pipeline.
Checked before any process starts, each refusal one line naming the field and what is allowed.
"""

from __future__ import annotations

from typing import Any

from ..errors import RecipeError
from ..recipe.schema import Fsdp2Options, field_path
from .base import divisors


def common_divisors(*numbers: int) -> str:
    """'1, 2 or 4': the values that divide every one of `numbers`, for error messages."""
    values = [str(d) for d in range(1, min(numbers) + 1) if all(n % d == 0 for n in numbers)]
    return values[0] if len(values) == 1 else f"{', '.join(values[:-1])} or {values[-1]}"


def check_expert_parallel(strategy: Any) -> None:
    """Refuse an expert-parallel degree the model or the mesh cannot hold (`strategy`: an FSDP2)."""
    options: Fsdp2Options = strategy.options
    size = options.expert_parallel_size
    field = f"{field_path(Fsdp2Options, 'expert_parallel_size')}={size}"
    dimensions: dict[str, int] = strategy.task.expert_parallel_dimensions()
    if not dimensions:
        raise RecipeError(f"{field}: task={strategy.recipe.task}'s model has no experts to split (set it to 1)")
    # Under context parallel the ranks of a group hold different tokens of the same samples, and under tensor
    # parallel a group's ranks share out the routed experts' tokens (token_split.py): the experts are split over the
    # data x context x tensor-parallel ranks, the groups' tokens among them.
    # Under a pipeline, each stage's ranks split its layers' experts.
    tensor = options.tensor_parallel_size
    data_parallel = strategy.data_parallel_size() * options.context_parallel_size * tensor
    stages = strategy.pipeline_parallel_size
    world = "devices x num_nodes" + (f" / {stages} pipeline stages" if stages > 1 else "")
    kinds = ["data", *(["context"] if options.context_parallel_size > 1 else []), *(["tensor"] if tensor > 1 else [])]
    ranks = f"{' x '.join(kinds)}-parallel ranks ({world}"
    if strategy.hybrid:  # the experts are split inside a replica group, a node
        data_parallel //= strategy.recipe.num_nodes // stages
        ranks = f"ranks of a node (strategy.name={strategy.name} replicates the experts across nodes"
    if data_parallel % size:
        raise RecipeError(f"{field} does not divide the {data_parallel} {ranks}; choose {divisors(data_parallel)})")
    for key, value in dimensions.items():
        if value % size:
            raise RecipeError(
                f"{field} does not divide {key}={value} (each rank holds an equal share of the experts: choose"
                f" {common_divisors(value, data_parallel)})"
            )
