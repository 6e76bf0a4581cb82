"""Stage kto's rows: LLaMA-Factory's ``kto_tag`` format, and the mismatched rows of KTO's reference point.

- **Rows**: alpaca or sharegpt rows (a conversation ending with an assistant reply) with a JSON boolean
  ``kto_tag``: true marks that last reply desirable, false undesirable (LLaMA-Factory's column name; a
  ``label`` column, as in its ``kto_en_demo.json`` and TRL's unpaired rows, is read when there is no
  ``kto_tag``). Anything else (0/1, "true", a missing tag) stops preprocessing with the file and the row.
- **FeedbackProcessor** -> ``input_ids``, ``attention_mask``, ``labels`` and ``kto_tag``: the last reply
  and its end-of-turn are trained; everything before it (earlier replies included) is the prompt, cut to
  ``cutoff_len`` by the pairwise rule (``split_budget``: the prompt from the left, the reply from the right).
  With a named template (``template: qwen``) the row is LLaMA-Factory's kto row: the conversation laid out
  as its last turn (``TemplateEncoder.one_turn``, the reply slot trained whole, an efficient_eos template's
  EOS after it) and cut by LLaMA-Factory's rule (``split_lengths``: both keep their start).
- **FeedbackCollator**: ``B`` rows -> ``2B``: the rows, then their mismatched rows, and ``kto_tags [B]``.
  Mismatched row ``j`` is row ``j``'s prompt with the completion of the micro-batch's previous row (row 0
  takes the last row's): TRL's rotation by +1, formed from the micro-batch itself (as TRL's vision collator
  does), so it is the same on both backends and every layout, whatever the shuffle. A micro-batch is the
  same set of rows, in the same order, on both backends (roll.data's one sample order). A mismatched row is
  cut to ``cutoff_len`` by the rows' rule (``split_lengths`` with a named template, as LLaMA-Factory cuts
  its KL rows; else ``split_budget``); a filler row (no trained token: the end of an epoch on the
  mca backend) takes no part in the rotation. With ``kto_mismatched_rows: llamafactory`` the processor
  forms each row's mismatched row instead (its prompt with the previous row of its tokenization batch, as
  LLaMA-Factory 0.9.5 does), and the collator takes those (``paired_rows``): a micro-batch may hold one row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from roll import IGNORE_INDEX
from roll.data import formats
from roll.data.formats import RowError, Skip
from roll.data.named_templates import TemplateEncoder, split_lengths, tokenize_slots
from roll.data.policy import PaddingPolicy
from roll.data.processors import (META_COLUMNS, SEQ, _bounded_messages, _conversation, _Processor, _tokenize,
                                  bounded, char_bound, split_budget)
from roll.data.templates import Renderer
from roll.errors import DataError

TAG = "kto_tag"
"""The label column of a kto row (and of the tokenized rows)."""
KL = ("kl_input_ids", "kl_labels")
"""A row's own mismatched row, with ``kto_mismatched_rows: llamafactory`` (``FeedbackProcessor.pair_in_batch``)."""


def kto_tag(row: dict) -> bool:
    """A kto row's label: its JSON boolean ``kto_tag`` (else ``label``)."""
    column = TAG if row.get(TAG) is not None else "label"
    value = row.get(column)
    if value is None:
        raise RowError("no kto_tag: a kto row needs a JSON boolean 'kto_tag' (true: its last reply is desirable, "
                       "false: undesirable)")
    if not isinstance(value, bool):
        raise RowError(f"'{column}' must be a JSON boolean (true: desirable, false: undesirable), got "
                       f"{type(value).__name__} ({str(value)[:60]!r})")
    return value


