"""Multi-latent attention's shared RoPE key gets the gradient of every tensor-parallel rank's heads.

With column-parallel down-projections (megatron-core 0.16.1's local spec, roll's CPU path and a GPU's local
spec), ``MLASelfAttention`` gathers ``linear_kv_down_proj``'s output with ``gather_from_tensor_model_parallel_region``
and splits it into the latent (``kv_compressed``) and the shared RoPE key (``k_pos_emb``). The latent's gradient
comes back complete on every rank (``linear_kv_up_proj`` reduces its input gradient), but the RoPE key is used by
this rank's heads only, so its gradient is this rank's share; the gather's backward just keeps this rank's slice,
and the other ranks' heads never reach the key's rows of the weight (nor the layer's input). At TP2 a LoRA
adapter on ``kv_a_proj_with_mqa`` then trained 20-40 % off TP1 (``tests/distributed/test_mca_lora.py``,
``mla_tp2sp``), and so does that weight in full fine-tuning. Transformer Engine's spec (duplicated down-projections,
the key gathered from the sequence-parallel region, whose backward sums) is not affected.

This patch sums the RoPE key's columns of the gathered gradient over the TP group before the gather's backward
slices it. ``backends.mca.platform`` applies it (its table says when it can go).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_MARK = "_roll_rope_key"


class _SumRopeKeyGrad(torch.autograd.Function):
    """Identity forward; backward all-reduces the last ``width`` columns of the gradient over ``group``."""

    @staticmethod
    def forward(ctx, full: torch.Tensor, width: int, group) -> torch.Tensor:
        ctx.width, ctx.group = width, group
        return full.view_as(full)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        key = grad[..., -ctx.width:].contiguous()  # [s, b, qk_pos_emb_head_dim]: this rank's heads' share
        dist.all_reduce(key, group=ctx.group)
        grad[..., -ctx.width:] = key
        return grad, None, None


def patch_mla_rope_key_grad() -> None:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer import multi_latent_attention as mla

    original_init, original_gather = mla.MLASelfAttention.__init__, mla.gather_from_tensor_model_parallel_region

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        down, group = self.linear_kv_down_proj, self.tp_group
        if isinstance(down, ColumnParallelLinear) and group is not None and group.size() > 1:
            width = self.config.qk_pos_emb_head_dim

            def mark(module, inputs, output):  # the output the MLA gathers next (LoRA included: hooks run last)
                setattr(output[0], _MARK, (width, group))

            down.register_forward_hook(mark)

    def gather(tensor, *args, **kwargs):
        full = original_gather(tensor, *args, **kwargs)
        marked = getattr(tensor, _MARK, None)
        return full if marked is None else _SumRopeKeyGrad.apply(full, *marked)

    mla.MLASelfAttention.__init__ = __init__
    mla.gather_from_tensor_model_parallel_region = gather
