"""A mixture-of-experts feed-forward (model.moe): a router, routed SwiGLU experts as stacked weights, shared experts.

Each token's router scores pick top_k of the experts (`route`); `dispatch` sorts the chosen (token, expert) pairs by
expert, dropping those past an expert's capacity; the experts run over their contiguous rows at once
(`torch._grouped_mm`, or a loop over experts where it cannot run); `combine` puts each result back, weighted by its
score. The experts' weights are 3-D, [expert, out, in], so one dimension splits them over ranks; `dispatch` and
`combine` are the one place tokens move between experts. Under expert parallelism (`parallelize_experts`) each rank
holds num_experts / ep of the experts and `exchange` runs them: each rank's dispatched rows go by all-to-all to the
ranks holding their experts and come back the same way, in the order `combine` expects. Capacity is counted per
rank, over its own tokens, as without expert parallelism, so the same pairs are dropped whatever the degree.

Each forward records its figures (the experts' loads, dropped pairs, the balance loss, the router's entropy) on
the layer; the model folds them into the step's (model.py: `auxiliary_loss`, `end_step`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from ...config import ModelConfig, MoeConfig
from .token_split import gradient_summed_over, sum_over, token_share


@dataclass
class Routing:
    """Each token's experts and their weights, and the router's distribution over all experts."""

    experts: torch.Tensor  # (tokens, top_k) expert indices
    weights: torch.Tensor  # (tokens, top_k) the weights their outputs are summed with (fp32)
    probabilities: torch.Tensor  # (tokens, num_experts) the scores as a distribution (softmax, or sigmoid normalised)


def route(logits: torch.Tensor, config: MoeConfig, bias: torch.Tensor | None = None) -> Routing:
    """Top-k routing of router logits (tokens, num_experts), in fp32. `bias` (load_balance=bias) shifts the scores
    for the choice of experts only: the weights are the unbiased scores (DeepSeek-V3)."""
    logits = logits.float()
    scores = logits.softmax(dim=-1) if config.gate == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias
    experts = choice.topk(config.top_k, dim=-1).indices
    weights = scores.gather(-1, experts)
    if config.normalize_top_k:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=1e-20)
    probabilities = scores if config.gate == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
    return Routing(experts, weights, probabilities)


@dataclass
class Dispatched:
    """The (token, expert) pairs that an expert computes, sorted by expert."""

    rows: torch.Tensor  # (kept pairs, n_embd) each pair's token's input
    weights: torch.Tensor  # (kept pairs,) its routing weight
    pairs: torch.Tensor  # (kept pairs,) its index among the tokens x top_k pairs: where `combine` puts it back
    counts: torch.Tensor  # (num_experts,) rows per expert, in order
    dropped: torch.Tensor  # pairs past their expert's capacity (a scalar)


def capacity(tokens: int, config: MoeConfig) -> int | None:
    """Pairs one expert takes per micro-batch (capacity_factor x an even share), or None when dropless."""
    if config.capacity_factor is None:
        return None
    return math.ceil(config.capacity_factor * tokens * config.top_k / config.num_experts)


def expert_counts(chosen: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Pairs routed to each expert: (num_experts,) int64. A scatter-add rather than bincount, whose output's length
    depends on the values (so a rehearsal's fake tensors could not carry it); integer adds, so deterministic."""
    return chosen.new_zeros(num_experts, dtype=torch.int64).scatter_add_(
        0, chosen, torch.ones_like(chosen, dtype=torch.int64)
    )


def host_counts(counts: torch.Tensor, total: int) -> list[int]:
    """`counts` read on the host. In a rehearsal (training/rehearsal.py: fake tensors, which carry no values) or on
    the meta device (where a pipeline's stage shapes are worked out) `total` split evenly instead: the balanced
    routing load balancing aims at, so a rehearsal measures a balanced step."""
    if not is_fake(counts) and counts.device.type != "meta":
        return counts.tolist()
    share, extra = divmod(total, counts.numel())
    return [share + (part < extra) for part in range(counts.numel())]


