"""One loss arithmetic for both backends (DESIGN.md section 1): per-token log-probabilities and their sums.

Both backends compute every pt/sft token loss and every DPO log-probability with these functions, so the
same logits give the same numbers on both, and the number logged is the number optimised.

- **Per token**: ``log p(label) = (x_label - m) - log(sum_v exp(x_v - m))`` in float32 (logits of lower
  precision are upcast, float64 stays float64), ``m`` the row's largest logit, the sum a tree reduction
  (``Tensor.sum``). These are the steps of Megatron's vocab-parallel cross entropy (max, subtract, exp, sum,
  log); with tensor parallelism the mca backend runs this same kernel on its vocabulary shard, the max and
  the sums all-reduced over the shards. ``F.cross_entropy`` in float32 (what a Hugging Face model's own
  loss calls) accumulates its log-sum-exp less carefully: on a real 255-token sample of SmolLM2-135M, 5.7e-6
  relative off a float64 reference, against 2e-8 for this arithmetic; trained models' peaked distributions
  are where that shows.
- **Memory and time** (``_TokenLogProbs``): one pass over the logits in chunks of rows, each upcast and
  exponentiated on its own, and a backward that recomputes ``exp(x - m)`` per chunk and writes the
  gradient into the logits' memory: besides the logits (and the gradient where they cannot be
  overwritten) no ``[tokens, vocab]`` tensor is kept or built, only chunks of one, where autograd over
  the same expression keeps two float32 ones (``x - m``, ``exp(x - m)``) and builds three more in the
  backward. Same numbers, to the bit, as that autograd expression.
- **Sums**: token log-probabilities are summed in float64 (a row's sum for DPO, a micro-batch's for pt/sft),
  so the sum's error does not grow with the number of tokens; the global per-token mean divides the float64
  sum by the global batch's trainable tokens (the contract's count).

Labels are aligned with the logits passed in (the caller shifts); ``IGNORE_INDEX`` positions get 0.
"""

from __future__ import annotations

import torch

from roll import IGNORE_INDEX


def token_log_probs(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int | None = None, *,
                    group=None, first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_probs, mask)``: float32 log-probability of each label under ``logits [..., V]`` (0 where the
    label is IGNORE_INDEX) and the mask of trainable labels, both of ``labels``' shape ``[...]``.

    Columns ``>= vocab_size`` (a padded vocabulary; default: none) are left out of the softmax. With a
    process ``group`` the logits are this rank's slice of a vocabulary split over it, starting at column
    ``first`` (tensor parallelism). The backward may write the gradient into the logits (``_TokenLogProbs``).
    """
    mask = labels != IGNORE_INDEX
    vocab = logits.shape[-1] + first if vocab_size is None else vocab_size
    log_probs = _TokenLogProbs.apply(logits, labels.masked_fill(~mask, 0), vocab, first, group)
    return log_probs.masked_fill(~mask, 0.0), mask


def loss_sum(log_probs: torch.Tensor) -> torch.Tensor:
    """The float64 sum of the token losses (``-log_probs``, masked positions 0) of a micro-batch."""
    return -log_probs.double().sum()


def sequence_sums(log_probs: torch.Tensor) -> torch.Tensor:
    """Each row's log-probability ``[rows]``, summed in float64 (``log_probs [rows, s]``): the DPO policy and
    reference log-probs; the DPO loss is taken in float64 from them."""
    return log_probs.double().sum(dim=-1)


def causal_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``token_log_probs`` of a causal LM batch with HF-aligned ``labels [b, s]`` (position ``t``'s logits
    ``[b, s, V]`` predict label ``t + 1``: shifted here, once), ``[b, s - 1]`` each. The labels move, not the
    logits: a ``logits[:, :-1]`` slice is not one block of memory, and the kernel would copy it."""
    shifted = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], dim=1)
    log_probs, mask = token_log_probs(logits, shifted)
    return log_probs[:, :-1], mask[:, :-1]


