"""``roll.weights``: what a checkpoint may lack or hold beyond the model (in-process, milliseconds); the
refusals themselves, through roll-train on both backends, are in test_bad_inputs.py."""

from __future__ import annotations

import pytest

from roll.errors import ModelError
from roll.weights import check_weights_match

LAYER = "model.layers.0.self_attn.q_proj.weight"


@pytest.mark.parametrize("missing, unexpected, tied", [
    (["lm_head.weight"], [], True),  # tied head: the embedding matrix
    (["model.rotary_emb.inv_freq"], ["model.layers.0.self_attn.rotary_emb.inv_freq"], False),
    (["score.weight"], [], False),  # a new reward head
    ([], ["transformer.h.0.attn.bias", "transformer.h.0.attn.masked_bias"], False),
])
def test_the_allowlist(tmp_path, missing, unexpected, tied):
    check_weights_match(str(tmp_path), missing=missing, unexpected=unexpected, tied=tied, checkpoint_size=10)


@pytest.mark.parametrize("missing, unexpected, mismatched, tied, cause", [
    (["lm_head.weight"], [], [], False, "tie_word_embeddings: false"),
    ([LAYER], [], [], True, "another family or variant"),
    ([], [LAYER], [], False, "another family or variant"),
    ([LAYER], ["a", "b"], [], False, "none of the checkpoint's tensors is used"),
    ([], [], [f"{LAYER}: (64, 64) vs (32, 64)"], False, "config.json's sizes"),
])
def test_anything_else_is_refused_with_the_keys_and_a_cause(tmp_path, missing, unexpected, mismatched, tied,
                                                           cause):
    with pytest.raises(ModelError) as info:
        check_weights_match(str(tmp_path), missing=missing, unexpected=unexpected, mismatched=mismatched,
                            tied=tied, model_type="qwen2", checkpoint_size=2)
    message = str(info.value)
    assert cause in message and "Training would start from random weights" in message
    assert all(key in message for key in missing + unexpected + mismatched)


def test_an_adapter_directory_is_named_as_the_cause(tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(ModelError, match="this is an adapter directory"):
        check_weights_match(str(tmp_path), missing=[LAYER], unexpected=[], checkpoint_size=1)


def test_a_message_names_three_keys_and_counts_the_rest(tmp_path):
    keys = [f"model.layers.{i}.mlp.up_proj.weight" for i in range(5)]
    with pytest.raises(ModelError, match=r"5 weight\(s\) of the model are not in the checkpoint \(.*layers\.0.*"
                                         r"layers\.1.*layers\.2\S* and 2 more\)"):
        check_weights_match(str(tmp_path), missing=keys, unexpected=[], checkpoint_size=9)
