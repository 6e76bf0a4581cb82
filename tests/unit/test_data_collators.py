"""Collators and the label shift, checked on literal tensors (the docstring examples included)."""

from __future__ import annotations

import pytest
import torch

from roll import IGNORE_INDEX
from roll.data.collators import (PairwiseCollator, SequenceCollator, cu_seqlens_from_positions, shift_labels,
                                 target_length)
from roll.data.policy import PaddingPolicy

X = IGNORE_INDEX


def _lists(batch: dict) -> dict:
    return {k: v.tolist() for k, v in batch.items()}


SFT_ROWS = [{"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "labels": [X, 6, 7]},
            {"input_ids": [8, 9], "attention_mask": [1, 1], "labels": [X, 9]}]


def test_sequence_collator_docstring_example():
    assert _lists(SequenceCollator(pad_token_id=0)(SFT_ROWS)) == {
        "input_ids": [[5, 6, 7], [8, 9, 0]],
        "attention_mask": [[1, 1, 1], [1, 1, 0]],
        "labels": [[X, 6, 7], [X, 9, X]],
    }


def test_sequence_collator_returns_long_tensors():
    batch = SequenceCollator(pad_token_id=0)(SFT_ROWS)
    assert all(v.dtype == torch.long for v in batch.values())


def test_packed_docstring_example():
    policy = PaddingPolicy(pad_to_multiple_of=2, packing=True)
    batch = SequenceCollator(pad_token_id=0, policy=policy)(
        [{"input_ids": [5, 6, 7], "labels": [X, 6, X], "position_ids": [0, 1, 0]}])
    assert _lists(batch) == {"input_ids": [[5, 6, 7, 0]], "labels": [[X, 6, X, X]],
                             "position_ids": [[0, 1, 0, 1]], "cu_seqlens": [0, 2, 4]}
    assert batch["cu_seqlens"].dtype == torch.int32
    assert "attention_mask" not in batch


def test_pairwise_collator_docstring_example():
    row = {"chosen_input_ids": [5, 6, 7], "chosen_attention_mask": [1, 1, 1], "chosen_labels": [X, 6, 7],
           "rejected_input_ids": [5, 8], "rejected_attention_mask": [1, 1], "rejected_labels": [X, 8]}
    assert _lists(PairwiseCollator(pad_token_id=0)([row])) == {
        "input_ids": [[5, 6, 7], [5, 8, 0]],
        "attention_mask": [[1, 1, 1], [1, 1, 0]],
        "labels": [[X, 6, 7], [X, 8, X]],
    }


def test_pairwise_collator_stacks_all_chosen_before_all_rejected():
    rows = [{f"{side}_{key}": [i * 10 + (side == "rejected")] * 2 for side in ("chosen", "rejected")
             for key in ("input_ids", "attention_mask", "labels")} for i in range(1, 4)]
    ids = PairwiseCollator(pad_token_id=0)(rows)["input_ids"][:, 0].tolist()
    assert ids == [10, 20, 30, 11, 21, 31]


def test_pairwise_collator_refuses_packing():
    with pytest.raises(ValueError, match="packing"):
        PairwiseCollator(pad_token_id=0, policy=PaddingPolicy(packing=True))


def test_shift_labels_docstring_example_including_pairwise_keys():
    batch = {"input_ids": [5, 6, 7], "labels": [X, 6, 7], "chosen_attention_mask": [1, 1, 1]}
    assert shift_labels(batch) == {"input_ids": [5, 6], "labels": [6, 7], "chosen_attention_mask": [1, 1]}


def test_shift_labels_on_every_pairwise_key_and_leaves_others():
    batch = {f"{side}{key}": torch.tensor([[1, 2, 3]]) for side in ("", "chosen_", "rejected_")
             for key in ("input_ids", "attention_mask", "labels", "position_ids")}
    batch["cu_seqlens"] = torch.tensor([0, 3], dtype=torch.int32)
    out = shift_labels(batch)
    for key, value in out.items():
        if key == "cu_seqlens":
            assert value.tolist() == [0, 3]
        elif key.endswith("labels"):
            assert value.tolist() == [[2, 3]], key
        else:
            assert value.tolist() == [[1, 2]], key


def test_pad_to_max_length_with_shift_gives_max_length_after_shift():
    policy = PaddingPolicy(pad_to="max_length", max_length=6, shift_labels=True)
    batch = SequenceCollator(pad_token_id=0, policy=policy)(SFT_ROWS)
    # 7, the longest row's last token, stays only because of the padding: masked, as the unshifted batch of
    # length 3 (the standard backend's) leaves its last column out of the MoE losses; 9 is counted on both
    assert _lists(batch) == {
        "input_ids": [[5, 6, 7, 0, 0, 0], [8, 9, 0, 0, 0, 0]],
        "attention_mask": [[1, 1, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0]],
        "labels": [[6, 7, X, X, X, X], [9, X, X, X, X, X]],
    }


def test_pad_to_multiple_of():
    batch = SequenceCollator(pad_token_id=0, policy=PaddingPolicy(pad_to_multiple_of=4))(SFT_ROWS)
    assert batch["input_ids"].shape == (2, 4)
    policy = PaddingPolicy(pad_to_multiple_of=4, shift_labels=True)
    shifted = SequenceCollator(pad_token_id=0, policy=policy)(SFT_ROWS)
    assert shifted["input_ids"].shape == (2, 4)  # padded to 5, then the shift drops one
    assert shifted["labels"][0].tolist() == [6, 7, X, X]


@pytest.mark.parametrize("longest,policy,expected", [
    (5, PaddingPolicy(), 5),
    (5, PaddingPolicy(pad_to_multiple_of=4), 8),
    (5, PaddingPolicy(pad_to_multiple_of=4, shift_labels=True), 5),
    (6, PaddingPolicy(pad_to_multiple_of=4, shift_labels=True), 9),
    (3, PaddingPolicy(pad_to="max_length", max_length=8), 8),
    (3, PaddingPolicy(pad_to="max_length", max_length=6, pad_to_multiple_of=4), 8),
])
def test_target_length(longest, policy, expected):
    assert target_length(longest, policy) == expected


def test_row_longer_than_max_length_is_an_error():
    with pytest.raises(ValueError, match="max_length"):
        target_length(9, PaddingPolicy(pad_to="max_length", max_length=8))


def test_packed_shift_no_label_crosses_a_boundary():
    """Two packed samples [5, 6, 7] and [8, 9]: after the shift, the last position of sample one must
    not be trained to predict sample two's first token (its first label is IGNORE_INDEX)."""
    row = {"input_ids": [5, 6, 7, 8, 9], "labels": [X, 6, 7, X, 9], "position_ids": [0, 1, 2, 0, 1]}
    policy = PaddingPolicy(packing=True, shift_labels=True, pad_to_multiple_of=2)
    batch = SequenceCollator(pad_token_id=0, policy=policy)([row])
    # each sample padded to a multiple of 2 ([5, 6, 7, 0] [8, 9]), plus one position the shift drops
    assert _lists(batch) == {"input_ids": [[5, 6, 7, 0, 8, 9]], "labels": [[6, 7, X, X, 9, X]],
                             "position_ids": [[0, 1, 2, 3, 0, 1]], "cu_seqlens": [0, 4, 6]}


def test_cu_seqlens_over_several_rows():
    positions = torch.tensor([[0, 1, 0, 1, 2], [0, 1, 2, 3, 0]])
    assert cu_seqlens_from_positions(positions).tolist() == [0, 2, 5, 9, 10]


def test_packing_policy_synthesises_positions_for_unpacked_rows():
    batch = SequenceCollator(pad_token_id=0, policy=PaddingPolicy(packing=True))(SFT_ROWS)
    assert batch["position_ids"].tolist() == [[0, 1, 2], [0, 1, 0]]
    assert batch["cu_seqlens"].tolist() == [0, 3, 5, 6]


def test_shift_labels_on_a_tensor_batch_with_pair_keys():
    batch = {"input_ids": torch.tensor([[1, 2, 3]]), "labels": torch.tensor([[X, 2, 3]]),
             "rejected_labels": torch.tensor([[X, 4, 5]])}
    assert _lists(shift_labels(batch)) == {"input_ids": [[1, 2]], "labels": [[2, 3]], "rejected_labels": [[4, 5]]}


def test_tensor_rows_collate_like_list_rows():
    rows = [{k: torch.tensor(v) for k, v in row.items()} for row in SFT_ROWS]
    collate = SequenceCollator(pad_token_id=0)
    assert _lists(collate(rows)) == _lists(collate(SFT_ROWS))
    packed = [{"input_ids": torch.tensor([5, 6, 7]), "labels": torch.tensor([X, 6, X]),
               "position_ids": torch.tensor([0, 1, 0])}]
    batch = SequenceCollator(pad_token_id=0, policy=PaddingPolicy(packing=True))(packed)
    assert batch["position_ids"].tolist() == [[0, 1, 0]]


def test_packed_rows_with_packing_off_are_refused():
    row = {"input_ids": [5, 6, 7], "labels": [X, 6, X], "position_ids": [0, 1, 0], "seq_lens": [2, 1]}
    with pytest.raises(ValueError, match="packing off"):
        SequenceCollator(pad_token_id=0)([row])


@pytest.mark.parametrize("layout,dispatcher,expected", [
    (dict(), "alltoall", ("longest", 1)),
    (dict(tp=2), "alltoall", ("longest", 1)),                   # no SP: TP does not split the sequence
    (dict(tp=2, sequence_parallel=True), "alltoall", ("longest", 2)),
    (dict(cp=2), "alltoall", ("longest", 4)),
    (dict(tp=4, sequence_parallel=True, cp=3), "alltoall", ("longest", 12)),
    (dict(tp=2, ep=2), "alltoall", ("longest", 2)),             # SP forced on by the layout: TP multiple
    (dict(ep=2), "allgather", ("max_length", 1)),
    (dict(ep=2), "alltoall", ("longest", 1)),
])
def test_megatron_policy_from_layout(layout, dispatcher, expected):
    from roll.config.layout import ParallelLayout

    world = layout.get("tp", 1) * layout.get("cp", 1) * layout.get("ep", 1)
    policy = PaddingPolicy.for_megatron(ParallelLayout(world_size=world, **layout), cutoff_len=64,
                                        moe_token_dispatcher=dispatcher)
    assert (policy.pad_to, policy.pad_to_multiple_of) == expected
    assert policy.shift_labels and policy.max_length == 64
    # whatever the layout, the shifted batch has a length the policy accepts
    batch = SequenceCollator(pad_token_id=0, policy=policy)(SFT_ROWS)
    length = batch["input_ids"].shape[1]
    assert length % policy.pad_to_multiple_of == 0 and (policy.pad_to == "longest" or length == 64)


def test_megatron_policy_default_dispatcher_is_the_recipe_default():
    import inspect

    from roll.config import MegatronArguments
    from roll.config.layout import ParallelLayout

    default = inspect.signature(PaddingPolicy.for_megatron).parameters["moe_token_dispatcher"].default
    assert default == MegatronArguments().moe_token_dispatcher_type == "alltoall"
    assert PaddingPolicy.for_megatron(ParallelLayout(world_size=2, ep=2), cutoff_len=64).pad_to == "longest"


def test_pad_segments_docstring_example():
    from roll.data.collators import pad_segments

    assert pad_segments({"input_ids": [5, 6, 7], "labels": [X, 6, X], "position_ids": [0, 1, 0]}, 2, 0) == {
        "input_ids": [5, 6, 7, 0], "labels": [X, 6, X, X], "position_ids": [0, 1, 0, 1]}


@pytest.mark.parametrize("shift", [False, True])
def test_packed_samples_all_multiples_for_context_parallel(shift):
    """CP=2 (multiple 4): every segment of every row, the padding tails included, is a multiple of 4 long."""
    rows = [{"input_ids": list(range(1, 8)), "labels": [X] * 7, "position_ids": [0, 1, 2, 0, 1, 0, 1]},
            {"input_ids": [9, 9], "labels": [X, 9], "position_ids": [0, 1]}]
    from roll.config.layout import ParallelLayout

    policy = PaddingPolicy.for_megatron(ParallelLayout(world_size=2, cp=2), cutoff_len=64, packing=True) if shift else \
        PaddingPolicy(pad_to_multiple_of=4, packing=True)
    batch = SequenceCollator(pad_token_id=0, policy=policy)(rows)
    cu = batch["cu_seqlens"].tolist()
    assert all((b - a) % 4 == 0 for a, b in zip(cu, cu[1:])), cu
    assert batch["input_ids"].shape[1] % 4 == 0
    # the shift only drops tail padding
    assert batch["input_ids"][0].tolist() == [1, 2, 3, 0, 4, 5, 0, 0, 6, 7, 0, 0]
    assert batch["position_ids"][0].tolist() == [0, 1, 2, 3] * 3