def causal_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(float64 token-loss sum, trainable tokens)`` of a causal LM batch (``causal_log_probs``)."""
    log_probs, mask = causal_log_probs(logits, labels)
    return loss_sum(log_probs), mask.sum()


def chosen_sft_losses(chosen_logps: torch.Tensor, chosen_tokens: torch.Tensor) -> torch.Tensor:
    """DPO's ``pref_ftx`` term of each pair ``[pairs]``: the chosen response's mean per-token negative
    log-likelihood, ``-chosen_logps / chosen_tokens`` (its log-prob sum over its response tokens; 0 for a pair
    without any). Both backends add ``pref_ftx`` times it to each pair's preference loss before the mean over
    pairs: LLaMA-Factory's ``ftx_gamma * sft_loss``, the same for every ``pref_loss`` (TRL's ``sft`` loss type
    instead averages over the micro-batch's chosen tokens, which weights long responses more)."""
    return -chosen_logps / chosen_tokens.clamp(min=1).to(chosen_logps.dtype)


def load_balancing_loss(router_logits: list[torch.Tensor], top_k: int, valid: torch.Tensor | None) -> torch.Tensor:
    """The MoE load-balancing loss of one micro-batch, before its coefficient: Megatron-Core's ``aux_loss``
    (the Switch Transformer loss of each MoE layer, summed over the layers), float32.

    For each layer's router logits ``[tokens, E]``: ``p = softmax(logits)``, the top-``top_k`` experts of each
    token by ``p``, and ``E / (top_k * T^2) * sum_e (sum_t p_te) * (tokens routed to e)`` over the ``T`` tokens
    where ``valid [tokens]`` is true (None: all). A balanced router gives 1 per layer. Hugging Face's MoE models
    pool all layers into one such sum without the ``1 / top_k``; a pipeline stage cannot compute that pooled
    loss (it holds only its layers), so both backends take this per-layer one (docs/mca-training.md)."""
    total = torch.zeros((), dtype=torch.float32, device=router_logits[0].device)
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        routed = torch.zeros_like(probs).scatter(1, probs.topk(top_k, dim=-1).indices, 1.0)
        if valid is not None:
            routed, probs = routed * valid.unsqueeze(-1), probs * valid.unsqueeze(-1)
        tokens = (routed.sum() / top_k).clamp(min=1)  # a micro-batch of padding only: 0, not 0 / 0
        total = total + (probs.sum(0) * routed.sum(0)).sum() * (logits.shape[-1] / (top_k * tokens * tokens))
    return total


CHUNK_ELEMENTS = 1 << 24
"""Logit elements per chunk (64 MB in float32; 110 rows at a 151,936 vocabulary): the float32 temporaries
stay this small whatever the batch. Not smaller: every operation on a chunk is a parallel region whose
threads wait for each other, which costs most on a shared machine (``scripts/profile_loss.py``: under a
load of ~30 on 2 cores, 1 << 22 took 1.3x ``F.cross_entropy``'s time and 1 << 24 0.9x)."""


