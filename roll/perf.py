"""Speed metrics every training log line carries, the same on both backends.

``step_time`` (seconds per optimizer step), ``tokens_per_second`` (real, non-pad tokens of all ranks),
``mfu`` (model FLOPs utilisation: the model FLOP/s one rank achieves over that rank's hardware peak)
and ``peak_memory_gb`` (the largest peak of any rank: ``max_memory_allocated`` on GPU, peak RSS on CPU).

The model FLOPs come from the HF-style model config (``flops_per_token``), not from a profiler, so
activation recomputation, a DPO reference pass and padding are not counted (that is what makes it
*model* FLOPs utilisation, as in PaLM and Megatron-LM). The peak is a table of NVIDIA datasheet numbers
for known GPUs, else a short matmul probe (CPU, or a GPU the table does not know).

Backend-agnostic: nothing here imports a backend; each backend hands in an HF-style config.
"""

from __future__ import annotations

import logging
import math
import re
import resource
import sys
import time
from collections.abc import Mapping
from typing import Any

import torch

from roll.logging import log_rank0

logger = logging.getLogger(__name__)

SPEED_KEYS = ("step_time", "tokens_per_second", "mfu", "peak_memory_gb")
"""The speed fields of every training log record, on both backends."""

_T = 1e12
# Dense (no structured sparsity) tensor-core peaks per GPU, FLOP/s: (bf16/fp16, tf32, fp32 without
# tensor cores). Sources: NVIDIA datasheets, whose tensor-core numbers are quoted "with sparsity"; the
# dense value is half of that. H100/H200: "NVIDIA H100 Tensor Core GPU" (2023) and "NVIDIA H200
# Tensor Core GPU" datasheets (SXM, PCIe, NVL columns); A100: "NVIDIA A100 Tensor Core GPU" (2021, SXM
# and PCIe alike); A10, L4, L40, L40S: their product datasheets; V100 / T4 (fp16 tensor cores, no bf16,
# no tf32): "NVIDIA V100" (SXM2 column) and "NVIDIA T4" datasheets; B200: "NVIDIA HGX B200" (8-GPU
# totals divided by 8). First match wins, so more specific names come first.
_GPU_PEAKS: tuple[tuple[str, str, tuple[float, float, float]], ...] = (
    (r"GH200|H200 NVL", "H200 NVL / GH200", (835 * _T, 417.5 * _T, 60 * _T)),
    (r"\bH200\b", "H200 SXM", (989.4 * _T, 494.7 * _T, 67 * _T)),
    (r"H100 NVL", "H100 NVL", (835 * _T, 417.5 * _T, 60 * _T)),
    (r"H100 PCIE", "H100 PCIe", (756 * _T, 378 * _T, 51 * _T)),
    (r"\bH100\b", "H100 SXM", (989.4 * _T, 494.7 * _T, 67 * _T)),
    (r"\bB200\b", "B200", (2250 * _T, 1100 * _T, 75 * _T)),
    (r"\bA100\b", "A100", (312 * _T, 156 * _T, 19.5 * _T)),
    (r"\bA10\b", "A10", (125 * _T, 62.5 * _T, 31.2 * _T)),
    (r"\bL40S\b", "L40S", (362 * _T, 183 * _T, 91.6 * _T)),
    (r"\bL40\b", "L40", (181 * _T, 90.5 * _T, 90.5 * _T)),
    (r"\bL4\b", "L4", (121 * _T, 60 * _T, 30.3 * _T)),
    (r"\bV100\b", "V100", (125 * _T, 15.7 * _T, 15.7 * _T)),
    (r"\bT4\b", "T4", (65 * _T, 8.1 * _T, 8.1 * _T)),
)


# ---- model FLOPs ----------------------------------------------------------------------------------

