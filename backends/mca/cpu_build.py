"""megatron-core on a torch build without CUDA: the patches that make it run on CPU.

megatron-core assumes CUDA in ~175 ``torch.cuda.current_device()`` call sites, ~60 hard-coded ``device="cuda"``
tensors (optimizer, clip_grads, schedules, p2p), a CUDA-only RNG tracker and CUDA streams in the MoE alltoall
dispatcher. Each function below fixes one of those; ``backends.mca.platform``'s table applies them, only in a
process without an accelerator, and says when they can go (megatron-core supporting CPU-only builds).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


def patch_rng_tracker() -> None:
    """``CudaRNGStatesTracker.add/fork`` call ``torch.cuda.get_rng_state`` and fail on CPU builds
    ("Torch not compiled with CUDA enabled"); forward needs the tracker even at dropout 0 because
    attention dropout forks it. Keep the same named states, but of the CPU generator. Activation
    recompute saves/restores states through ``_get/_set_cuda_rng_state``, redirected the same way.
    """
    import megatron.core.tensor_parallel.random as rng

    class CpuRNGStatesTracker(rng.CudaRNGStatesTracker):
        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise RuntimeError(f"RNG seed {seed} already exists")
            if name in self.states_:
                raise RuntimeError(f"RNG state {name} already exists")
            self.seeds_.add(seed)
            outer = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)

        @contextlib.contextmanager
        def fork(self, name: str = rng._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise RuntimeError(f"RNG state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    rng.CudaRNGStatesTracker = CpuRNGStatesTracker
    rng._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    rng._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    rng.initialize_rng_tracker(force_reset=True)


def patch_current_device() -> None:
    """Buffers, grad buffers, RoPE frequencies and p2p shapes are allocated on
    ``device=torch.cuda.current_device()`` (~175 sites); one redirect beats patching each site.
    ``torch.cuda.synchronize`` follows p2p ``batch_isend_irecv`` and is meaningless on CPU.
    """
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *args, **kwargs: None


def patch_default_causal_mask() -> None:
    """``transformer.utils.get_default_causal_mask`` builds its mask with ``device="cuda"`` (used
    whenever a model is called with ``attention_mask=None``); ``fused_softmax`` imported it by name.
    """
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.transformer.utils as transformer_utils

    cache: dict[int, torch.Tensor] = {}

    def get_default_causal_mask(sq: int) -> torch.Tensor:
        if sq not in cache:
            cache[sq] = torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)
        return cache[sq]

    transformer_utils.get_default_causal_mask = get_default_causal_mask
    fused_softmax.get_default_causal_mask = get_default_causal_mask


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):  # a bare ordinal means cuda:N
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def patch_hardcoded_cuda() -> None:
    """The optimizer (``torch.tensor([1.0], device='cuda')``), clip_grads, grad scaler, schedules
    (``total_num_tokens``) and dist-checkpoint saver hard-code ``'cuda'``, call ``.cuda()``, and
    check ``param.type() == 'torch.cuda.FloatTensor'``. One process-wide ``TorchFunctionMode``
    maps them to CPU and makes ``Tensor.type()`` report the CUDA name those checks expect.
    Cost: ~25% on tiny CPU ops; it runs only without an accelerator.
    """
    from torch.overrides import TorchFunctionMode

    class CudaToCpuMode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func is torch.Tensor.cuda:
                return args[0]
            if func is torch.Tensor.type and len(args) == 1 and not kwargs:
                name = func(*args)
                return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
            if "device" in kwargs and _is_cuda_device(kwargs["device"]):
                kwargs["device"] = "cpu"
            if kwargs.get("pin_memory"):  # rope_utils pins CP position tensors
                kwargs["pin_memory"] = False
            if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
                args = (args[0], "cpu", *args[2:])
            return func(*args, **kwargs)

    CudaToCpuMode().__enter__()  # for the life of the process (the mode stack is per thread: main thread)


class _NoOpEvent:
    def wait(self, *args, **kwargs) -> None: ...
    def synchronize(self) -> None: ...
    def record(self, *args, **kwargs) -> None: ...
    def query(self) -> bool:
        return True


class _NoOpStream:
    def __init__(self, *args, **kwargs) -> None: ...
    def wait_stream(self, *args, **kwargs) -> None: ...
    def wait_event(self, *args, **kwargs) -> None: ...
    def record_event(self, *args, **kwargs) -> _NoOpEvent:
        return _NoOpEvent()
    def synchronize(self) -> None: ...
    def __eq__(self, other: object) -> bool:
        return isinstance(other, _NoOpStream)
    def __hash__(self) -> int:
        return 0


def patch_cuda_streams() -> None:
    """The MoE alltoall dispatcher (and shared-expert overlap) create ``torch.cuda.Stream()`` and
    enter ``torch.cuda.stream(...)``; CPU builds raise. CPU work is synchronous, so no-op streams
    and events keep the same semantics. (megatron-core 0.19 DDP also needs this.)"""
    default = _NoOpStream()
    torch.cuda.Stream = _NoOpStream
    torch.cuda.Event = lambda *args, **kwargs: _NoOpEvent()
    torch.cuda.current_stream = lambda *args, **kwargs: default
    torch.cuda.default_stream = lambda *args, **kwargs: default
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.Tensor.record_stream = lambda self, stream: None


def patch_moe_split_sizes() -> None:
    """``moe_utils.maybe_move_tensor_to_cpu`` converts alltoall split sizes to numpy only for CUDA
    tensors; on CPU they stay tensors and ``all_to_all_single`` rejects them (TypeError)."""
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if torch.is_tensor(tensor):
            tensor = tensor.cpu()
            if as_numpy:
                tensor = tensor.numpy()
        return tensor

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
