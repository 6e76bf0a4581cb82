"""The one place that strips training wrappers off a Megatron model chunk."""

from __future__ import annotations

import sys

from torch import nn


def unwrap_model(module: nn.Module) -> nn.Module:
    """The bare model under Megatron ``DistributedDataParallel`` / ``Float16Module`` (``.module``) and
    PEFT wrappers (``PeftModel.base_model.model``, ``LoraModel.model``), in any nesting.

    Export, checkpointing and logging read parameter names and ``.config`` from the bare GPTModel,
    so wrapping a chunk for training never changes a key.
    """
    wrappers = _wrapper_types()
    while True:
        if isinstance(module, wrappers["module"]):
            module = module.module
        elif isinstance(module, wrappers["peft"]):
            module = module.base_model.model
        elif isinstance(module, wrappers["tuner"]):
            module = module.model
        else:
            return module


def _wrapper_types() -> dict[str, tuple[type, ...]]:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    types: dict[str, tuple[type, ...]] = {"module": (DistributedDataParallel, Float16Module), "peft": (), "tuner": ()}
    if "peft" not in sys.modules:  # nothing can be wrapped by PEFT before it is imported (2 s saved per convert)
        return types
    try:  # PEFT is optional on the mca backend
        from peft import PeftModel
        from peft.tuners.tuners_utils import BaseTuner
    except ImportError:
        return types
    types.update(peft=(PeftModel,), tuner=(BaseTuner,))
    return types
