"""One rank of a run, rehearsed in this process: `<project> rehearse` starts one such process per rank it looks at.

The process becomes rank `rank` of the recipe's `num_nodes x devices` ranks on torch's fake process group
(backend "fake": every collective returns at once, so no other rank need exist), builds the run as `train` does
(the recipe's strategy: its Fabric strategy, device mesh, model, sharding, optimizer) with every tensor a fake
tensor (FakeTensorMode: shapes and dtypes, no memory, no arithmetic), and runs one whole optimizer step on an
example batch of the task: forward and backward, the step decision's all_reduce, clipping and the optimizer's
first step. It measures what the rank holds (parameters, gradients, optimizer state, in bytes), the peak of the
step (torch's memory trackers, FSDP-aware where the model is sharded by fully_shard) and the collectives it
issued, and writes them as JSON.

The accelerator is the CPU whatever the recipe says: the fake tensors carry the recipe's dtypes, so the bytes are
those of the GPU run; what differs on GPUs (CUDA kernels' workspaces, NCCL's buffers, the caching allocator's
fragmentation) is not measured.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..recipe.load import parse_recipe
from ..strategies import strategy_for
from ..strategies.pipeline import PipelineRank
from ..tasks import task_for
from .optim import build_optimizer
from .run import build_fabric
from .step_decision import decide

COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
# The functional collectives (DTensor's) under the names of the process group's (fully_shard's, Fabric's).
SAME_COLLECTIVE = {
    "all_reduce": "allreduce",
    "all_gather_into_tensor": "allgather",
    "reduce_scatter_tensor": "reduce_scatter",
}


class Collectives(TorchDispatchMode):
    """Counts the collectives dispatched through torch's c10d operators (fully_shard, DTensor, Fabric's
    all_reduce, the pipeline's send and recv) with the bytes of the largest tensor each moves."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        self.ddp_buckets: dict[int, int] = {}  # DDP's gradient buckets, by index: bytes it holds for the whole run

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if (device := answered_device(func, args)) is not None:
            return device
        if any(issubclass(kind, DTensor) for kind in types):
            # DTensor's own operator runs first and redistributes (the clip's partial norm all-reduced): those
            # collectives reach this mode only if it declines the DTensor operator, as torch's CommDebugMode does
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if func.namespace in COLLECTIVE_NAMESPACES and not func.__name__.startswith("wait"):
            name = func.__name__.split(".")[0].strip("_").removesuffix("_").removesuffix("_base")
            name = SAME_COLLECTIVE.get(name, name)
            tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
            self.counts[name] += 1
            self.bytes[name] += max((t.numel() * t.element_size() for t in tensors), default=0)
        return out


def answered_device(func: Any, args: Any) -> torch.device | None:
    """The device of a fake tensor, which `tensor.device` asks of every dispatch mode (half of what they see): answered
    by the first mode, as the fake tensor answers it below them all; None for any other operator."""
    from torch._subclasses.fake_tensor import FakeTensor

    if func is not torch.ops.prim.device.default or not isinstance(tensor := args[0], FakeTensor):
        return None
    return None if tensor.fake_mode.in_kernel_invocation else tensor.fake_device


def tensors_in(values: Sequence[Any]) -> list[torch.Tensor]:
    """The tensors among an operator's arguments, in lists too (torch's tree_flatten, without its cost: it runs for
    every operator)."""
    found: list[torch.Tensor] = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(tensors_in(value))
    return found


