"""Checks of ``backends.mca.wgrad_fusion`` (weight gradients written into ``main_grad`` in the backward), run
inside ``platform_init.py single`` after Megatron is initialised on one process.

For a tied and an untied tiny GPT, fp32 and bf16 weights (fp32 ``main_grad``), 1 and 3 micro-batches: every
``main_grad`` after the backward equals, bit for bit, the same model's without the tags (megatron's own
autograd functions and DDP hooks), and the fused backward creates no tensor of the embedding's
[vocab, hidden] shape, where the unfused one creates them (counted with a dispatch mode).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from platform_common import SEQ, VOCAB, batch, tiny_config  # noqa: E402 (sets sys.path)


class _CountShape(TorchDispatchMode):
    """Counts fresh tensors of one shape that ops return (a [vocab, hidden] gradient, a dense scatter's
    zeros); views and in-place or ``out=`` results share an input's storage and are not counted."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.count = tuple(shape), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        self.count += sum(isinstance(t, torch.Tensor) and tuple(t.shape) == self.shape
                          and t.untyped_storage().data_ptr() not in inputs
                          for t in torch.utils._pytree.tree_leaves(out))
        return out


def _model(tied: bool, bf16: bool, fuse: bool):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module

    from backends.mca import wgrad_fusion
    from backends.mca.spec import gpt_layer_spec, resolve_transformer_impl

    # 4 query groups: no linear of this model has the embedding's [vocab, hidden] shape
    config = tiny_config(num_query_groups=4, bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
                         pipeline_dtype=torch.bfloat16 if bf16 else torch.float32)
    torch.manual_seed(0)
    model = GPTModel(config=config, transformer_layer_spec=gpt_layer_spec(config, resolve_transformer_impl("auto")),
                     vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope",
                     share_embeddings_and_output_weights=tied)
    if bf16:
        model = Float16Module(config, model)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    tagged = wgrad_fusion.mark_params([ddp]) if fuse else 0
    return ddp, tagged


def _main_grads(tied: bool, bf16: bool, fuse: bool, micro_batches: int):
    ddp, tagged = _model(tied, bf16, fuse)
    hidden = ddp.config.hidden_size
    counter = _CountShape((VOCAB, hidden))
    for step in range(2):
        ddp.zero_grad_buffer()
        for micro in range(micro_batches):
            tokens, position_ids = batch(seed=7 + 10 * step + micro)
            loss = ddp(tokens, position_ids, None, labels=torch.roll(tokens, -1, 1)).float().sum()
            with counter:
                loss.backward()
        grads = {name: p.main_grad.clone() for name, p in ddp.module.named_parameters()}
        with torch.no_grad():  # a step, so the second one starts from other weights (SGD on main_grad)
            for p in ddp.module.parameters():
                p.add_(p.main_grad.to(p.dtype), alpha=-1e-3)
        assert all(p.grad is None for p in ddp.module.parameters()), "a param.grad outlived the DDP hook"
    return grads, counter.count, tagged


def wgrad_fusion_checks() -> dict:
    from backends.mca.platform import applied_patches

    assert "wgrad_into_main_grad" in applied_patches()
    out = {}
    for tied in (True, False):
        for bf16 in (False, True):
            for micro_batches in (1, 3):
                fused, fused_vh, tagged = _main_grads(tied, bf16, True, micro_batches)
                plain, plain_vh, _ = _main_grads(tied, bf16, False, micro_batches)
                unequal = [name for name in plain if not torch.equal(fused[name], plain[name])]
                nonzero = all(bool(g.abs().sum() > 0) for g in plain.values())
                out[f"{'tied' if tied else 'untied'}_{'bf16' if bf16 else 'fp32'}_ga{micro_batches}"] = {
                    "unequal": unequal, "nonzero": nonzero, "tagged": tagged, "vocab_hidden_fused": fused_vh,
                    "vocab_hidden_plain": plain_vh}
    return out
