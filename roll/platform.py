"""Which device and communication backend this process uses (CUDA -> nccl, Ascend -> hccl, CPU -> gloo)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch


@dataclass(frozen=True)
class Platform:
    device_type: str
    """'cuda', 'npu' or 'cpu'."""
    dist_backend: str
    """torch.distributed backend: 'nccl', 'hccl' or 'gloo'."""

    @property
    def is_accelerator(self) -> bool:
        return self.device_type != "cpu"

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cpu") if self.device_type == "cpu" else torch.device(self.device_type, local_rank)


@lru_cache(maxsize=1)
def current_platform() -> Platform:
    if torch.cuda.is_available():
        return Platform("cuda", "nccl")
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        return Platform("npu", "hccl")
    return Platform("cpu", "gloo")
