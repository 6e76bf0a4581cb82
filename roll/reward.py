"""Stage rm (pairwise reward modelling): the one definition both backends train, and what they share.

- **Model**: the decoder plus a 1-wide linear head without bias, Hugging Face's ``score`` of
  ``...ForSequenceClassification`` with ``num_labels: 1``, in place of the LM head. No dropout on it.
- **Where a sequence is scored**: its rightmost token whose id is not the pad id, transformers' own pooling
  rule, marked in the rows at tokenization (``roll.data.reward``): an exported model scores a text as training
  did.
- **Head at the start**: the checkpoint's ``score.weight`` when it has one (a reward model trained on), else
  zeros on both backends: every reward is 0 at step 1, whose loss is exactly ln 2, and the first update moves
  only the head (every other gradient passes through it).
- **Loss**: Bradley-Terry, the mean over the pairs of the global batch of ``-log sigmoid(r_chosen - r_rejected)``
  (``F.logsigmoid``, stable for any margin); no margin column, no centring term, no beta.
- **Metrics** (means over the same pairs): ``accuracy`` (``r_chosen > r_rejected``, strict), ``margin``
  (``r_chosen - r_rejected``), ``rewards/chosen``, ``rewards/rejected``; eval logs them with ``eval_``.
- **Export**: an HF ``...ForSequenceClassification`` directory (``export_config``), or with LoRA a PEFT adapter
  of task ``SEQ_CLS`` that holds the trained head as ``modules_to_save`` (``base_model.model.score.weight``).
"""

from __future__ import annotations

import logging

from roll.errors import ConfigError, ModelError
from roll.logging import warn_once

logger = logging.getLogger(__name__)

HEAD = "score.weight"
"""The head's HF name."""
LM_HEAD = "lm_head.weight"
"""A causal LM checkpoint's output head, which a reward model does not use."""
METRICS = ("accuracy", "margin", "rewards/chosen", "rewards/rejected")
"""What both backends log beside ``loss`` (means over pairs)."""
DPO_KEYS = ("pref_beta", "pref_loss", "pref_label_smoothing", "simpo_gamma")


def check_config(config) -> None:
    """Stage rm's config rules (RunConfig.validate): what it refuses, and the dpo keys it does not read."""
    if config.data.packing:
        raise ConfigError("packing is not supported for stage rm (pairs are collated chosen over rejected); set "
                          "packing: false.")
    ft = config.finetuning
    if ft.finetuning_type == "lora" and ft.export_merged:
        raise ConfigError("export_merged is not available for stage rm: the output is a PEFT adapter of task "
                          "SEQ_CLS (the LoRA weights and the trained score head): load it with "
                          "PeftModel.from_pretrained on AutoModelForSequenceClassification.from_pretrained(base, "
                          "num_labels=1, pad_token_id=...) and merge_and_unload() there. Drop export_merged.")
    given = [key for key in DPO_KEYS if key in config.explicit_keys]
    if given:
        warn_once(logger, f"{', '.join(given)}: dpo keys, not read by stage rm (its loss has no beta); ignored.")


def sequence_classification_class(hf_config: dict) -> str:
    """The ``...ForSequenceClassification`` class transformers builds for this config's ``model_type``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    model_type = hf_config.get("model_type")
    name = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.get(model_type)
    if name is None:
        raise ModelError(f"stage rm: transformers has no sequence-classification model for model_type "
                         f"{model_type!r}, so a reward model of it could not be loaded or exported. Train a "
                         "reward model of another family.")
    return name


def log_head_start(path: str, has_head: bool) -> None:
    """Say once (rank 0) where the reward head starts."""
    from roll.logging import log_rank0

    if has_head:
        log_rank0(logger, "stage rm: the reward head starts from %s's %s", path, HEAD)
    else:
        log_rank0(logger, "stage rm: %s has no %s (a causal LM): the reward head starts at zero, every reward 0 "
                  "and the first loss ln 2 = 0.6931", path, HEAD)


def flops_fields(hf_config: dict) -> dict:
    """The config fields ``roll.perf`` counts a reward model's FLOPs from: its head is 1 wide, not the
    vocabulary (the output head's ``2 * h * V`` would otherwise dominate a small model's count)."""
    return {**hf_config, "vocab_size": 1}


def export_config(hf_config: dict, pad_token_id: int | None) -> dict:
    """The HF ``config.json`` of a reward model from its base model's: the ``...ForSequenceClassification``
    architecture, one label (``id2label``, from which transformers derives ``num_labels``) and the pad id the
    model pools by, as ``save_pretrained`` of the standard backend's model writes them."""
    out = dict(hf_config)
    out.pop("num_labels", None)
    out.update(architectures=[sequence_classification_class(hf_config)], id2label={"0": "LABEL_0"},
               label2id={"LABEL_0": 0}, pad_token_id=pad_token_id)
    return out