def _get(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        value = config.get(name, default)
    else:
        value = getattr(config, name, default)
    return default if value is None else value


def _moe_layers(config: Any, num_layers: int) -> list[bool]:
    """Which decoder layers are MoE layers, by the Qwen2-MoE / Qwen3-MoE rule
    (``decoder_sparse_step``, ``mlp_only_layers``); all False for a dense model."""
    experts = _get(config, "num_experts") or _get(config, "num_local_experts") or 0
    if not experts:
        return [False] * num_layers
    step, dense = int(_get(config, "decoder_sparse_step", 1)), set(_get(config, "mlp_only_layers", []))
    return [i not in dense and (i + 1) % step == 0 for i in range(num_layers)]


def forward_flops_per_token(config: Any, seq_length: float) -> float:
    """Forward-pass matmul FLOPs per token; see ``flops_per_token``."""
    h = int(_get(config, "hidden_size"))
    layers = int(_get(config, "num_hidden_layers"))
    heads = int(_get(config, "num_attention_heads"))
    kv_heads = int(_get(config, "num_key_value_heads", heads))
    d = int(_get(config, "head_dim", h // heads))
    vocab = int(_get(config, "vocab_size"))
    projections = 2 * h * d * (2 * heads + 2 * kv_heads)  # q and o: heads*d wide; k and v: kv_heads*d
    scores = 2 * 2 * heads * d * seq_length  # q.k^T and p.v over the whole sequence (not halved)
    dense_mlp = 2 * 3 * h * int(_get(config, "intermediate_size", 0))  # gate, up, down
    experts = int(_get(config, "num_experts") or _get(config, "num_local_experts") or 0)
    moe_mlp = 0
    if experts:
        top_k = int(_get(config, "num_experts_per_tok"))
        moe_mlp = 2 * h * experts + top_k * 2 * 3 * h * int(_get(config, "moe_intermediate_size"))
        shared = int(_get(config, "shared_expert_intermediate_size", 0))
        if shared:  # Qwen2-MoE: one shared expert behind a 1-wide sigmoid gate
            moe_mlp += 2 * 3 * h * shared + 2 * h
    per_layer = [projections + scores + (moe_mlp if moe else dense_mlp)
                 for moe in _moe_layers(config, layers)]
    return float(sum(per_layer) + 2 * h * vocab)  # + the output head (tied or not: the same matmul)


def flops_per_token(config: Any, seq_length: float) -> float:
    """Training FLOPs per token (forward + backward = 3 x forward) of an HF-style causal LM config.

    ``config`` is an HF ``PretrainedConfig`` or a dict of its fields (``hidden_size`` h,
    ``intermediate_size`` I, ``num_hidden_layers`` L, ``num_attention_heads`` n_q,
    ``num_key_value_heads`` n_kv, ``head_dim`` d (default h / n_q), ``vocab_size`` V; MoE as Qwen2-MoE
    / Qwen3-MoE name it: ``num_experts`` E (or ``num_local_experts``), ``num_experts_per_tok`` k,
    ``moe_intermediate_size`` I_e, ``shared_expert_intermediate_size`` I_s, ``decoder_sparse_step``,
    ``mlp_only_layers``). A multiply-add is 2 FLOPs; only matmuls count (norms, biases, softmax,
    RoPE and the embedding lookup are negligible or not matmuls)::

        attention  = 2*h*d*(2*n_q + 2*n_kv)              q, k, v, o projections
                   + 4*n_q*d*s                            q.k^T and p.v over s positions
        dense MLP  = 6*h*I                                gate, up, down (SwiGLU)
        MoE MLP    = 2*h*E + k*6*h*I_e [+ 6*h*I_s + 2*h]  router, the k ACTIVE experts
                                                          [, the shared expert and its gate]
        forward    = sum over layers (attention + MLP) + 2*h*V   (output head; tying does not change it)
        training   = 3 * forward                          (backward = 2 x forward)

    ``s`` is the sequence length each token attends over. The score term counts the full s x s
    product, not the causal half: the convention of PaLM (appendix B: 6N + 12*L*H*Q*T) and nanoGPT's
    estimate, so numbers compare with theirs; for a causal model it overstates that term about 2x.
    Frozen weights (LoRA) still count their weight-gradient matmuls: the model's FLOPs, not the work done.
    """
    return 3.0 * forward_flops_per_token(config, seq_length)


# ---- hardware peak --------------------------------------------------------------------------------

def _dtype_column(dtype: torch.dtype) -> tuple[int, str]:
    if dtype in (torch.bfloat16, torch.float16):
        return 0, str(dtype).removeprefix("torch.")
    if torch.get_float32_matmul_precision() != "highest":  # "high"/"medium": fp32 matmuls run as tf32
        return 1, "tf32"
    return 2, "fp32"


def gpu_table_peak(device_name: str, dtype: torch.dtype) -> tuple[float, str] | None:
    """(FLOP/s, description) of a GPU named like ``torch.cuda.get_device_name``; None if unknown."""
    column, precision = _dtype_column(dtype)
    for pattern, label, peaks in _GPU_PEAKS:
        if re.search(pattern, device_name, re.IGNORECASE):
            return peaks[column], f"{label} datasheet, dense {precision}"
    return None


def matmul_probe(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, *, size: int = 256,
                 budget_s: float = 0.1) -> float:
    """Achieved FLOP/s of a ``size`` x ``size`` GEMM on ``device`` with this process's threads: the best
    of repeated runs within about ``budget_s`` seconds (after one warm-up)."""
    device = torch.device(device)
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.mm(a, b)
    sync()
    best, deadline = math.inf, time.perf_counter() + budget_s
    while True:
        start = time.perf_counter()
        torch.mm(a, b)
        sync()
        now = time.perf_counter()
        best = min(best, now - start)
        if now >= deadline:
            break
    return 2.0 * size**3 / max(best, 1e-9)


def hardware_peak_flops(device: torch.device | str | None = None,
                        dtype: torch.dtype = torch.float32) -> tuple[float, str]:
    """(peak FLOP/s of one rank, how it was obtained): the datasheet table for a known GPU, else a
    matmul probe (CPU: on this process's threads, so a busy machine measures low and mfu reads high)."""
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        known = gpu_table_peak(name, dtype)
        if known is not None:
            return known[0], f"{name}: {known[1]}"
        return matmul_probe(device, dtype, size=4096), f"{name}: matmul probe, {_dtype_column(dtype)[1]}"
    threads = torch.get_num_threads()
    precision = str(dtype).removeprefix("torch.")
    return (matmul_probe(device, dtype),
            f"CPU matmul probe, {precision}, {threads} thread{'s' if threads > 1 else ''}")


# ---- memory ---------------------------------------------------------------------------------------

def peak_memory_bytes(device: torch.device | str | None = None) -> int:
    """This process's peak memory: ``torch.cuda.max_memory_allocated`` on a GPU device, else the peak
    resident set size (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    device = torch.device(device) if device is not None else None
    on_gpu = device.type == "cuda" if device is not None else torch.cuda.is_initialized()
    if on_gpu:
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def max_over_ranks(value: float, device: torch.device | str | None = None) -> float:
    """The largest ``value`` of all ranks (an all-reduce MAX: every rank must call it); ``value`` alone
    without a process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    if device is None:
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


# ---- the log fields -------------------------------------------------------------------------------

def speed_metrics(tokens: float, seconds: float, steps: int, world_size: int, *, flops_per_token: float,
                  peak_flops: float, device: torch.device | str | None = None) -> dict[str, float]:
    """The speed fields of one log record from one logging window.

    ``tokens``: real tokens of all ranks in the window; ``seconds``: its wall time; ``steps``: optimizer
    steps in it; ``world_size``: ranks sharing the work (every parallel dimension); ``flops_per_token``:
    ``flops_per_token(config, s)``; ``peak_flops``: one rank's peak. mfu = tokens/s * flops_per_token /
    world_size / peak_flops. Collective when a process group exists (peak memory is a MAX over ranks).
    """
    seconds = max(seconds, 1e-9)
    tokens_per_second = tokens / seconds
    mfu = tokens_per_second * flops_per_token / (max(world_size, 1) * peak_flops)
    peak_gb = max_over_ranks(peak_memory_bytes(device) / 2**30, device)
    return {"step_time": round(seconds / max(steps, 1), 4), "tokens_per_second": round(tokens_per_second, 2),
            "mfu": float(f"{mfu:.4g}"), "peak_memory_gb": round(peak_gb, 4)}


class SpeedMeter:
    """What a backend sets up once per run: the model config, the ranks and the hardware peak
    (measured or looked up once, and logged once on rank 0)."""

    def __init__(self, model_config: Any, world_size: int, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        self.model_config, self.world_size, self.device = model_config, world_size, device
        self.peak_flops, self.peak_source = hardware_peak_flops(device, dtype)
        log_rank0(logger, "MFU peak: %.3g FLOP/s per rank (%s), %d rank(s)", self.peak_flops,
                  self.peak_source, world_size)

    def metrics(self, tokens: float, seconds: float, steps: int, seq_length: float) -> dict[str, float]:
        """``speed_metrics`` of a window whose samples average ``seq_length`` real tokens. Collective."""
        return speed_metrics(tokens, seconds, steps, self.world_size,
                             flops_per_token=flops_per_token(self.model_config, seq_length),
                             peak_flops=self.peak_flops, device=self.device)


def training_dtype(bf16: bool, fp16: bool) -> torch.dtype:
    """The matmul dtype of a run from its precision flags (for the peak's column)."""
    return torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32