def dispatch(
    x: torch.Tensor, routing: Routing, num_experts: int, limit: int | None, share: tuple[int, int] | None = None
) -> Dispatched:
    """Sort the (token, expert) pairs by expert (stably: within an expert, in token order) and keep the first `limit`
    of each expert (all when None). x: (tokens, n_embd). With `share` (tokens lo to hi - 1, this tensor-parallel
    rank's), only the kept pairs of those tokens: which pairs are kept is decided over all the tokens, so the same
    pairs are dropped as without tensor parallel; `dropped` counts all the tokens' too."""
    chosen = routing.experts.reshape(-1)
    order = torch.argsort(chosen, stable=True)
    counts = expert_counts(chosen, num_experts)
    dropped = counts.new_zeros(())
    if limit is not None:
        starts = counts.cumsum(0) - counts
        place = torch.arange(order.numel(), device=order.device) - starts[chosen[order]]
        # Which pairs fit is in the values; a rehearsal's balanced routing keeps an even share of each expert's.
        order = (
            order[: num_experts * min(limit, -(-order.numel() // num_experts))]
            if is_fake(order)
            else order[place < limit]
        )
        kept = counts.clamp(max=limit)
        dropped = (counts - kept).sum()
        counts = kept
    top_k = routing.experts.shape[1]
    if share is not None:
        order = own_pairs(order, share, routing.experts.shape[0], top_k)
        counts = expert_counts(chosen[order], num_experts)
    return Dispatched(x[order // top_k], routing.weights.reshape(-1)[order], order, counts, dropped)


def own_pairs(order: torch.Tensor, share: tuple[int, int], tokens: int, top_k: int) -> torch.Tensor:
    """The pairs of `order` whose tokens are those of `share` (lo to hi - 1 of `tokens`), in the same order. In a
    rehearsal's balanced routing (fake tensors carry no values), the share's fraction of them."""
    lo, hi = share
    if is_fake(order):
        return order[order.numel() * lo // tokens : order.numel() * hi // tokens]
    token = order // top_k
    return order[(token >= lo) & (token < hi)]


def combine(outputs: torch.Tensor, sent: Dispatched, tokens: int, top_k: int) -> torch.Tensor:
    """Each token's weighted sum of its experts' outputs (a dropped pair adds nothing): (tokens, n_embd). Written
    into the pairs' places, then summed over top_k: deterministic, unlike an index_add."""
    weighted = outputs * sent.weights.to(outputs.dtype).unsqueeze(-1)
    placed = weighted.new_zeros(tokens * top_k, outputs.shape[-1])
    placed[sent.pairs] = weighted
    return placed.view(tokens, top_k, -1).sum(dim=1)


def grouped_mm_runs(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether torch._grouped_mm computes these: it wants rows 16-byte aligned, and on CUDA bf16 on sm90 or newer."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    aligned = all(size * x.element_size() % 16 == 0 for w in weights for size in w.shape[1:])
    if x.device.type == "cuda":
        return aligned and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= 9
    # A rehearsal's fake tensors take the kernel's GPU rule (bf16 only) on any device.
    return (
        aligned
        and x.device.type == "cpu"
        and x.dtype in ((torch.bfloat16,) if is_fake(x) else (torch.float32, torch.bfloat16))
    )


def grouped_experts(
    x: torch.Tensor, counts: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """SwiGLU of each expert over its rows, all experts in one grouped matmul each (weights [expert, out, in])."""
    ends = counts.cumsum(0).to(torch.int32)
    hidden = F.silu(torch._grouped_mm(x, gate.transpose(-2, -1), offs=ends))
    hidden = hidden * torch._grouped_mm(x, up.transpose(-2, -1), offs=ends)
    return torch._grouped_mm(hidden, down.transpose(-2, -1), offs=ends)


def looped_experts(
    x: torch.Tensor, counts: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """The same as `grouped_experts`, one expert at a time (reads the counts on the host)."""
    outputs = []
    for expert, rows in enumerate(x.split(host_counts(counts, x.shape[0]))):
        hidden = F.silu(rows @ gate[expert].T) * (rows @ up[expert].T)
        outputs.append(hidden @ down[expert].T)
    return torch.cat(outputs)


class Experts(nn.Module):
    """num_experts SwiGLU experts as three stacked weights: gate and up [expert, hidden, n_embd], down [expert, n_embd,
    hidden] (each expert's slice is an nn.Linear weight)."""

    def __init__(self, num_experts: int, width: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.empty(num_experts, hidden, width))
        self.up = nn.Parameter(torch.empty(num_experts, hidden, width))
        self.down = nn.Parameter(torch.empty(num_experts, width, hidden))
        self.use_grouped_mm = True  # False: always the loop (tests compare the two)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # Under autocast the matmuls run in its dtype, as a Linear would; _grouped_mm takes one dtype throughout. (No
        # autocast on the meta device, where a pipeline's stage shapes are worked out.)
        device = x.device.type
        autocast = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
        dtype = torch.get_autocast_dtype(device) if autocast else x.dtype
        # Under expert parallelism the weights are DTensors sharded by expert: this rank computes its own experts.
        held = [w.to_local() if isinstance(w, DTensor) else w for w in (self.gate, self.up, self.down)]
        x, weights = x.to(dtype), [w.to(dtype) for w in held]
        # A rank may receive no rows at all under expert parallelism: _grouped_mm refuses empty inputs, the loop not.
        if self.use_grouped_mm and x.shape[0] and grouped_mm_runs(x, *weights):
            return grouped_experts(x, counts, *weights)
        return looped_experts(x, counts, *weights)


def expert_order(received: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows received by all-to-all arrive by source rank, then local expert (`received`: (ranks, local experts)
    counts, `rows` of them in all): the permutation that sorts them by local expert, then source rank, and the rows
    per local expert."""
    ranks, local = received.shape
    segments = torch.arange(ranks * local, device=received.device)
    segment = segments.repeat_interleave(received.reshape(-1), output_size=rows)
    expert_major = (segment % local) * ranks + segment // local
    return torch.argsort(expert_major, stable=True), received.sum(dim=0)


def exchange(experts: Experts, sent: Dispatched, group: dist.ProcessGroup) -> torch.Tensor:
    """The outputs of `sent`'s rows (sorted by global expert), computed by the ranks of `group` that hold their
    experts (rank r: experts r x local to (r + 1) x local - 1), in `sent`'s order. The rows' counts are exchanged
    first (the split sizes); the rows and outputs move by all-to-all with autograd, so each expert's gradient comes
    from every rank's tokens."""
    send = sent.counts.view(dist.get_world_size(group), -1)  # (destination rank, its local expert)
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)  # (source rank, my local expert)
    # A rehearsal's balanced routing: each rank sends and receives an even share of its rows.
    send_splits = host_counts(send.sum(dim=1), sent.rows.shape[0])
    receive_splits = host_counts(received.sum(dim=1), sent.rows.shape[0])
    rows = all_to_all_single_autograd(sent.rows, receive_splits, send_splits, group)
    order, counts = expert_order(received, rows.shape[0])
    outputs = experts(rows[order], counts)[torch.argsort(order)]
    return all_to_all_single_autograd(outputs, send_splits, receive_splits, group)


@dataclass
class Record:
    """What one forward of an MoE layer saw (for the step's figures and the auxiliary loss)."""

    loads: torch.Tensor  # (num_experts,) pairs routed to each expert, before capacity
    dropped: torch.Tensor  # pairs dropped past capacity
    balance_loss: torch.Tensor  # num_experts x sum_i f_i P_i (in the graph: the auxiliary loss's term)
    entropy: torch.Tensor  # the router's mean entropy per token, in nats


def balance_loss(routing: Routing, loads: torch.Tensor) -> torch.Tensor:
    """num_experts x sum_i f_i P_i: f_i the share of the pairs routed to expert i, P_i its mean probability;
    1.0 when both are uniform, up to num_experts when one expert takes everything."""
    shares = loads.float() / loads.sum().clamp(min=1)
    return routing.probabilities.shape[-1] * (shares * routing.probabilities.mean(dim=0)).sum()


class MoE(nn.Module):
    """The mixture-of-experts MLP of one block: routed experts, plus the shared experts every token passes through."""

    def __init__(self, config: ModelConfig, shared: nn.Module | None) -> None:
        super().__init__()
        self.config: MoeConfig = config.moe
        self.router = nn.Linear(config.n_embd, self.config.num_experts, bias=False)
        self.experts = Experts(self.config.num_experts, config.n_embd, config.expert_hidden_size)
        self.shared: nn.Module | None = shared
        # The bias of load_balance=bias is state (saved and resumed) but no parameter: no gradient moves it.
        bias = torch.zeros(self.config.num_experts) if self.config.load_balance == "bias" else None
        self.expert_bias: torch.Tensor | None
        self.register_buffer("expert_bias", bias, persistent=True)
        self.record: Record | None = None
        self.expert_group: dist.ProcessGroup | None = None  # the expert-parallel ranks (parallelize_experts)
        self.token_group: dist.ProcessGroup | None = None  # the tensor-parallel ranks (parallelize_over_tensor)

    def parallelize_experts(self, mesh: DeviceMesh) -> nn.Module:
        """Expert parallelism over the 1-D `mesh`: each rank keeps num_experts / mesh.size() experts, its slice of
        DTensors sharded on the expert dimension (so a checkpoint names every expert globally, whatever the degree);
        tokens reach them by all-to-all. The experts module, for the strategy to shard further."""
        for name, param in list(self.experts.named_parameters(recurse=False)):
            # src_data_rank=None: every rank built the same weights (or none, on the meta device): no scatter.
            local = distribute_tensor(param.data, mesh, [Shard(0)], src_data_rank=None)
            self.experts.register_parameter(name, nn.Parameter(local, requires_grad=param.requires_grad))
        self.expert_group = mesh.get_group() if mesh.size() > 1 else None  # 1: tensor parallel's sharding only
        return self.experts

    def parallelize_over_tensor(self, mesh: DeviceMesh) -> None:
        """Under tensor parallel over the 1-D `mesh`: each of its ranks computes the routed experts of its share of
        the tokens (token_split.py)."""
        self.token_group = mesh.get_group()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        tokens, top_k = flat.shape[0], self.config.top_k
        routing = route(self.router(flat), self.config, self.expert_bias)
        loads = expert_counts(routing.experts.reshape(-1), self.config.num_experts)
        probabilities = routing.probabilities.detach()
        entropy = -(probabilities * probabilities.clamp(min=1e-20).log()).sum(-1).mean()
        balance = balance_loss(routing, loads)
        # The shared experts before the routed ones, whose combine saves the last tensors backward needs: a
        # checkpointed block's recomputation stops there, short of the tensor-parallel sum that follows.
        shared = self.shared(flat) if self.shared is not None else None
        routed, share, group = flat, None, self.token_group
        if group is not None:  # this rank's tokens only; their gradients summed over the group in backward
            routed, share = gradient_summed_over(flat, group), token_share(tokens, group)
            routing = replace(routing, weights=gradient_summed_over(routing.weights, group))
        sent = dispatch(routed, routing, self.config.num_experts, capacity(tokens, self.config), share)
        if self.expert_group is None:
            outputs = self.experts(sent.rows, sent.counts)
        else:
            outputs = exchange(self.experts, sent, self.expert_group)
        out = combine(outputs, sent, tokens, top_k).to(x.dtype)
        # Overwritten, not added: a checkpointed block's recomputation in backward records the same again.
        self.record = Record(loads, sent.dropped, balance, entropy)
        if group is not None:  # each token's output from the rank that computed it
            out = sum_over(out, group)
        if shared is not None:
            out = out + shared
        return out.view_as(x)

    def reset_expert_bias(self) -> None:
        """Zero the router's bias (after a meta-device build: buffers are allocated empty)."""
        if self.expert_bias is not None:
            with torch.no_grad():
                self.expert_bias.zero_()


class StepRecords:
    """The figures of a step's training forwards, summed: one row per block of the whole model, its experts' loads then
    the pairs dropped, the balance loss, the router's entropy and the forwards counted (so the machinery sums them
    over ranks in one collective, and means come out right however many forwards and ranks added to them). A model
    that holds only some blocks (a pipeline stage) fills their rows and leaves the others zero: summed over the
    ranks, every block's row comes from the stage that holds it."""

    def __init__(self, layers: dict[int, MoE], n_layer: int) -> None:
        # The layers' MoeConfig (the same for all), typed: nn.Module's attribute lookup would type it as a module.
        self.config: MoeConfig = next(iter(layers.values())).config
        self.layers = layers  # by block index in the whole model
        self.n_layer = n_layer
        self.sums: torch.Tensor | None = None

    def add_forward(self) -> torch.Tensor:
        """Add the figures the layers recorded in the forward just run; that forward's balance loss (in the graph),
        summed over the layers held and divided by the whole model's: the mean over its layers, or a stage's share
        of it."""
        held = {index: layer.record for index, layer in self.layers.items() if layer.record is not None}
        records = list(held.values())
        values = torch.stack(
            [
                torch.cat([r.loads.float(), torch.stack([r.dropped.float(), r.balance_loss.detach(), r.entropy])])
                for r in records
            ]
        )
        values = F.pad(values, (0, 1), value=1.0)  # the forwards counted
        rows = values.new_zeros(self.n_layer, values.shape[1])
        rows[list(held)] = values
        self.sums = rows if self.sums is None else self.sums + rows
        return torch.stack([r.balance_loss for r in records]).sum() / self.n_layer

    def take(self) -> torch.Tensor | None:
        """The step's sums (None when no training forward ran), cleared for the next step."""
        sums, self.sums = self.sums, None
        return sums

    def end_step(self, summed: torch.Tensor, update_bias: bool) -> dict[str, torch.Tensor]:
        """Move each layer's bias towards balance (load_balance=bias, when the step's update was applied) from the
        loads `summed` over the step's forwards and the ranks (a pipeline's too); the step's figures by name."""
        experts = self.config.num_experts
        if update_bias:
            with torch.no_grad():
                for index, layer in self.layers.items():
                    if layer.expert_bias is not None:
                        load = summed[index, :experts]
                        step = self.config.bias_update_rate * torch.sign(load.mean() - load)
                        layer.expert_bias.add_(step.to(layer.expert_bias.dtype))
        ran = summed[summed[:, -1] > 0]  # the blocks some forward ran (all of them, summed over a pipeline's ranks)
        loads, dropped, balance, entropy, forwards = ran.split([experts, 1, 1, 1, 1], dim=-1)
        return {
            "moe/aux_loss": (balance / forwards).mean(),
            "moe/load_imbalance": (loads.amax(-1) / loads.mean(-1).clamp(min=1e-20)).mean(),
            "moe/dropped_fraction": dropped.sum() / loads.sum().clamp(min=1),
            "moe/router_entropy": (entropy / forwards).mean(),
        }
