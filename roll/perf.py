"""Speed metrics every training log line carries, the same on both backends.

``step_time`` (seconds per optimizer step), ``tokens_per_second`` (real, non-pad tokens of all ranks),
``mfu`` (model FLOPs utilisation: the model FLOP/s one rank achieves over that rank's hardware peak)
and ``peak_memory_gb`` (the largest peak of any rank: ``max_memory_allocated`` on GPU, peak RSS on CPU).

The model FLOPs come from the HF-style model config (``flops_per_token``, read by roll.plan.shape under each
family's field names), not from a profiler, so
activation recomputation, a DPO reference pass and padding are not counted (that is what makes it
*model* FLOPs utilisation, as in PaLM and Megatron-LM). The peak is a table of NVIDIA datasheet numbers
for known GPUs, else a short matmul probe (CPU, or a GPU the table does not know).

Every field is computed only to be logged, so none of them ever stops a run: one that cannot be computed
(a config the FLOPs formula cannot read, no memory counter) is None, ``null`` in the log, with one warning
(``logged_only``). Backend-agnostic: nothing here imports a backend; each backend hands in an HF-style config.
"""

from __future__ import annotations

import logging
import math
import re
import resource
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from roll.logging import log_rank0, warn_once
from roll.plan.shape import shape_from_hf_config

logger = logging.getLogger(__name__)

_V = TypeVar("_V")

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

def forward_flops_per_token(config: Any, seq_length: float) -> float:
    """Forward-pass matmul FLOPs per token; see ``flops_per_token``."""
    return shape_from_hf_config(config).forward_flops(seq_length)