class RealWhereReal(TorchDispatchMode):
    """Under fake tensors, the integer bookkeeping stays real: an operator whose tensors are all real runs for real
    (the device mesh's rank tables, which torch indexes by their values), and so does a new tensor of integers made
    from nothing (the step decision's flags, read on the host). The model's tensors and every float stay fake."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

        if (device := answered_device(func, args)) is not None:
            return device
        kwargs = kwargs or {}
        tensors = tensors_in((*args, *kwargs.values()))
        if tensors and not any(isinstance(t, FakeTensor) for t in tensors):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if not tensors and isinstance(out, FakeTensor) and not (out.is_floating_point() or out.is_complex()):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return out


def total(snapshot: dict[Any, dict[str, int]]) -> int:
    """The bytes of a memory tracker's snapshot (its one device's)."""
    return max((int(device.get("Total", 0)) for device in snapshot.values()), default=0)


def local_bytes(tensors: Any) -> int:
    """Bytes of these tensors on this rank (a DTensor's local shard)."""
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


def mesh_coordinates(fabric: Any, rank: int, world_size: int) -> dict[str, int]:
    """This rank's place on the run's device mesh, by dimension name; a flat data-parallel index without one."""
    mesh = getattr(fabric.strategy, "device_mesh", None) if hasattr(fabric.strategy, "_device_mesh") else None
    if mesh is None:
        return {"data_parallel": rank}
    return {name: mesh.get_local_rank(name) for name in mesh.mesh_dim_names or ()}


def become_rank(rank: int, recipe: Any) -> None:
    """Join the fake process group as `rank` of the recipe's ranks, with the environment a launcher would give
    (Fabric then takes the ranks as given and starts no process)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    devices, world_size = recipe.devices, recipe.world_size
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank % devices),
        LOCAL_WORLD_SIZE=str(devices),
        GROUP_RANK=str(rank // devices),
        NODE_RANK=str(rank // devices),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="1",  # never dialled: the process group exists before Fabric looks for one
        TORCHELASTIC_RUN_ID="rehearsal",
    )
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


class NoHook:
    """A hook handle for a parameter that gets none (a frozen one)."""

    def remove(self) -> None:
        """Nothing to remove."""


def memory_tracker(model: Any, optimizer: Any) -> Any:
    """torch's FSDP-aware tracker where fully_shard sharded the model as one, its generic one otherwise (without its
    module hooks for a pipeline's stages: `storage_tracker`). Frozen parameters (LoRA's base weights) get no gradient
    hook: torch's trackers would register one on every parameter, which torch refuses for a tensor that requires no
    gradient."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        tracker: Any = FSDPMemTracker(cast(Any, model), optimizer)
    elif isinstance(model, PipelineRank):  # several stages, each sharded as a model of its own
        tracker = storage_tracker(model, optimizer)
    else:
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
    for parameter in model.parameters():
        if not parameter.requires_grad:
            tracker._param_to_grad_hook_handles[parameter] = (NoHook(), NoHook())
    tracker._update_peak_stats = partial(update_device_peak, tracker)
    return tracker


def update_device_peak(tracker: Any, state: Any) -> None:
    """The tracker's peak per device, without its per-module peaks (which the rehearsal does not read): torch's
    trackers compare, at every operator, the memory with the peak of each module they have seen, which takes 3
    minutes of a LoRA Llama-8B rank's 4 (thousands of modules, each adapter a few) and leaves the peak the same."""
    from copy import deepcopy

    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    for device, snapshot in tracker._curr_mem_snap.items():
        if tracker._peak_mem.get(device, 0) < snapshot[_TOTAL_KEY]:
            tracker._peak_mem[device] = snapshot[_TOTAL_KEY]
            tracker._peak_mem_snap[device] = deepcopy(snapshot)


class ShardingUnseen:
    """DTensor works out an operator's output sharding by running the operator on fake tensors of the global shapes, in
    the fake mode it finds active: in a rehearsal, the rehearsal's own, where torch's memory trackers count what runs
    (on GPUs the fake mode is one of its own, which they pass over). Set as the lock DTensor holds meanwhile, this has
    the tracker pass over it here too: a tracker counts only what runs in the fake mode it was entered in."""

    def __init__(self, tracker: Any) -> None:
        self.tracker = tracker
        self.entered: list[Any] = []  # the tracker's own fake mode, put back on leaving

    def __enter__(self) -> None:
        self.entered.append(self.tracker._fake_mode_on_entry)
        self.tracker._fake_mode_on_entry = None

    def __exit__(self, *args: object) -> None:
        self.tracker._fake_mode_on_entry = self.entered.pop()