@dataclass
class FeedbackProcessor(_Processor):
    """kto rows -> input_ids, attention_mask, labels (the last reply + end-of-turn trained), kto_tag."""

    encoder: TemplateEncoder | None = None
    """A named template (``template:``, roll.data.named_templates); None: the tokenizer's chat template."""
    pair_in_batch: bool = False
    """``kto_mismatched_rows: llamafactory``: each row's mismatched row (``kl_input_ids``, ``kl_labels``) is
    formed here, its prompt with the reply of the batch's previous row (the first row: the batch's last), cut
    from their full lengths, as LLaMA-Factory 0.9.5's FeedbackDatasetProcessor forms its KL rows."""

    def __call__(self, batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        out: dict[str, list] = {k: [] for k in SEQ + (TAG,) + META_COLUMNS + (KL if self.pair_in_batch else ())}
        limit = char_bound(self.tokenizer, self.cutoff_len)
        if self.encoder is not None:
            parsed = self.parse(batch, indices, lambda row: self._slots(row, limit))
            token_iter = iter(tokenize_slots(self.tokenizer, [g for item in parsed if not isinstance(item, Skip)
                                                              for g in item[:2]]))
        else:
            renderer = Renderer.for_tokenizer(self.tokenizer)
            parsed = self.parse(batch, indices, lambda row: self._render(renderer, row, limit))
            token_iter = iter(_tokenize(self.tokenizer, [text for item in parsed if not isinstance(item, Skip)
                                                         for text in item[:2]]))
        named = self.encoder is not None
        split = split_lengths if named else split_budget
        eos = [self.tokenizer.eos_token_id] if named and self.encoder.template.efficient_eos else []
        tokens = [None if isinstance(item, Skip) else (next(token_iter), next(token_iter) + eos) for item in parsed]
        replies = [t[1] for t in tokens if t is not None]
        rank = {k: j for j, k in enumerate(k for k, t in enumerate(tokens) if t is not None)}
        for k, item in enumerate(parsed):
            columns = SEQ + (KL if self.pair_in_batch else ())
            if isinstance(item, Skip):
                self.empty(out, item.reason, columns)
                out[TAG].append(False)
                continue
            prompt, answer = tokens[k]
            p_keep, a_keep = split(len(prompt), len(answer), self.cutoff_len)
            if a_keep <= 0:  # an empty reply slot (template empty): nothing to train
                self.empty(out, "no_trainable_tokens", columns)
                out[TAG].append(False)
                continue
            if self.pair_in_batch:  # the previous row's reply (a skipped row lends none: the one before it)
                other = replies[rank[k] - 1]
                kl_ids, kl_labels = _join(prompt, other, *split(len(prompt), len(other), self.cutoff_len), named)
                out["kl_input_ids"].append(kl_ids)
                out["kl_labels"].append(kl_labels)
            ids, labels = _join(prompt, answer, p_keep, a_keep, keep_prompt_start=named)
            out["input_ids"].append(ids)
            out["attention_mask"].append([1] * len(ids))
            out["labels"].append(labels)
            out[TAG].append(item[2])
            out["_drop"].append("")
            out["_truncated"].append(p_keep < len(prompt) or a_keep < len(answer))
            out["_docs"].append(1)
        return out

    def _render(self, renderer: Renderer, row: dict, limit: int) -> tuple[str, str, bool]:
        tag = kto_tag(row)
        turns = renderer.turns(_conversation(row, self.fmt), "last")
        prompt = "".join(p + r for p, r, _ in turns[:-1]) + turns[-1][0]
        return bounded(prompt, limit, "tail"), bounded(turns[-1][1], limit, "head"), tag

    def _slots(self, row: dict, limit: int):
        """(prompt slots, reply slots, tag) of a named template: LLaMA-Factory's encode_oneturn of the row."""
        tag = kto_tag(row)
        messages = _bounded_messages(formats.conversation(row, self.fmt), limit)
        return (*self.encoder.one_turn(messages, formats.tools(row)), tag)


def _join(prompt: list[int], answer: list[int], p_keep: int, a_keep: int,
          keep_prompt_start: bool = False) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of ``p_keep`` prompt tokens (its last ones; its first with ``keep_prompt_start``, as
    LLaMA-Factory cuts) and the answer's first ``a_keep`` (trained)."""
    prompt = prompt[:p_keep] if keep_prompt_start else prompt[len(prompt) - p_keep:]
    answer = answer[:a_keep]
    labels = [IGNORE_INDEX] * len(prompt) + answer
    labels[0] = IGNORE_INDEX  # nothing predicts the first token (DESIGN.md section 2)
    return prompt + answer, labels


def _prompt_and_completion(row: dict[str, Any]) -> tuple[list[int], list[int]] | None:
    """A processed row's (prompt, completion) token ids: the completion runs from its first trained label to
    the end (the processor's layout); None for a row without a trained token (a filler row)."""
    labels = list(row["labels"])
    first = next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), None)
    if first is None:
        return None
    ids = [int(t) for t in row["input_ids"]]
    return ids[:first], ids[first:]


