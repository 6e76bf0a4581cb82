"""How a backend holds a run's state, for the planner (roll.plan.planner): parallel sizes, bytes per element of
weights, gradients and optimizer states, and what is sharded by how much. mca: Megatron's layout, its
distributed optimizer and fp32 gradient buffers; standard: plain DDP, or DeepSpeed ZeRO stage 1-3 with CPU
offload, read from its JSON config. Written as data here (never imported from a backend), checked by the
planner's measurement test (tests/distributed/test_plan_measured.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from roll.config.run import RunConfig
from roll.config.training import read_deepspeed_json
from roll.plan.shape import ModelShape


@dataclass(frozen=True)
class Strategy:
    """How a backend holds the state: parallel sizes, bytes per element, and what is sharded by how much."""

    backend: str
    world_size: int
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    dp: int = 1
    ep: int = 1
    etp: int = 1
    sp: bool = False
    precision: str = "fp32"
    weight_bytes: int = 4
    grad_bytes: int = 4
    optim_bytes: int = 8  # per trainable parameter: Adam m, v (+ fp32 master copy when weights are 16-bit)
    param_shard: int = 1  # ZeRO-3
    grad_shard: int = 1  # ZeRO-2/3
    optim_shard: int = 1  # ZeRO-1+ / distributed optimizer
    expert_optim_shard: int = 1  # distributed optimizer over the expert-data-parallel group
    optimizer_on_cpu: bool = False
    params_on_cpu: bool = False
    ddp_buckets: bool = False  # torch DDP keeps a second copy of the gradients in its buckets
    zero_stage: int | None = None
    reduce_bucket: float = 0  # DeepSpeed's gradient reduce bucket, in elements (ZeRO-1/2/3)
    recompute: str | None = None  # full, selective or None
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    flash: bool = True  # the attention kernel never stores the s x s scores
    act_bytes: int = 2
    vocab_multiple: int = 1  # Megatron pads the vocabulary to a multiple of this


def strategy_for(config: RunConfig, shape: ModelShape) -> Strategy:
    """The Strategy of the configured backend (mca: the validated ``config.layout``)."""
    t, m = config.training, config.megatron
    mixed = bool(t.bf16 or t.fp16)
    precision = "bf16" if t.bf16 else "fp16" if t.fp16 else "fp32"
    world = t.world_size_from_launch
    if config.training.use_mca:
        lay = config.layout
        assert lay is not None, "RunConfig.validate() builds the layout for use_mca"
        dp_cp = lay.dp * lay.cp
        expert_dp = max(lay.tp * lay.cp * lay.dp // (lay.expert_tp * lay.ep), 1)
        return Strategy(
            backend="mca", world_size=world, tp=lay.tp, pp=lay.pp, vpp=lay.vpp_size, cp=lay.cp, dp=lay.dp,
            ep=lay.ep, etp=lay.expert_tp, sp=lay.sequence_parallel, precision=precision,
            # Megatron keeps 16-bit weights, a main_grad buffer (fp32 with grad_reduce_in_fp32, else the
            # weights' dtype) and fp32 masters.
            weight_bytes=2 if mixed else 4, grad_bytes=4 if m.grad_reduce_in_fp32 or not mixed else 2,
            optim_bytes=12 if mixed else 8,
            optim_shard=dp_cp if m.use_distributed_optimizer else 1,
            expert_optim_shard=expert_dp if m.use_distributed_optimizer else 1,
            optimizer_on_cpu=m.optimizer_cpu_offload, recompute=m.recompute_granularity,
            recompute_method=m.recompute_method or "uniform",
            recompute_num_layers=m.recompute_num_layers or 1,
            flash=m.transformer_impl != "local", act_bytes=2 if mixed else 4,
            vocab_multiple=m.make_vocab_size_divisible_by * lay.tp)
    recompute = "full" if t.gradient_checkpointing else None
    flash = config.model.attn_implementation != "eager"
    common = dict(backend="standard", world_size=world, dp=world, precision=precision, recompute=recompute,
                  flash=flash, act_bytes=2 if mixed else 4)
    if not t.deepspeed:
        # roll loads fp32 weights ('auto') and HF autocasts; torch AdamW keeps m, v in the weights' dtype.
        weight = {"auto": 4, "float32": 4, "bfloat16": 2, "float16": 2}[config.model.dtype]
        return Strategy(**common, weight_bytes=weight, grad_bytes=weight, optim_bytes=2 * weight,
                        ddp_buckets=world > 1)
    ds = t.deepspeed if isinstance(t.deepspeed, dict) else read_deepspeed_json(t.deepspeed)
    zero = ds.get("zero_optimization") or {}
    stage = int(zero.get("stage", 0))
    bucket = zero.get("reduce_bucket_size", 5e8)  # DeepSpeed's default; HF fills "auto" with hidden_size ** 2
    bucket = shape.hidden_size ** 2 if bucket == "auto" else float(bucket)
    offload = {k: (zero.get(k) or {}).get("device", "none") == "cpu"
               for k in ("offload_optimizer", "offload_param")}
    # DeepSpeed casts the model to 16 bits and keeps fp32 master weights + Adam m, v (the ZeRO paper's
    # 2 + 2 + 12); ZeRO-1/2/3 copy the fp32 master partition in fp32 training too (measured: docs/planner.md).
    return Strategy(**common, weight_bytes=2 if mixed else 4, grad_bytes=2 if mixed else 4,
                    optim_bytes=12 if mixed or stage >= 1 else 8, zero_stage=stage,
                    reduce_bucket=bucket if stage else 0, param_shard=world if stage >= 3 else 1,
                    grad_shard=world if stage >= 2 else 1, optim_shard=world if stage >= 1 else 1,
                    expert_optim_shard=world if stage >= 1 else 1,
                    optimizer_on_cpu=offload["offload_optimizer"],
                    params_on_cpu=offload["offload_param"] and stage >= 3)