def storage_tracker(model: Any, optimizer: Any) -> Any:
    """torch's generic tracker without its per-module hooks, for a pipeline's stages: they run each module once per
    piece, which the hooks take for the next step, and the zero-bubble schedules take input gradients with
    autograd.grad, which the hooks cannot follow (torch refuses the stage's input, a leaf, there). Every tensor's
    storage is tracked still, so the peak is; it is held apart as parameters, optimizer state and the rest by pass
    (forward: activations, backward: temporaries, fully_shard's gradients among them)."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed._tools.mod_tracker import ModTracker

    class Unhooked(ModTracker):
        def __enter__(self) -> Unhooked:
            return self

        def __exit__(self, *args: object) -> None:
            return None

    tracker = MemTracker()
    tracker._mod_tracker = Unhooked()
    tracker.track_external(model, optimizer)
    return tracker


def count_ddp_buckets(model: Any, collectives: Collectives) -> None:
    """DDP's reducer all-reduces its gradient buckets through the process group directly, past the operators
    `Collectives` sees, and expects a tensor back, which the fake group does not give: a communication hook counts
    each bucket and hands it back as reduced. The buckets are flat buffers DDP allocated when it wrapped the model,
    before the memory tracker started: their bytes are recorded here and added to the peak."""
    from torch.nn.parallel import DistributedDataParallel

    def counted(state, bucket):  # type: ignore[no-untyped-def]  # torch reads the annotations: none, or its class
        buffer = bucket.buffer()
        collectives.counts["allreduce"] += 1
        collectives.bytes["allreduce"] += buffer.numel() * buffer.element_size()
        collectives.ddp_buckets[bucket.index()] = buffer.numel() * buffer.element_size()
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(buffer)
        return done

    for module in model.modules():
        if isinstance(module, DistributedDataParallel):
            module.register_comm_hook(None, counted)


def swap_unless_same(swap: Any) -> Any:
    """torch's swap_tensors, made a no-op between two tensors of the same dtype, device and layout. Moving a module to
    the device and dtype it already has (peft does so for each adapter it adds) swaps each fake parameter with a
    fake copy, which torch refuses for tensors that are weakly referenced, as fake tensors are; a fake tensor holds
    no values, so the copy would change nothing."""

    def layout(tensor: torch.Tensor) -> tuple[Any, ...]:
        return tensor.dtype, tensor.device, tensor.shape, tensor.stride()

    def swap_tensors(first: torch.Tensor, second: torch.Tensor) -> None:
        if first is not second and layout(first) != layout(second):
            swap(first, second)

    return swap_tensors


def rehearse_rank(recipe: Any, rank: int) -> dict[str, Any]:
    """Rank `rank` of the recipe's run built and stepped once on fake tensors; what it held and sent."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    become_rank(rank, recipe)
    task, strategy = task_for(recipe), strategy_for(recipe)
    fabric = build_fabric(recipe, strategy, [], accelerator="cpu")
    fabric.launch()
    # The fake tensors are made on the CPU, where the run's device is: moving them would swap each parameter with
    # itself, which torch refuses for tensor subclasses that are weakly referenced (fake tensors are).
    fabric.strategy.module_to_device = lambda module: None  # type: ignore[method-assign]
    fabric.seed_everything(recipe.train.seed)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    torch.utils.swap_tensors = swap_unless_same(torch.utils.swap_tensors)  # this process only rehearses
    with fake, RealWhereReal():
        batch = task.example_batch(recipe.train.micro_batch_size)
        if callable(give_shapes := getattr(strategy, "give_stages_shapes_of", None)):
            give_shapes(batch)  # a pipeline's stages cannot exchange their shapes over the fake process group
        model = strategy.build_model(fabric)
        model, optimizer, _ = strategy.setup(fabric, model, partial(build_optimizer, config=recipe.train))
    module = getattr(model, "module", model)
    torch_optimizer = getattr(optimizer, "optimizer", optimizer)
    parameters = local_bytes(module.parameters())
    tracker, collectives = memory_tracker(module, torch_optimizer), Collectives()
    ShardingPropagator._fake_mode_lock = ShardingUnseen(tracker)  # type: ignore[assignment]
    count_ddp_buckets(model, collectives)
    accumulate = recipe.train.grad_accum_steps
    # The first micro-batch and the last are rehearsed: the ones between hold what the first holds beside the
    # gradients the last finds, and issue the first's collectives again, which are counted so. A pipeline's
    # micro-batch is its schedule over every piece, by far the most to rehearse, and the same whichever micro-batch
    # it is but for the gradients the earlier ones reduced, held through it: the first alone runs, and the last's
    # peak is its peak with those gradients held.
    pipelined = isinstance(module, PipelineRank)
    rehearsed = [0] if pipelined else sorted({0, accumulate - 1})
    with fake, RealWhereReal(), tracker, collectives:
        for micro_step in rehearsed:
            issued = Counter(collectives.counts), Counter(collectives.bytes)
            with strategy.no_backward_sync(fabric, model, enabled=micro_step < accumulate - 1):
                strategy.forward_backward(fabric, model, fabric.to_device(batch), accumulate, lambda loss: loss)
            tracker.reset_mod_stats()  # per-module figures of one micro-batch; the peak is kept across them
            if micro_step == 0:
                between = accumulate - len(rehearsed)
                for counted, before in zip((collectives.counts, collectives.bytes), issued, strict=True):
                    counted.update({name: between * (value - before[name]) for name, value in counted.items()})
        gradients = local_bytes(p.grad for p in module.parameters() if p.grad is not None)
        held_by_the_last = gradients if pipelined and accumulate > 1 else 0
        decide(fabric, torch.zeros(()), recipe.train.on_nonfinite_loss, 0, False)  # its flags stay real
    # Clipping and the step run outside the tracker: both update in place on a GPU (the gradients scaled, fused
    # AdamW), while their fake kernels return new tensors, as many bytes as the whole model's gradients. From the
    # second step on the optimizer state lives through forward and backward, so the step's peak is the tracked one
    # plus the optimizer state.
    with fake, RealWhereReal(), collectives:
        strategy.clip(fabric, model, optimizer, max_norm=recipe.train.grad_clip)
        optimizer.step()
        optimizer_state = local_bytes(
            value
            for state in torch_optimizer.state.values()
            for value in state.values()
            if torch.is_tensor(value) and value.dim() > 0  # not AdamW's step counters (one scalar per tensor)
        )
        optimizer.zero_grad(set_to_none=True)
    peak = tracker.get_tracker_snapshot("peak")
    counts, sent = dict(collectives.counts), dict(collectives.bytes)
    return {
        "rank": rank,
        "mesh": mesh_coordinates(fabric, rank, recipe.world_size),
        "blocks": cast(Any, module).blocks.indices() if pipelined else None,  # its stages'
        "parameters_bytes": parameters,
        "gradients_bytes": gradients,
        "optimizer_bytes": optimizer_state,
        "peak_bytes": total(peak) + held_by_the_last + optimizer_state + sum(collectives.ddp_buckets.values()),
        "peak_by_kind": {str(kind): int(size) for device in peak.values() for kind, size in device.items()},
        "collectives": counts,
        "collective_bytes": sent,
    }


def rehearse_to_file(rank: int, out: Path, recipe_argv: list[str]) -> None:
    """Rehearse rank `rank` of the recipe that `recipe_argv` gives, its figures written to `out` as JSON."""
    recipe = parse_recipe(recipe_argv, "rehearse")
    # Compiling for fake tensors takes minutes per rank and builds CPU kernels, not the GPU's: the blocks run eager,
    # as autograd saves their activations without the fusions compile may find.
    recipe.strategy.compile = False
    out.write_text(json.dumps(rehearse_rank(recipe, rank)))
    dist.destroy_process_group()


def main() -> None:
    """`python -m <package>.training.rehearsal RANK OUT_JSON RECIPE_ARGS...`: one rank, by hand (`rehearse` forks its
    ranks from a process that imported this module once)."""
    rehearse_to_file(int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])


if __name__ == "__main__":
    main()
