"""`python tests/deepspeed_on_cpu.py train ...`: the command line with strategy.name=deepspeed allowed on CPU. Tests only.

Fabric runs DeepSpeedStrategy only on CUDA GPUs, and the recipe checks refuse it on CPU for that
reason. DeepSpeed's own engine runs on CPU (its CPU accelerator, gloo), so the tests lift exactly
the CUDA assumptions of Fabric's strategy here and run the real loop, checkpoints and ZeRO stages
on 2 CPU processes. Nothing in src/ depends on this file.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ["DS_ACCELERATOR"] = "cpu"  # before deepspeed is imported

from lightning.fabric.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.fabric.strategies import deepspeed as fabric_deepspeed

from {{ cookiecutter.package_name }}.cli import main
from {{ cookiecutter.package_name }}.strategies.deepspeed import DeepSpeed

# 1. The hardware rule (recipe/checks.py asks the strategy): deepspeed needs no GPU here.
DeepSpeed.gpu_requirement = lambda self: None
# 2. Fabric's guard that the accelerator is CUDA; the rest of its environment setup is DDP's.
DeepSpeedStrategy.setup_environment = DDPStrategy.setup_environment
# 3. Fabric's check that GPU indices match local ranks: a CPU device has no index.
fabric_deepspeed._validate_device_index_selection = lambda devices: None


# 4. Fabric passes the CUDA device index as DeepSpeed's device rank; on CPU that is the local rank.
def _initialize_engine(self, model, optimizer=None, scheduler=None):
    import deepspeed

    engine, zero_optimizer, _, zero_scheduler = deepspeed.initialize(
        args=argparse.Namespace(device_rank=self.local_rank),
        config=self.config,
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        optimizer=optimizer,
        lr_scheduler=scheduler,
        dist_init_required=False,
    )
    return engine, zero_optimizer, zero_scheduler


DeepSpeedStrategy._initialize_engine = _initialize_engine

if __name__ == "__main__":
    main(sys.argv[1:])
