"""Grouped GEMM against a loop over experts: tokens per second through one MoE layer's experts, forward and backward.

    python benchmarks/moe.py --json moe.json           # 1 thread; --quick: tiny sizes

The project's `Experts` (families/llama/moe.py) on the rows a router sent them, sorted by expert: fine-grained
experts as in the 30B-A3B recipes (many narrow SwiGLU experts, each token to several), scaled down to a CPU. The
router is skewed as early in training (a few experts take most rows), with the same counts and rows for both
ways: `torch._grouped_mm` (one matmul per weight for all experts, the project's default where it runs) against one
expert at a time (its fallback, which also reads the counts on the host). Both give the same result
(tests/tasks/language_model/test_moe.py). Alternating repeats, each after two warm-up passes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from {{ cookiecutter.package_name }}.tasks.language_model.families.llama.moe import Experts, grouped_mm_runs

WAYS = {"grouped": True, "loop": False}


def skewed_counts(rows: int, num_experts: int, generator: torch.Generator) -> torch.Tensor:
    """Rows per expert drawn from a router whose preference falls off geometrically (the first expert takes most)."""
    preference = 0.8 ** torch.arange(num_experts, dtype=torch.float64)
    chosen = torch.multinomial(preference / preference.sum(), rows, replacement=True, generator=generator)
    return torch.bincount(chosen, minlength=num_experts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="File to write the figures to.")
    parser.add_argument("--experts", type=int, default=32, help="Routed experts.")
    parser.add_argument("--top_k", type=int, default=4, help="Experts per token.")
    parser.add_argument("--width", type=int, default=256, help="Model width (n_embd).")
    parser.add_argument("--hidden", type=int, default=128, help="Each expert's SwiGLU hidden width.")
    parser.add_argument("--tokens", type=int, default=2048, help="Tokens per pass (micro-batch x sequence).")
    parser.add_argument("--passes", type=int, default=10, help="Timed forward+backward passes per repeat.")
    parser.add_argument("--repeats", type=int, default=3, help="Alternating repeats.")
    parser.add_argument("--quick", action="store_true", help="Tiny sizes: a run, not a measurement.")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.passes, args.repeats = 128, 2, 1

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    experts = Experts(args.experts, args.width, args.hidden)
    for weight in experts.parameters():
        torch.nn.init.normal_(weight, std=args.width**-0.5)
    rows = args.tokens * args.top_k
    counts = skewed_counts(rows, args.experts, generator)
    x = torch.randn(rows, args.width, generator=generator, requires_grad=True)
    if not grouped_mm_runs(x, experts.gate, experts.up, experts.down):
        sys.exit("error: torch._grouped_mm does not run here (torch too old, or rows not 16-byte aligned)")

    def passes(grouped: bool, count: int) -> float:
        experts.use_grouped_mm = grouped
        start = time.perf_counter()
        for _ in range(count):
            experts(x, counts).square().mean().backward()
        return time.perf_counter() - start

    tokens_per_second: dict[str, list[float]] = {way: [] for way in WAYS}
    for repeat in range(args.repeats):
        for way, grouped in WAYS.items():
            passes(grouped, 2)  # warm-up
            tokens_per_second[way].append(args.tokens * args.passes / passes(grouped, args.passes))
        ratio = tokens_per_second["grouped"][-1] / tokens_per_second["loop"][-1]
        print(f"  repeat {repeat + 1}/{args.repeats}: grouped / loop tokens/s {ratio:.2f}", file=sys.stderr)
    result = {
        "tokens_per_second": tokens_per_second,
        "median_tokens_per_second": {way: statistics.median(values) for way, values in tokens_per_second.items()},
        "shape": {
            "experts": args.experts,
            "top_k": args.top_k,
            "width": args.width,
            "hidden": args.hidden,
            "tokens": args.tokens,
            "largest_expert_share": float(counts.max()) / rows,
        },
    }
    Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