def flops_per_token(config: Any, seq_length: float) -> float:
    """Training FLOPs per token (forward + backward = 3 x forward) of an HF-style causal LM config.

    ``config`` is an HF ``PretrainedConfig`` or a dict of its fields, read by
    ``roll.plan.shape.shape_from_hf_config`` under each family's names (``_NAMES`` there): hidden size h,
    layers L, heads n_q, KV heads n_kv, head_dim d (default h / n_q), MLP width I, vocabulary V; experts E
    (``num_experts`` / ``num_local_experts`` / ``n_routed_experts``), k of them per token
    (``num_experts_per_tok``), their width I_e (``moe_intermediate_size``, else ``intermediate_size`` as
    in Mixtral, OLMoE, PhiMoE, gpt-oss), shared experts of total width I_s
    (``shared_expert_intermediate_size`` or ``n_shared_experts`` x I_e), which layers have experts
    (``first_k_dense_replace``, ``decoder_sparse_step``, ``mlp_only_layers``). A multiply-add is 2 FLOPs; only matmuls count (norms,
    biases, softmax, RoPE and the embedding lookup are negligible or not matmuls)::

        attention  = 2*h*d*(2*n_q + 2*n_kv)              q, k, v, o projections
                   + 4*n_q*d*s                            q.k^T and p.v over s positions
        MLA        = q (through q_lora_rank when set), kv_a, kv_b, o projections
                   + 2*n_q*(d_nope + d_rope + d_v)*s      DeepSeek-V2/V3 latent attention
        linear     = 2 * (projection + conv weights)      gated DeltaNet (Qwen3-Next) layers: no s term,
                   + 6*n_v*d_k*d_v                        the recurrent state instead
        dense MLP  = 2*m*h*I                              m = 3 matrices (gated), 2 (GPT-2 style)
        MoE MLP    = 2*h*E + k*2*m*h*I_e                  router, the k ACTIVE experts
                   [+ 2*m*h*I_s (+ 2*h)]                  [shared experts (and their 1-wide gate)]
        forward    = sum over layers (mixer + MLP) + 2*h*V   (output head; tying does not change it)
        training   = 3 * forward                          (backward = 2 x forward)

    ``s`` is the sequence length each token attends over; a sliding-window layer (``layer_types``, or a
    ``sliding_window`` of every layer) attends over min(s, window). The score term counts the full s x s
    product, not the causal half: the convention of PaLM (appendix B: 6N + 12*L*H*Q*T) and nanoGPT's
    estimate, so numbers compare with theirs; for a causal model it overstates that term about 2x. Layers
    of other kinds (Mamba or convolution mixers of hybrids) count their MLP only. Frozen weights (LoRA)
    still count their weight-gradient matmuls: the model's FLOPs, not the work done.
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

def logged_only(field: str, what: str, compute: Callable[[], _V]) -> _V | None:
    """``compute()``, or None with one warning naming what could not be computed: a value computed only to
    be logged never stops a run. Any exception is caught on purpose: a model family the FLOPs formula
    does not know, or a device without a memory counter, fails in its own way, and only a log field
    depends on it."""
    try:
        return compute()
    except Exception as exc:  # noqa: BLE001 -- see the docstring
        warn_once(logger, f"{field} is logged as null: cannot compute {what} ({type(exc).__name__}: {exc}). "
                          "Training goes on.")
        return None


def speed_metrics(tokens: float | None, seconds: float, steps: int, world_size: int, *,
                  flops_per_token: float | None, peak_flops: float | None,
                  device: torch.device | str | None = None) -> dict[str, float | None]:
    """The speed fields of one log record from one logging window.

    ``tokens``: real tokens of all ranks in the window; ``seconds``: its wall time; ``steps``: optimizer
    steps in it; ``world_size``: ranks sharing the work (every parallel dimension); ``flops_per_token``:
    ``flops_per_token(config, s)``; ``peak_flops``: one rank's peak. mfu = tokens/s * flops_per_token /
    world_size / peak_flops. A field whose inputs are unknown (None) is None (``null`` in the log).
    Collective when a process group exists (peak memory is a MAX over ranks; every rank joins it).
    """
    seconds = max(seconds, 1e-9)
    tokens_per_second = None if tokens is None else tokens / seconds
    mfu = None
    if tokens_per_second is not None and flops_per_token is not None and peak_flops:
        mfu = float(f"{tokens_per_second * flops_per_token / (max(world_size, 1) * peak_flops):.4g}")
    local = logged_only("peak_memory_gb", "this process's peak memory",
                        lambda: peak_memory_bytes(device) / 2**30)
    peak_gb = max_over_ranks(-1.0 if local is None else local, device)
    return {"step_time": round(seconds / max(steps, 1), 4),
            "tokens_per_second": None if tokens_per_second is None else round(tokens_per_second, 2),
            "mfu": mfu, "peak_memory_gb": None if peak_gb < 0 else round(peak_gb, 4)}


class SpeedMeter:
    """What a backend sets up once per run: the model config, the ranks and the hardware peak
    (measured or looked up once, and logged once on rank 0)."""

    def __init__(self, model_config: Any, world_size: int, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        self.model_config, self.world_size, self.device = model_config, world_size, device
        peak = logged_only("mfu", "the hardware's peak FLOP/s", lambda: hardware_peak_flops(device, dtype))
        self.peak_flops, self.peak_source = peak if peak is not None else (None, "unknown")
        if peak is not None:
            log_rank0(logger, "MFU peak: %.3g FLOP/s per rank (%s), %d rank(s)", self.peak_flops,
                      self.peak_source, world_size)

    def metrics(self, tokens: float | None, seconds: float, steps: int,
                seq_length: float) -> dict[str, float | None]:
        """``speed_metrics`` of a window whose samples average ``seq_length`` real tokens. Collective."""
        model_type = model_type_of(self.model_config)
        flops = logged_only("mfu", f"the FLOPs per token of this model (model_type {model_type!r})",
                            lambda: flops_per_token(self.model_config, seq_length))
        return speed_metrics(tokens, seconds, steps, self.world_size, flops_per_token=flops,
                             peak_flops=self.peak_flops, device=self.device)


class SpeedWindow:
    """One logging window of a run, the same on both backends: the real tokens and rows counted since the
    previous training record, the optimizer steps done in it, and its wall time: from the run's first step
    (not its set-up or an ``eval_on_start``) or the previous record, to this record."""

    def __init__(self, meter: SpeedMeter) -> None:
        self.meter = meter
        self._reset(since=None)

    def _reset(self, since: float | None) -> None:
        self.tokens: torch.Tensor | int = 0
        self.rows = 0
        self.tokens_unknown = False
        self.first_step: int | None = None
        self.since = since

    def begin(self, step: int) -> None:
        """A step starts after ``step`` steps done (called once per step or per micro-batch: the first call
        of a window counts)."""
        if self.first_step is None:
            self.first_step = step
        if self.since is None:
            self.since = time.perf_counter()

    def add(self, tokens: torch.Tensor | int | None, rows: int) -> None:
        """Count a batch's real tokens (None: not computable, so this window's tokens_per_second and mfu are
        null) and rows (a DPO pair is two). Tokens may stay a device tensor until ``close``."""
        self.tokens_unknown = self.tokens_unknown or tokens is None
        self.tokens = self.tokens + (0 if tokens is None else tokens)
        self.rows += rows

    def close(self, step: int, over_ranks: Callable[[Any, int], tuple[int, int]] | None = None,
              ) -> dict[str, float | None]:
        """The speed fields of the window ending after ``step`` steps done; the next window starts now.
        ``over_ranks`` maps this rank's (tokens, rows) to all ranks' (a collective), when counted per rank.
        Collective (peak memory is a MAX over ranks)."""
        now = time.perf_counter()
        tokens, rows = self.tokens, self.rows
        if over_ranks is not None:
            tokens, rows = over_ranks(tokens, rows)
        tokens = int(tokens)
        steps = step - (self.first_step if self.first_step is not None else step)
        seconds = now - (self.since if self.since is not None else now)
        unknown = self.tokens_unknown
        self._reset(since=now)
        return self.meter.metrics(None if unknown else tokens, seconds, steps,
                                  seq_length=tokens / max(rows, 1))


def real_tokens(batch: dict[str, Any], pad_token_id: int | None) -> torch.Tensor | int:
    """Non-pad tokens of a collated batch (for tokens_per_second): the attention mask's ones, or (packed
    rows carry none) the ids that are not padding. A tensor on the batch's device: reading it would wait
    for the GPU, so callers sum it and read it once per log."""
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        return mask.sum()
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor):
        return 0
    return (ids != pad_token_id).sum() if pad_token_id is not None else ids.numel()


def model_type_of(config: Any) -> str | None:
    return config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)


def training_dtype(bf16: bool, fp16: bool) -> torch.dtype:
    """The matmul dtype of a run from its precision flags (for the peak's column)."""
    return torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32
