"""megatron-core's local multi-tensor scale (no Transformer Engine, no Apex) without its extra copies.

Without TE or Apex, megatron-core's gradient clipping and its main-to-model parameter copy (fp16 / bf16)
call ``megatron.core.utils.local_multi_tensor_scale``, which computes ``dst.copy_(src * scale)`` tensor
by tensor: on every clipped step each gradient is multiplied into a new tensor and copied back (an
allocation and a second pass over 4 bytes a parameter), and a plain copy (``scale`` 1.0) first multiplies
by one. The replacement scales in place with one foreach call when source and destination are the same
tensors (clipping), and copies without the multiplication when ``scale`` is 1.0. Same float32 products, so
the same bits. ``backends.mca.platform`` applies it (its table says when it can go).
"""

from __future__ import annotations

import torch


def foreach_multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale) -> None:
    """Drop-in for ``local_multi_tensor_scale`` (``amp_C.multi_tensor_scale``'s signature):
    ``dst = src * scale`` for each pair of ``tensor_lists = [sources, destinations]``."""
    sources, targets = tensor_lists
    if not targets:
        return
    if all(source is target for source, target in zip(sources, targets)):
        torch._foreach_mul_(targets, scale)
        return
    for source, target in zip(sources, targets):
        target.copy_(source if scale == 1.0 else source * scale)


def uses_local_multi_tensor_scale() -> bool:
    """megatron-core imported its local (Python loop) multi-tensor scale: no TE, no Apex."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import local_multi_tensor_scale

    return clip_grads.multi_tensor_scale_impl in (local_multi_tensor_scale, foreach_multi_tensor_scale)


def patch_local_multi_tensor_scale() -> None:
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as megatron_optimizer

    clip_grads.multi_tensor_scale_impl = foreach_multi_tensor_scale
    if getattr(megatron_optimizer, "multi_tensor_scale_impl", None) is not None:
        megatron_optimizer.multi_tensor_scale_impl = foreach_multi_tensor_scale
