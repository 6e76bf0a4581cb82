"""The one shared sample order (DESIGN.md section 3): the HF Trainer's, on both backends.

LLaMA-Factory trains with the HF Trainer, whose training sampler is torch's ``RandomSampler``, which
accelerate (``use_seedable_sampler``, on by default) replaces with its ``SeedableRandomSampler``: in epoch
``e`` it yields ``torch.randperm(N, generator=g)`` with ``g`` seeded ``data_seed + e`` (``data_seed``
defaults to ``seed``: the Trainer seeds torch with it before building the sampler). accelerate then hands
per-device batch ``j`` of that permutation to data-parallel rank ``j % dp``, and the Trainer accumulates
``gradient_accumulation_steps`` of them per optimizer step, so global step ``k`` of an epoch trains the
permutation's positions ``[k*B, (k+1)*B)`` with ``B = micro_batch * grad_accum * dp``
(``roll.reliability.global_batch_samples``).

``SampleOrder`` is that permutation, written once: the standard backend's Trainer draws its batches through
``EpochSampler`` (the sampler HF's ``_get_train_sampler`` returns), the mca loop maps its step positions
through ``SampleOrder.indices``. With ``shuffle: false`` (LLaMA-Factory's ``disable_shuffling``) every epoch
is the dataset's own order (HF's ``SequentialSampler``). The dataset itself is left in the pipeline's order
(sources, ``max_samples``' first rows, the mix, the ``val_size`` split), as LLaMA-Factory hands it to the
Trainer.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Iterator

import torch
from torch.utils.data import Sampler


@dataclass(frozen=True)
class SampleOrder:
    """Which dataset row sits at each position of each epoch.

    Example (what accelerate's seedable sampler yields for 5 rows, seed 0)::

        SampleOrder(seed=0).indices(5, epoch=0) -> [4, 0, 1, 3, 2]   (torch.randperm(5), generator seeded 0)
        SampleOrder(seed=0).indices(5, epoch=1) -> [0, 4, 2, 3, 1]   (seeded 0 + 1)
        SampleOrder(seed=0, shuffle=False).indices(5, epoch=1) -> [0, 1, 2, 3, 4]
    """

    seed: int
    shuffle: bool = True

    @classmethod
    def from_config(cls, config) -> "SampleOrder":
        """The run's order: ``data_seed`` (else ``seed``) and ``shuffle``, as the HF Trainer reads them. A
        stream (``streaming``) is read forward, in the order its shuffle buffer drew (roll.data.streaming)."""
        training = config.training
        seed = training.data_seed if training.data_seed is not None else training.seed
        return cls(seed=seed, shuffle=config.data.shuffle and not config.data.streaming)

    def indices(self, num_samples: int, epoch: int) -> list[int]:
        """The dataset rows of epoch ``epoch`` (0-based), in training order."""
        if not self.shuffle:
            return list(range(num_samples))
        return _permutation(num_samples, self.seed + epoch)

    def step_rows(self, step: int, global_batch_size: int, num_samples: int) -> list[int]:
        """The dataset rows global step ``step`` (0-based) trains on all ranks: its epoch's positions
        ``roll.reliability.global_batch_samples`` through that epoch's order."""
        from roll.reliability import global_batch_samples

        epoch = step // max(1, math.ceil(num_samples / global_batch_size))
        rows = self.indices(num_samples, epoch)
        return [rows[i] for i in global_batch_samples(step, global_batch_size, num_samples)]


@functools.lru_cache(maxsize=2)
def _permutation(num_samples: int, seed: int) -> list[int]:
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    return torch.randperm(num_samples, generator=generator).tolist()


class EpochSampler(Sampler[int]):
    """A ``torch.utils.data.Sampler`` over ``SampleOrder``: the standard backend's training sampler.

    HF's Trainer calls ``set_epoch(e)`` through accelerate's data loader at the start of every epoch (and of
    a resumed one), as it does for accelerate's own seedable sampler; accelerate shards the batches over the
    data-parallel ranks after it.
    """

    def __init__(self, num_samples: int, order: SampleOrder) -> None:
        self.num_samples, self.order, self.epoch = num_samples, order, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        yield from self.order.indices(self.num_samples, self.epoch)

    def __len__(self) -> int:
        return self.num_samples