def mismatched_rows(features: list[dict[str, Any]], cutoff_len: int,
                    named_template: bool = False) -> list[dict[str, list[int]]]:
    """The mismatched row of each row of a micro-batch (see the module docstring); ``named_template``: cut as
    LLaMA-Factory cuts (``split_lengths``, the prompt keeps its start).

    Example (cutoff_len 8)::

        mismatched_rows([{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]},
                         {"input_ids": [8, 9], "labels": [-100, 9]}], 8)
        -> [{"input_ids": [5, 9], "attention_mask": [1, 1], "labels": [-100, 9]},
            {"input_ids": [8, 6, 7], "attention_mask": [1, 1, 1], "labels": [-100, 6, 7]}]
    """
    spans = [_prompt_and_completion(f) for f in features]
    real = [i for i, span in enumerate(spans) if span is not None]
    out = [{"input_ids": list(f["input_ids"]), "attention_mask": [0] * len(f["input_ids"]),
            "labels": list(f["labels"])} for f in features]  # fillers stay fillers
    for k, i in enumerate(real):
        prompt, completion = spans[i][0], spans[real[k - 1]][1]
        split = split_lengths if named_template else split_budget
        p_keep, a_keep = split(len(prompt), len(completion), cutoff_len)
        ids, labels = _join(prompt, completion, p_keep, a_keep, keep_prompt_start=named_template)
        out[i] = {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}
    return out


def paired_rows(features: list[dict[str, Any]]) -> list[dict[str, list[int]]]:
    """The mismatched rows formed at tokenization (``kto_mismatched_rows: llamafactory``): each row's own
    ``kl_input_ids`` / ``kl_labels``; a filler row (no trained token) stays a filler.

    Example::

        paired_rows([{"input_ids": [5, 6], "labels": [-100, 6], "kl_input_ids": [5, 9], "kl_labels": [-100, 9]},
                     {"input_ids": [0, 0], "labels": [-100, -100], "kl_input_ids": [5, 9], "kl_labels": [-100, 9]}])
        -> [{"input_ids": [5, 9], "attention_mask": [1, 1], "labels": [-100, 9]},
            {"input_ids": [0, 0], "attention_mask": [0, 0], "labels": [-100, -100]}]
    """
    out = []
    for f in features:
        if _prompt_and_completion(f) is None:
            out.append({"input_ids": list(f["input_ids"]), "attention_mask": [0] * len(f["input_ids"]),
                        "labels": list(f["labels"])})
        else:
            out.append({"input_ids": list(f[KL[0]]), "attention_mask": [1] * len(f[KL[0]]),
                        "labels": list(f[KL[1]])})
    return out


@dataclass
class FeedbackCollator:
    """KTO micro-batches: the ``B`` rows, then their ``B`` mismatched rows, padded as one ``[2B, L]`` batch
    by the policy, and ``kto_tags [B]`` (bool).

    Example (``pad_token_id=0``, ``cutoff_len=8``, default policy)::

        [{"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "labels": [-100, 6, 7], "kto_tag": True},
         {"input_ids": [8, 9], "attention_mask": [1, 1], "labels": [-100, 9], "kto_tag": False}]
        -> {"input_ids": [[5, 6, 7], [8, 9, 0], [5, 9, 0], [8, 6, 7]],
            "labels": [[-100, 6, 7], [-100, 9, -100], [-100, 9, -100], [-100, 6, 7]],
            "attention_mask": [[1, 1, 1], [1, 1, 0], [1, 1, 0], [1, 1, 1]],
            "kto_tags": [True, False]}
    """

    pad_token_id: int
    policy: PaddingPolicy = field(default_factory=PaddingPolicy)
    cutoff_len: int = 1024
    named_template: bool = False
    """The rows are a named template's (``template:``): mismatched rows are cut as LLaMA-Factory cuts."""

    def __post_init__(self) -> None:
        if self.policy.packing:
            raise ValueError("packing is not supported for kto batches; set packing: false")

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        from roll.data.collators import SequenceCollator  # roll.data.collators lists this class

        rows = [{key: f[key] for key in ("input_ids", "attention_mask", "labels")} for f in features]
        mismatched = (paired_rows(features) if features and KL[0] in features[0] else
                      mismatched_rows(features, self.cutoff_len, self.named_template))
        batch = SequenceCollator(self.pad_token_id, self.policy)(rows + mismatched)
        batch["kto_tags"] = torch.tensor([bool(f[TAG]) for f in features])
        return batch


def check_both_labels(dataset, source: str) -> None:
    """A training set of one class cannot train KTO usefully: refused (DataError) with its counts."""
    tags = dataset[TAG]
    desirable = sum(1 for tag in tags if tag)
    if 0 < desirable < len(tags):
        return
    have, lack = ("desirable (kto_tag: true)", "undesirable (kto_tag: false)") if desirable else \
        ("undesirable (kto_tag: false)", "desirable (kto_tag: true)")
    raise DataError(f"{source}: all {len(tags)} training rows are {have} and none is {lack}. stage kto "
                    "learns from both: each row's reward is measured against the other rows' (the KL reference "
                    f"point), and a one-class set only pushes every reply one way. Add {lack.split(' (')[0]} rows, "
                    "or train on these with stage: sft.")