class _TokenLogProbs(torch.autograd.Function):
    """``log p(label)`` of each row of ``logits [..., V]``, in chunks of rows, with a hand-written backward.

    Autograd over the unfused expression keeps ``x - m`` and ``exp(x - m)`` ([tokens, V] float32) for the
    backward and builds three more such tensors in it. This keeps only the logits (which the caller holds
    anyway) and per row ``m`` and ``sum``, upcasts and exponentiates ``CHUNK_ELEMENTS`` at a time, and
    recomputes ``exp(x - m)`` chunk by chunk in the backward. The arithmetic is the unfused expression's,
    element for element, forward and backward: ``grad = exp(x - m) * (-g / sum)``, plus ``g`` at the label.
    When the logits are an intermediate result (a model's output, not a leaf tensor or a view of one), the
    gradient is written into their memory, as Megatron's kernel does: nothing may read them after the backward
    (autograd refuses a second backward through them).

    Columns ``>= vocab`` hold no token: they are left out of the softmax, and their gradient is 0. With a
    ``group`` the columns are this rank's slice, from column ``first``, of a vocabulary split over the group:
    the max and the two per-row sums (label logit, ``sum``) are all-reduced, two collectives per call.
    """

    @staticmethod
    def forward(ctx, logits, labels, vocab, first, group):
        flat = logits.reshape(-1, logits.shape[-1])  # a view unless the logits are a strided slice
        width = max(0, min(flat.shape[1], vocab - first))
        local = labels.reshape(-1) - first
        here = (local >= 0) & (local < width)
        local = local.masked_fill(~here, 0)
        dtype = torch.promote_types(flat.dtype, torch.float32)  # bf16 / fp16 upcast, a chunk at a time
        row_max = torch.full((flat.shape[0],), float("-inf"), device=flat.device, dtype=dtype)
        sums = torch.zeros(2, flat.shape[0], device=flat.device, dtype=dtype)  # [x_label - max, sum of exp]
        chunks = _row_chunks(flat) if width else []
        if group is not None:  # the global max first: every rank shifts by it
            for rows in chunks:
                row_max[rows] = flat[rows, :width].amax(dim=-1).to(dtype)
            torch.distributed.all_reduce(row_max, torch.distributed.ReduceOp.MAX, group=group)
        for rows in chunks:
            x = flat[rows, :width]
            if group is None:  # max, shift, exp and sum while the chunk is in cache
                row_max[rows] = x.amax(dim=-1).to(dtype)
            shifted = _shifted(x, row_max[rows, None], out=None)
            sums[0, rows] = shifted.gather(-1, local[rows, None]).squeeze(-1).masked_fill(~here[rows], 0)
            sums[1, rows] = shifted.exp_().sum(dim=-1)
        if group is not None:
            torch.distributed.all_reduce(sums, group=group)
        ctx.save_for_backward(flat, local, here, row_max, sums[1])
        base = logits if logits._base is None else logits._base
        ctx.overwrite = base.grad_fn is not None or flat.data_ptr() != logits.data_ptr()
        ctx.width, ctx.shape = width, logits.shape
        return (sums[0] - sums[1].log()).view(labels.shape)

    @staticmethod
    def backward(ctx, grad):
        flat, local, here, row_max, row_sum = ctx.saved_tensors
        width = ctx.width
        out = flat if ctx.overwrite else torch.empty_like(flat)
        out[:, width:] = 0
        grad = grad.reshape(-1)
        scale = grad.neg() / row_sum
        grad = grad.masked_fill(~here, 0)
        in_place = out.dtype == row_max.dtype  # float32 logits: the gradient is computed in their memory
        for rows in _row_chunks(flat) if width else []:
            part = out[rows, :width]
            shifted = _shifted(flat[rows, :width], row_max[rows, None], out=part if in_place else None)
            shifted.exp_().mul_(scale[rows, None]).scatter_add_(-1, local[rows, None], grad[rows, None])
            if not in_place:
                part.copy_(shifted)
        return out.view(ctx.shape), None, None, None, None


def _shifted(x: torch.Tensor, row_max: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``x - row_max`` in ``row_max``'s dtype: lower-precision logits are upcast into one new chunk."""
    if x.dtype == row_max.dtype:
        return torch.sub(x, row_max, out=out) if out is not None else x - row_max
    return x.to(row_max.dtype).sub_(row_max)


def _row_chunks(flat: torch.Tensor) -> list[slice]:
    step = max(1, CHUNK_ELEMENTS // flat.shape[1])
    return [slice(start, start + step) for start in range(0, flat.shape[0], step)]


def router_z_loss(router_logits: list[torch.Tensor], valid: torch.Tensor | None) -> torch.Tensor:
    """The MoE router z-loss of one micro-batch, before its coefficient: Megatron-Core's ``z_loss_func``
    (ST-MoE) of each MoE layer, summed over the layers, float32.

    For each layer's router logits ``[tokens, E]``: the mean of ``logsumexp(logits)^2`` over the tokens where
    ``valid [tokens]`` is true (None: all); a micro-batch of padding only gives 0."""
    total = torch.zeros((), dtype=torch.float32, device=router_logits[0].device)
    for logits in router_logits:
        values = torch.logsumexp(logits.float(), dim=-1).square()
        if valid is None:
            total = total + values.mean()
        else:
            total = total + (values * valid).sum() / valid.sum().clamp(min=1)
    return total
