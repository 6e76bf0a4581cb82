"""The one shared sample order is the HF Trainer's: accelerate's seedable sampler, epoch after epoch, sharded
over data-parallel ranks as accelerate shards it, on the standard backend's sampler and the mca loop's plan.

The expected batches come from accelerate itself (``prepare_data_loader`` with ``use_seedable_sampler``, what
``Trainer.get_train_dataloader`` builds around its ``RandomSampler``) and from torch's seeded ``randperm``
written out here, never from roll.data.order.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler

from backends.mca.trainer.data import BatchPlan
from roll.data.order import EpochSampler, SampleOrder


def _accelerate_batches(num_samples, micro, dp, rank, seed, epoch, sampler=None):
    """Rank ``rank``'s per-device batches in epoch ``epoch``, as HF's Trainer gets them from accelerate."""
    from accelerate.data_loader import prepare_data_loader

    data = list(range(num_samples))
    loader = DataLoader(data, batch_size=micro, sampler=sampler or RandomSampler(data))
    loader = prepare_data_loader(loader, num_processes=dp, process_index=rank, put_on_device=False,
                                 use_seedable_sampler=True, data_seed=seed)
    loader.set_epoch(epoch)
    return [batch.tolist() for batch in loader]


def _randperm(num_samples, seed):
    generator = torch.Generator()
    generator.manual_seed(seed)
    return torch.randperm(num_samples, generator=generator).tolist()


def test_the_docstring_example_is_torchs_seeded_randperm():
    assert SampleOrder(seed=0).indices(5, epoch=0) == _randperm(5, 0) == [4, 0, 1, 3, 2]
    assert SampleOrder(seed=0).indices(5, epoch=1) == _randperm(5, 1) == [0, 4, 2, 3, 1]
    assert SampleOrder(seed=0, shuffle=False).indices(5, epoch=1) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("micro, grad_accum, dp", [(2, 1, 1), (2, 2, 1), (1, 2, 2), (2, 3, 2)])
def test_both_backends_draw_accelerates_batches_epoch_after_epoch(micro, grad_accum, dp):
    """Standard (EpochSampler through accelerate) and mca (BatchPlan) give every rank the batches HF's own
    RandomSampler gets from accelerate, for 3 epochs; the rows of each optimizer step are the epoch's
    randperm positions [k*B, (k+1)*B)."""
    seed, per_step = 7, micro * grad_accum * dp
    num_samples = 2 * per_step  # whole steps: accelerate repeats rows at an uneven end, see the test below
    for epoch in range(3):
        perm = _randperm(num_samples, seed + epoch)
        for rank in range(dp):
            expected = _accelerate_batches(num_samples, micro, dp, rank, seed, epoch)
            standard = _accelerate_batches(num_samples, micro, dp, rank, seed, epoch,
                                           sampler=EpochSampler(num_samples, SampleOrder(seed)))
            plan = BatchPlan(micro, grad_accum, dp, rank, order=SampleOrder(seed))
            mca = [m for step in range(2) for m in plan.micro_batch_indices(2 * epoch + step, num_samples)]
            assert standard == expected and mca == expected, (epoch, rank)
        for step in range(2):
            rows = SampleOrder(seed).step_rows(2 * epoch + step, per_step, num_samples)
            assert rows == perm[step * per_step:(step + 1) * per_step]


def test_an_uneven_epoch_end_trains_what_is_left():
    """One rank: the epoch's last step takes the permutation's last rows (mca fills the rest of its slots with
    rows that train nothing), then the next epoch starts a new permutation."""
    num_samples, seed = 10, 3
    expected = _accelerate_batches(num_samples, 4, 1, 0, seed, 0) + _accelerate_batches(num_samples, 4, 1, 0, seed, 1)
    plan = BatchPlan(4, 1, order=SampleOrder(seed))
    mca = [[i for i in m if i is not None] for step in range(6) for m in plan.micro_batch_indices(step, num_samples)]
    assert mca == expected and mca[2] == _randperm(10, seed)[8:]


def test_shuffle_false_and_data_seed():
    config = type("C", (), {})()
    config.training = type("T", (), {"seed": 1, "data_seed": None})()
    config.data = type("D", (), {"shuffle": True, "streaming": False})()
    assert SampleOrder.from_config(config) == SampleOrder(1)
    config.training.data_seed = 5
    assert SampleOrder.from_config(config) == SampleOrder(5)
    config.data.streaming = True  # a stream is read forward, in its shuffle buffer's order
    assert SampleOrder.from_config(config) == SampleOrder(5, shuffle=False)
    expected = _accelerate_batches(6, 2, 1, 0, 0, 0, sampler=torch.utils.data.SequentialSampler(range(6)))
    assert [m for s in range(3) for m in BatchPlan(2, 1, order=SampleOrder(0, False)).micro_batch_indices(s, 6)] \
        == expected == [[0, 1], [2, 3], [4, 5]]


def test_a_resumed_epoch_keeps_its_order_on_every_rank():
    """HF's Trainer resumes inside epoch 1 with accelerate's skip_first_batches, then set_epoch(1): rank 1 of
    2 must read epoch 1's batches (it read epoch 0's before the standard backend wired its sampler as accelerate
    wires its own)."""
    from accelerate.data_loader import prepare_data_loader, skip_first_batches

    from backends.standard.trainers import epoch_reaches_sampler

    data, seed = list(range(12)), 3
    for dp, rank in ((1, 0), (2, 0), (2, 1)):
        expected = _accelerate_batches(12, 2, dp, rank, seed, epoch=1)[1:]
        loader = DataLoader(data, batch_size=2, sampler=EpochSampler(12, SampleOrder(seed)))
        loader = epoch_reaches_sampler(prepare_data_loader(loader, num_processes=dp, process_index=rank,
                                                           put_on_device=False))
        resumed = skip_first_batches(loader, 1)
        resumed.set_epoch(1)  # what Trainer._inner_training_loop calls (and on the wrapped batch sampler)
        wrapped = getattr(resumed.batch_sampler, "batch_sampler", None)
        if hasattr(wrapped, "set_epoch"):
            wrapped.set_epoch(1)
        assert [batch.tolist() for batch in resumed] == expected, (dp, rank)
