"""Gradient accumulation fusion without Apex's CUDA kernel: weight gradients written into ``main_grad``.

Megatron's ``gradient_accumulation_fusion`` adds a linear layer's weight gradient straight into the DDP
buffer's ``param.main_grad`` inside the backward (Apex's ``fused_weight_gradient_mlp_cuda``, absent on CPU
and wherever Apex is not installed). Without it every backward allocates each weight gradient afresh and
the DDP hook then adds it into ``main_grad``. For the two [vocab, hidden] gradients of a tied embedding (the
head's matmul output and the embedding's dense scatter, 0.31 GB each on a 151,936 x 512 vocabulary) that
memory is above glibc's mmap threshold: every step maps it anew and the kernel zeroes it page by page
(docs/performance.md, "DP2 and TP2 on 2 processes").

Here, for the weights ``mark_params`` tags (those of the column/row-parallel linears, the output layer
included, and of the word embedding, when they own an fp32-or-wider ``main_grad`` and the DDP does not
overlap its all-reduce with the backward):

- a linear's fp32 weight gradient is ``addmm``-ed into ``main_grad`` while that buffer is still zero this
  step (its first micro-batch); after that (and for bf16 weights) it is computed as before and added in the
  backward, so the sum keeps today's order (a GEMM into a nonzero buffer rounds differently);
- the embedding adds the step's rows into ``main_grad`` with ``index_add_`` (duplicate tokens summed first,
  in token order, by torch's own ``embedding_dense_backward`` over the distinct ids), never a dense
  [vocab, hidden] gradient;
- a tied embedding and head on one stage: the head's gradient first, then the embedding's rows, as
  autograd summed them before (``m + (head + embedding)``: a pending head gradient waits for the rows
  after the first micro-batch).

Both return no weight gradient, so nothing reaches ``param.grad`` and Megatron's DDP hook has nothing to
add. The results are the same bits as without the fusion (a GEMM into a zeroed buffer equals the plain
GEMM; IEEE addition commutes; bf16 weights take the second path throughout), checked on CPU by
tests/distributed/_mca_workers/wgrad_checks.py (run by tests/unit/test_mca_platform.py); on a GPU without Apex
(cuBLAS) that equality is not yet measured. Not fused: sequence parallelism's linears, ``overlap_grad_reduce``,
frozen weights, ``deterministic_mode``'s lookup.
``backends.mca.platform`` applies the patch; ``backends.mca.trainer.optim.wrap_ddp`` tags the parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

TAG = "wgrad_into_main_grad"
"""Parameter attribute: its weight gradient goes into ``main_grad`` inside the backward."""
SHARED = "wgrad_shared_with_head"
"""Parameter attribute: a word embedding whose weight the output layer on this stage uses too."""
PENDING = "_pending_head_wgrad"

_original_linear = None
_original_embedding_forward = None


def fusable(weight: torch.Tensor) -> bool:
    return getattr(weight, TAG, False) and torch.is_grad_enabled()


def _main_grad_is_zero(weight: torch.Tensor) -> bool:
    """Nothing was written into ``main_grad`` since ``zero_grad_buffer`` (which resets the flag)."""
    return not weight.grad_added_to_main_grad


class _LinearWgradIntoMainGrad(torch.autograd.Function):
    """Megatron's ``LinearWithGradAccumulationAndAsyncCommunication`` without sequence parallelism or
    deferred wgrad, the weight gradient going into ``weight.main_grad``."""

    @staticmethod
    def forward(ctx, input, weight, bias, allreduce_dgrad, tp_group):
        ctx.save_for_backward(input, weight)
        ctx.use_bias = bias is not None
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.tp_group = tp_group
        output = torch.matmul(input, weight.t())
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    def backward(ctx, grad_output):
        from megatron.core.utils import prepare_input_tensors_for_wgrad_compute

        input, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)
        handle = None
        if ctx.allreduce_dgrad:
            handle = torch.distributed.all_reduce(grad_input, group=ctx.tp_group, async_op=True)
        grad_output, input = prepare_input_tensors_for_wgrad_compute(grad_output, input)
        accumulate_linear_wgrad(weight, grad_output, input)
        grad_bias = grad_output.sum(dim=0) if ctx.use_bias else None
        if handle is not None:
            handle.wait()
        return grad_input, None, grad_bias, None, None


def accumulate_linear_wgrad(weight, grad_output, input) -> None:
    """``main_grad += grad_output^T @ input`` ([out, tokens] x [tokens, in]) in today's rounding."""
    main_grad = weight.main_grad
    if _main_grad_is_zero(weight) and main_grad.dtype == grad_output.dtype == input.dtype == torch.float32:
        torch.addmm(main_grad, grad_output.t(), input, out=main_grad)  # 0 + G: the GEMM's own bits
    else:
        wgrad = grad_output.t().matmul(input)
        if getattr(weight, SHARED, False):
            if PENDING in weight.__dict__:  # the head used twice in one backward: both wait for the rows
                wgrad = weight.__dict__[PENDING].add_(wgrad)
            weight.__dict__[PENDING] = wgrad  # the embedding adds its rows, then the sum goes in
        else:
            main_grad.add_(wgrad)
    weight.grad_added_to_main_grad = True


