"""torchrun worker: roll.loss's kernel with the vocabulary split over 2 ranks (tensor parallelism, gloo).

Each rank holds 8 columns of a vocabulary of 13 tokens padded to 16 (rank 1: 5 real columns, 3 of padding
at 1e4, which must not count), feeds its slice to ``roll.loss.token_log_probs(..., group=, first=)``, and
compares the log-probs and its slice of the gradient with float64 ``log_softmax`` over the 13 real columns.
Prints one ``RESULT {json}`` line per rank.
"""

from __future__ import annotations

import json


def main() -> None:
    import torch
    import torch.distributed as dist

    from roll import IGNORE_INDEX
    from roll import loss as roll_loss

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(3, 20, 16, generator=gen, dtype=torch.float64) * 3 + 20  # the same on both ranks
    full[..., 13:] = 1e4
    full = full.float().double()  # the reference sees the float32 logits the ranks see
    labels = torch.randint(0, 13, (3, 20), generator=gen)
    labels[0, :4] = IGNORE_INDEX
    weight = torch.randn(3, 20, generator=gen, dtype=torch.float64)

    roll_loss.CHUNK_ELEMENTS = 64  # several chunks of rows
    leaf = full[..., 8 * rank:8 * rank + 8].float().requires_grad_()
    ours, mask = roll_loss.token_log_probs(leaf * 1, labels, vocab_size=13, group=dist.group.WORLD,
                                           first=8 * rank)
    (ours * weight.float()).sum().backward()

    exact = full[..., :13].clone().requires_grad_()
    reference = exact.log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0].masked_fill(~mask, 0)
    (reference * weight).sum().backward()
    grad = torch.cat([exact.grad, torch.zeros(3, 20, 3, dtype=torch.float64)], -1)[..., 8 * rank:8 * rank + 8]
    result = {"rank": rank, "log_prob_error": (ours.double() - reference).abs().max().item(),
              "grad_error": (leaf.grad.double() - grad).abs().max().item(),
              "grad_scale": grad.abs().max().item(), "tokens": int(mask.sum()),
              "padding_grad_zero": bool((leaf.grad[..., max(0, 13 - 8 * rank):] == 0).all())}
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
