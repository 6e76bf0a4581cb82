"""LocalCoreAttention: packed (THD) sequences and context parallelism against plain references.

``python platform_attention.py reference OUT``: one process (TP1, CP1) builds the tiny GPT, saves
its weights, the per-token loss and grads of a batch, and the per-token loss of a packed batch.
``torchrun --nproc_per_node=2 platform_attention.py cp2 OUT``: CP2 (plain and packed) loads those
weights and compares; then TP2 compares packed logits with per-sequence logits.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from platform_common import VOCAB, SEQ, batch, build_gpt, emit, tiny_config  # noqa: E402 (sets sys.path)

from backends.mca.attention import cp_token_index
from backends.mca.initialize import destroy_megatron, initialize_megatron
from roll.config.layout import ParallelLayout

PACKED_LENS = [8, 24]  # each divisible by 2 * cp = 4


def packed_batch(lens: list[int]):
    """One pack of len(lens) random sequences: tokens/labels/positions [1, t] and its PackedSeqParams."""
    from megatron.core.packed_seq_params import PackedSeqParams

    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen) for n in lens]
    tokens = torch.cat(seqs)[None]
    labels = torch.cat([torch.roll(s, -1) for s in seqs])[None]
    positions = torch.cat([torch.arange(n) for n in lens])[None]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens),
                             max_seqlen_kv=max(lens))
    return seqs, tokens, labels, positions, params


def reference(out: str) -> None:
    initialize_megatron(ParallelLayout(world_size=1), seed=1)
    model = build_gpt(tiny_config(), seed=1)
    torch.save(model.state_dict(), os.path.join(out, "weights.pt"))
    tokens, positions = batch()
    per_token = model(tokens, positions, None, labels=torch.roll(tokens, -1, 1))  # [b, s]
    per_token.mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    seqs, ptokens, plabels, ppos, params = packed_batch(PACKED_LENS)
    with torch.no_grad():
        packed_loss = model(ptokens, ppos, None, labels=plabels, packed_seq_params=params)
    torch.save({"per_token": per_token.detach(), "grads": grads, "packed_loss": packed_loss},
               os.path.join(out, "ref.pt"))
    emit(packed_vs_separate=packed_vs_separate(model))


def packed_vs_separate(model) -> float:
    """max |logits of the pack - logits of each sequence run alone| (TP-gathered), for a pack attended as one
    stream ([11, 21]: one window would not be smaller) and one attended in ``PackedWindows`` ([11, 21, 70, 40]:
    three windows of 70)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from backends.mca.attention import packed_windows

    worst = 0.0
    model.eval()
    for lens, windows in (([11, 21], None), ([11, 21, 70, 40], 3)):  # odd lengths are fine without CP
        seqs, tokens, _, positions, params = packed_batch(lens)
        assert getattr(packed_windows(params.cu_seqlens_q), "count", None) == windows, lens
        with torch.no_grad():
            packed = gather_from_tensor_model_parallel_region(model(tokens, positions, None, packed_seq_params=params))
            alone = [gather_from_tensor_model_parallel_region(model(s[None], torch.arange(len(s))[None], None))
                     for s in seqs]
        worst = max(worst, (packed - torch.cat(alone, dim=1)).abs().max().item())
    model.train()
    return worst


def cp2(out: str) -> dict:
    from megatron.core import parallel_state as ps

    initialize_megatron(ParallelLayout(world_size=2, cp=2), seed=1)
    group, rank = ps.get_context_parallel_group(), ps.get_context_parallel_rank()
    ref = torch.load(os.path.join(out, "ref.pt"))
    model = build_gpt(tiny_config(), seed=99)
    model.load_state_dict(torch.load(os.path.join(out, "weights.pt")))

    from megatron.core.utils import get_batch_on_this_cp_rank

    tokens, positions = batch()
    # Megatron's own CP split (not ours), so the attention's token layout is checked independently.
    local = get_batch_on_this_cp_rank({"tokens": tokens, "positions": positions, "labels": torch.roll(tokens, -1, 1)})
    per_token = model(local["tokens"], local["positions"], None, labels=local["labels"])
    per_token.mean().backward()
    full = _gather_tokens(per_token.detach(), torch.tensor([0, SEQ]), group)
    grads = {}
    for name, p in model.named_parameters():  # CP ranks' grads sum to the grad of the full-sequence loss
        g = p.grad.clone()
        dist.all_reduce(g, group=group)
        grads[name] = g / 2
    grad_diff = max((grads[n] - ref["grads"][n]).abs().max().item() for n in grads)

    _, ptokens, plabels, ppos, params = packed_batch(PACKED_LENS)
    pmine = cp_token_index(params.cu_seqlens_q.long(), 2, rank)
    with torch.no_grad():
        ploss = model(ptokens[:, pmine], ppos[:, pmine], None, labels=plabels[:, pmine], packed_seq_params=params)
    pfull = _gather_tokens(ploss, params.cu_seqlens_q.long(), group)
    destroy_megatron()
    return {"cp_loss_diff": (full - ref["per_token"]).abs().max().item(), "cp_grad_diff": grad_diff,
            "cp_packed_loss_diff": (pfull - ref["packed_loss"]).abs().max().item(),
            "max_grad": max(g.abs().max().item() for g in ref["grads"].values())}


def _gather_tokens(local: torch.Tensor, cu: torch.Tensor, group) -> torch.Tensor:
    """Per-token values [b, s_local] of every CP rank, put back in global token order [b, s]."""
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    index = torch.cat([cp_token_index(cu, len(parts), r) for r in range(len(parts))])
    full = torch.empty(local.shape[0], index.numel(), dtype=local.dtype)
    full[:, index] = torch.cat(parts, dim=1)
    return full


def tp2() -> float:
    initialize_megatron(ParallelLayout(world_size=2, tp=2), seed=1)
    diff = packed_vs_separate(build_gpt(tiny_config(), seed=1))
    destroy_megatron()
    return diff


if __name__ == "__main__":
    mode, out_dir = sys.argv[1], sys.argv[2]
    if mode == "reference":
        reference(out_dir)
    else:
        dist.init_process_group("gloo")
        emit(**cp2(out_dir), tp2_packed_vs_separate=tp2())