class _EmbeddingWgradIntoMainGrad(torch.autograd.Function):
    """``F.embedding`` whose weight gradient's rows are added into ``weight.main_grad``."""

    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.weight = weight  # not saved for backward: main_grad is read, the weight is not
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_output):
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        distinct, position = torch.unique(ids.reshape(-1), return_inverse=True)
        # [distinct ids, hidden]: the dense backward's rows, duplicates summed in token order as there
        rows = torch.ops.aten.embedding_dense_backward(grad_output, position.view_as(ids), distinct.numel(),
                                                       -1, False)
        pending = weight.__dict__.pop(PENDING, None)
        if pending is not None:  # head + embedding first, then into main_grad: autograd's order
            pending.index_add_(0, distinct, rows)
            weight.main_grad.add_(pending)
        else:
            weight.main_grad.index_add_(0, distinct, rows.to(weight.main_grad.dtype))
        weight.grad_added_to_main_grad = True
        return None, None


def linear_with_wgrad_into_main_grad(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                                     sequence_parallel, grad_output_buffer=None, wgrad_deferral_limit=0,
                                     async_grad_allreduce=None, tp_group=None):
    """Drop-in for megatron's ``linear_with_grad_accumulation_and_async_allreduce``: tagged weights go
    through ``_LinearWgradIntoMainGrad`` (not under sequence parallelism or deferred embedding wgrad)."""
    if fusable(weight) and not sequence_parallel and grad_output_buffer is None \
            and not gradient_accumulation_fusion:
        from megatron.core.utils import get_tensor_model_parallel_group_if_none

        tp_group = get_tensor_model_parallel_group_if_none(tp_group)
        return _LinearWgradIntoMainGrad.apply(input, weight, bias, allreduce_dgrad, tp_group)
    return _original_linear(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                            sequence_parallel, grad_output_buffer, wgrad_deferral_limit, async_grad_allreduce,
                            tp_group)


linear_with_wgrad_into_main_grad.warned = False  # megatron's function reads it off its module-level name


def vocab_parallel_embedding_forward(self, input_):
    """``VocabParallelEmbedding.forward`` with the lookup through ``_EmbeddingWgradIntoMainGrad`` for a
    tagged weight (megatron-core 0.16.1's forward otherwise, line for line)."""
    if not fusable(self.weight) or self.deterministic_mode:
        return _original_embedding_forward(self, input_)
    from megatron.core.tensor_parallel.mappings import (reduce_from_tensor_model_parallel_region,
                                                        reduce_scatter_to_sequence_parallel_region)

    if self.tp_group.size() > 1:
        input_mask = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
        masked_input = input_.clone() - self.vocab_start_index
        masked_input[input_mask] = 0
    else:
        masked_input = input_
    output_parallel = _EmbeddingWgradIntoMainGrad.apply(masked_input, self.weight)
    if self.tp_group.size() > 1:
        output_parallel[input_mask, :] = 0.0
    if self.reduce_scatter_embeddings:
        output_parallel = output_parallel.transpose(0, 1).contiguous()  # [b s h] --> [s b h]
        return reduce_scatter_to_sequence_parallel_region(output_parallel, group=self.tp_group)
    return reduce_from_tensor_model_parallel_region(output_parallel, group=self.tp_group)


def patch_wgrad_into_main_grad() -> None:
    global _original_linear, _original_embedding_forward
    from megatron.core.tensor_parallel import layers

    if _original_linear is None:
        _original_linear = layers.linear_with_grad_accumulation_and_async_allreduce
        _original_embedding_forward = layers.VocabParallelEmbedding.forward
    layers.linear_with_grad_accumulation_and_async_allreduce = linear_with_wgrad_into_main_grad
    layers.VocabParallelEmbedding.forward = vocab_parallel_embedding_forward


def fused_kernel_absent() -> bool:
    """Apex's ``fused_weight_gradient_mlp_cuda`` did not import (always so on CPU)."""
    from megatron.core.tensor_parallel import layers

    return not layers._grad_accum_fusion_available


def mark_params(ddp_chunks: list[torch.nn.Module]) -> int:
    """Tag the weights of the column/row-parallel linears and word embeddings of ``ddp_chunks`` (Megatron
    DDP modules) for the fusion, when it is applied and their DDP does not overlap the all-reduce (whose
    bucket waits for each parameter's hook, which a fused weight never reaches). Returns how many."""
    from megatron.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                      VocabParallelEmbedding)

    if _original_linear is None:
        return 0
    count = 0
    for chunk in ddp_chunks:
        if chunk.ddp_config.overlap_grad_reduce:
            continue
        for module in chunk.modules():
            if not isinstance(module, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
                continue
            weight = getattr(module, "weight", None)
            if weight is None or not weight.requires_grad or not hasattr(weight, "main_grad") \
                    or getattr(weight, TAG, False):
                continue
            # Megatron marks a weight shared by the embedding and the head of one stage (zero_out_wgrad);
            # the DDP hook then adds whatever still reaches param.grad, so nothing is lost either way.
            if getattr(weight, "zero_out_wgrad", False):
                setattr(weight, SHARED, True)
            weight.zero_out_wgrad = True
            setattr(weight, TAG, True)
            count += 1
    return count
