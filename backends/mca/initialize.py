"""Bring up torch.distributed and Megatron-Core's parallel state for one ParallelLayout.

``initialize_megatron`` is idempotent: the trainer, the converter and tests may all call it; the
first call does the work and later calls with the same layout return the same ``DistributedInfo``.
"""

from __future__ import annotations

import logging
import os
import random
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from backends.mca.platform import apply_patches
from roll import launch
from roll.config.layout import ParallelLayout
from roll.contract import DistributedInfo
from roll.errors import ConfigError
from roll.logging import log_rank0
from roll.platform import current_platform

logger = logging.getLogger(__name__)

_state: dict[str, object] = {}
"""What this module set up: 'layout', 'info', and 'owns_process_group' (we created it)."""


def initialize_megatron(layout: ParallelLayout, seed: int = 42, timeout_seconds: float = 1800) -> DistributedInfo:
    """Initialise torch.distributed, Megatron's model-parallel groups and all RNGs for ``layout``.

    - torch.distributed from ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` (torchrun), or a one-process
      group on a free local port when there is no launcher, with the platform's backend
      (nccl / hccl / gloo);
    - the megatron-core compat patches this process needs (``backends.mca.platform``);
    - ``initialize_model_parallel(tp, pp, vpp, cp, ep, etp)``; DP = world / (tp * pp * cp) is logged;
    - seeds: ``random``, numpy and torch get ``seed`` on every rank (data order and CPU weight
      init must agree across ranks); the tensor-parallel RNG tracker gets ``seed + 2718 + tp_rank``
      (Megatron's scheme), so TP ranks draw different dropout masks, reproducibly across restarts.
    """
    if "layout" in _state:
        if _layout_key(_state["layout"]) != _layout_key(layout):  # type: ignore[arg-type]
            raise ConfigError(f"Megatron is already initialised with {_state['layout'].describe()}; "
                              f"cannot re-initialise with {layout.describe()} in the same process.")
        return _state["info"]  # type: ignore[return-value]

    platform = current_platform()
    local_rank = launch.local_rank()
    if platform.is_accelerator:  # before the process group, so nccl/hccl bind this rank's device
        getattr(torch, platform.device_type).set_device(local_rank)
    owns_group = _init_process_group(platform.dist_backend, timeout_seconds)
    world = dist.get_world_size()
    if world != layout.world_size:
        if owns_group:
            dist.destroy_process_group()
        raise ConfigError(f"the parallel layout expects world_size {layout.world_size} ({layout.describe()}), but "
                          f"torch.distributed has {world} processes. Launch with nproc_per_node * nnodes = "
                          f"{layout.world_size} or change the parallel sizes.")
    apply_patches()  # each patch decides whether this process has its problem (no accelerator, no TE, gloo)

    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp,
            pipeline_model_parallel_size=layout.pp,
            virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp_size > 1 else None,
            context_parallel_size=layout.cp,
            expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.etp,
            distributed_timeout_minutes=timeout_seconds / 60,  # a float works (timedelta(minutes=...))
        )
    _check_groups_match(layout)
    set_seed(seed)

    info = DistributedInfo(rank=dist.get_rank(), world_size=world, local_rank=local_rank,
                           dp_rank=parallel_state.get_data_parallel_rank(),
                           dp_size=parallel_state.get_data_parallel_world_size())
    log_rank0(logger, "Megatron initialised on %s (%s): %s -> dp %d", platform.device_type, platform.dist_backend,
              layout.describe(), info.dp_size)
    _state.update(layout=layout, info=info, owns_process_group=owns_group)
    return info


def set_seed(seed: int) -> None:
    """Seed every generator a Megatron run draws from (needs the parallel state)."""
    from megatron.core import tensor_parallel

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    # Also adds the TP / expert-parallel named states, offset by this rank's TP / EP / ETP rank.
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def is_initialized() -> bool:
    """Whether ``initialize_megatron`` has run in this process (and not been torn down)."""
    return "layout" in _state


def current_layout() -> ParallelLayout | None:
    """The layout ``initialize_megatron`` brought up in this process, or None."""
    return _state.get("layout")  # type: ignore[return-value]


def destroy_megatron() -> None:
    """Tear down what ``initialize_megatron`` set up (parallel groups, and the process group if it
    created one), so a process can exit cleanly or initialise again with another layout."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if _state.get("owns_process_group") and dist.is_initialized():
        dist.destroy_process_group()
    _state.clear()


def _init_process_group(backend: str, timeout_seconds: float) -> bool:
    """Initialise torch.distributed unless a launcher or caller already did; True if we did."""
    if dist.is_initialized():
        return False
    timeout = timedelta(seconds=timeout_seconds)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend=backend, timeout=timeout)  # env:// (MASTER_ADDR/PORT from the launcher)
    else:
        # A plain `python` run (unit tests, single-process conversion): a one-process group, its store in
        # memory (a tcp:// store would listen on every interface).
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
    return True


def _layout_key(layout: ParallelLayout) -> tuple[int, ...]:
    """The layout with defaults resolved (etp None == tp, vpp None == 1), for equality."""
    return (layout.world_size, layout.tp, layout.pp, layout.vpp_size, layout.cp, layout.ep, layout.expert_tp)


def _check_groups_match(layout: ParallelLayout) -> None:
    """Someone else may have initialised the parallel state; it must match ``layout``."""
    from megatron.core import parallel_state as ps

    actual = {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
              "cp": ps.get_context_parallel_world_size(), "ep": ps.get_expert_model_parallel_world_size(),
              "etp": ps.get_expert_tensor_parallel_world_size()}
    wanted = {"tp": layout.tp, "pp": layout.pp, "cp": layout.cp, "ep": layout.ep, "etp": layout.expert_tp}
    if actual != wanted:
        raise ConfigError(f"Megatron's parallel state is already initialised with {actual}, which differs from the "
                          f"requested {wanted}.")
