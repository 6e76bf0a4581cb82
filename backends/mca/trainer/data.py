"""The one shared sample order (DESIGN.md section 3), sharded over data-parallel ranks as micro-batches.

Both backends train epoch ``e`` in the order ``roll.data.order.SampleOrder`` gives (the permutation the HF
Trainer's seeded sampler draws, seeded ``data_seed`` else ``seed``, plus ``e``; the dataset's own order with
``shuffle: false``). An epoch is ``ceil(N / B)`` optimizer steps with ``B = micro_batch * grad_accum * dp``;
its step ``j`` consumes the epoch's positions ``[j*B, (j+1)*B)`` (the last step of an epoch takes what is
left, as Hugging Face's Trainer does without ``dataloader_drop_last``). Inside a step, micro-batch ``m`` of
data-parallel rank ``r`` is slice ``m * dp + r`` of those positions: the split accelerate makes on the
standard backend, so both backends also pad the same rows together. Slots past the end of the data
are filled with a two-token row that trains nothing, so every rank runs the same number of
micro-batches. The step number is the only state, so a resumed run continues exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from roll import IGNORE_INDEX
from roll.data.collators import cu_seqlens_from_positions
from roll.data.order import SampleOrder
from roll.data.policy import PAIR_PREFIXES
from roll.reliability import global_batch_samples


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step's samples are split into this rank's micro-batches."""

    micro_batch_size: int
    grad_accum: int
    dp_size: int = 1
    dp_rank: int = 0
    order: SampleOrder | None = None
    """Which row sits at each position of an epoch; None: the dataset's own order (evaluation)."""

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.grad_accum * self.dp_size

    def steps_per_epoch(self, num_samples: int) -> int:
        return max(1, math.ceil(num_samples / self.global_batch_size))

    def micro_batch_indices(self, step: int, num_samples: int) -> list[list[int | None]]:
        """Dataset indices of this rank's micro-batches in global step ``step`` (0-based); None marks
        a slot past the end of the epoch.

        Example: micro_batch_size 2, grad_accum 2, dp 2, dp_rank 1, 10 samples (2 steps an epoch), no
        ``order`` (with one, each position ``i`` becomes the epoch's row ``order.indices(10, epoch)[i]``)::

            micro_batch_indices(0, 10) -> [[2, 3], [6, 7]]
            micro_batch_indices(1, 10) -> [[None, None], [None, None]]   (samples 8, 9 are rank 0's)
            micro_batch_indices(2, 10) -> [[2, 3], [6, 7]]               (the next epoch)
        """
        start = self.step_samples(step, num_samples).start
        rows = (range(num_samples) if self.order is None
                else self.order.indices(num_samples, step // self.steps_per_epoch(num_samples)))
        out = []
        for m in range(self.grad_accum):
            first = start + (m * self.dp_size + self.dp_rank) * self.micro_batch_size
            out.append([rows[i] if i < num_samples else None for i in range(first, first + self.micro_batch_size)])
        return out

    def step_samples(self, step: int, num_samples: int) -> range:
        """Dataset indices global step ``step`` consumes on all ranks (the one rule both backends follow)."""
        return global_batch_samples(step, self.global_batch_size, num_samples)

    def step_rows(self, step: int, num_samples: int) -> list[int]:
        """Dataset rows global step ``step`` trains on all ranks (the positions through ``order``)."""
        if self.order is None:
            return list(self.step_samples(step, num_samples))
        return self.order.step_rows(step, self.global_batch_size, num_samples)

    def samples_in_step(self, step: int, num_samples: int) -> int:
        """Real samples global step ``step`` consumes on all ranks (fewer at an epoch's end)."""
        return len(self.step_samples(step, num_samples))

    def total_steps(self, max_steps: int, num_train_epochs: float, num_samples: int) -> int:
        """``max_steps`` when positive, else ``num_train_epochs`` epochs."""
        if max_steps > 0:
            return max_steps
        return max(1, math.ceil(num_train_epochs * self.steps_per_epoch(num_samples)))


def filler_row(example: dict[str, Any], pad_token_id: int) -> dict[str, Any]:
    """A two-token row shaped like ``example`` that trains nothing (all labels IGNORE_INDEX, no attention).

    Example (``pad_token_id=0``)::

        filler_row({"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "labels": [-100, 6, 7]}, 0)
        -> {"input_ids": [0, 0], "attention_mask": [0, 0], "labels": [-100, -100]}
    """
    fill = {"input_ids": [pad_token_id] * 2, "attention_mask": [0, 0], "labels": [IGNORE_INDEX] * 2,
            "position_ids": [0, 1], "images": []}  # a vision-language row's images (docs/vl.md): none
    out = {}
    for key, value in example.items():
        base = next((key[len(p):] for p in PAIR_PREFIXES if key.startswith(p)), key)
        if base in fill:
            out[key] = fill[base]
        elif key == "seq_lens":  # packed rows list their samples' lengths
            out[key] = None if value is None else [2]
        else:
            out[key] = value
    return out


def collate_step(dataset, collator: Callable[[list[dict]], dict], indices: list[list[int | None]],
                 pad_token_id: int) -> list[dict]:
    """Collate each micro-batch of ``indices`` from ``dataset``; None slots become filler rows."""
    filler = filler_row(dataset[0], pad_token_id)
    return [collator([dataset[i] if i is not None else filler for i in micro]) for micro in indices]


def pad_to_length(batch: dict[str, torch.Tensor], length: int, pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad every ``[B, L]`` key of a collated batch to ``length`` (the padding trains nothing).

    Pipeline parallelism sends activations of one fixed shape per step, so every micro-batch of a
    step gets the same length. A packed batch's padding tail restarts its positions at 0 (a segment
    of its own) and its ``cu_seqlens`` are rebuilt.
    """
    current = batch["input_ids"].shape[-1]
    if current == length:
        return batch
    extra = length - current
    fill = {"input_ids": pad_token_id, "labels": IGNORE_INDEX, "attention_mask": 0}
    out = dict(batch)
    for key, value in fill.items():
        if key in batch:
            out[key] = torch.nn.functional.pad(batch[key], (0, extra), value=value)
    if "position_ids" in batch:
        tail = torch.arange(extra).expand(batch["position_ids"].shape[0], -1)
        out["position_ids"] = torch.cat([batch["position_ids"], tail], dim=-1)
    if "cu_seqlens" in batch:
        out["cu_seqlens"] = cu_seqlens_from_positions(out["position_ids"])
    return out


LOSS_INPUTS = ("labels", "ref_logps", "kto_tags", "kto_kl")
"""Micro-batch keys only the loss function reads: never handed to the model. ``kto_tags`` (one label per
sample, stage kto) passes from the collated batch through ``model_inputs``."""


def model_inputs(batch: dict[str, torch.Tensor], device: torch.device, cp_size: int = 1,
                 cp_rank: int = 0, *, moe: bool = False, vision: dict | None = None) -> dict[str, Any]:
    """A collated (shifted) batch -> GPTModel keyword inputs for this context-parallel rank.

    - plain rows ``[B, L]``: causal attention needs no mask (right padding is never attended to by
      a real token); positions ``0..L-1``;
    - packed rows (``cu_seqlens``): the batch becomes one THD stream ``[1, B*L]`` with
      ``PackedSeqParams`` (every packed sample its own causal segment);
    - context parallelism: every sequence (every packed segment) is cut into ``2 * cp`` chunks and
      this rank keeps chunks ``cp_rank`` and ``2*cp-1-cp_rank`` (Megatron's load balancing);
    - ``padding_mask`` (true at padding, from ``attention_mask``), for an MoE model (``moe``): its routers leave
      those tokens out of the load-balancing loss, as the standard backend does
      (``roll.loss.load_balancing_loss``). Not given for a micro-batch of padding only (a filler one at an
      uneven end), where Megatron's loss would divide by 0, nor to a dense model (nothing reads it; finding
      a filler batch is a host read);
    - ``vision`` (a vision-language model's HF config): its 3-D M-RoPE positions and the micro-batch's
      ``pixel_values`` / ``image_grid_thw`` (``backends.mca.vision.vision_inputs``).
    """
    from backends.mca.attention import cp_token_index

    input_ids, labels = batch["input_ids"], batch["labels"]
    padding = batch.get("attention_mask")
    padding = None if padding is None or not moe or not padding.any() else padding == 0
    params = None
    if "cu_seqlens" in batch:
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = batch["cu_seqlens"].to(torch.int32)
        input_ids, labels = input_ids.reshape(1, -1), labels.reshape(1, -1)
        padding = None if padding is None else padding.reshape(1, -1)
        position_ids = batch["position_ids"].reshape(1, -1)
        longest = int((cu[1:] - cu[:-1]).max())
        cu_dev = cu.to(device)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_dev, cu_seqlens_kv=cu_dev,
                                 cu_seqlens_q_padded=cu_dev, cu_seqlens_kv_padded=cu_dev,
                                 max_seqlen_q=longest, max_seqlen_kv=longest)
    else:
        length = input_ids.shape[-1]
        position_ids = torch.arange(length).expand(input_ids.shape[0], -1)
        cu = torch.tensor([0, length])
    index = None
    if cp_size > 1:
        index = cp_token_index(cu.long(), cp_size, cp_rank)
        input_ids, labels, position_ids = input_ids[:, index], labels[:, index], position_ids[:, index]
        padding = None if padding is None else padding[:, index]
    out = {"input_ids": input_ids.to(device), "position_ids": position_ids.to(device), "attention_mask": None,
           "labels": labels.to(device), "packed_seq_params": params,
           "padding_mask": None if padding is None else padding.to(device)}
    if "kto_tags" in batch:
        out["kto_tags"] = batch["kto_tags"].to(device)
    if vision is not None:
        from backends.mca.vision import vision_inputs

        out.update(vision_inputs(batch, vision, device, cp_index=index))
    return out
