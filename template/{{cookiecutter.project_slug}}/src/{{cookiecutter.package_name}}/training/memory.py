"""What a process holds in memory: peak GPU and host memory, and the bytes of its training state."""

from __future__ import annotations

import sys

import torch

try:
    import resource
except ImportError:  # not on Windows: host memory is then not reported
    resource = None  # type: ignore[assignment]


def memory_gib(device: torch.device) -> dict[str, float]:
    """Peak GPU memory allocated and reserved by this process (GPU only) and its peak host RSS, in GiB."""
    memory = {}
    if device.type == "cuda":
        memory["memory/peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        memory["memory/peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
    if resource is not None:  # ru_maxrss is KiB on Linux, bytes on macOS
        scale = 1 if sys.platform == "darwin" else 1024
        memory["memory/host_peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**30
    return memory


def local_training_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this process holds (its local shards)."""
    from torch.distributed.tensor import DTensor

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
