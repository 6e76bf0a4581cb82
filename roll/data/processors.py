"""Stage processors: raw rows -> tokenized rows with labels, run as batched ``datasets.map``.

Output schema (the contract with both backends, see docs/data.md):
- pretrain / supervised: ``input_ids``, ``attention_mask``, ``labels`` (aligned with input_ids; prompt
  tokens and the first position are IGNORE_INDEX, DESIGN.md section 2).
- pairwise: ``chosen_*`` and ``rejected_*`` versions of the three, same prompt on both sides.
Every processor also emits bookkeeping columns, removed after the stats are taken:
``_drop`` (a DROP_REASONS key, '' when kept), ``_truncated`` (bool) and ``_docs`` (samples ending in the row).

A named template (``template: qwen``) lays out, labels and truncates as LLaMA-Factory does
(roll.data.named_templates). With the tokenizer's own chat template, truncation to cutoff_len
(``split_budget``): the prompt is trimmed before the answer. The prompt
keeps at least min(prompt, budget // 2) tokens, cut from the left (oldest context first, the
assistant header right before the answer survives); the answer is cut from the right. In
multi-turn conversations turns are kept in order until the budget runs out; the turn that
overflows is trimmed this way and later turns are dropped. A pair computes the split once from
the longer answer, so both sides keep the same prompt.
"""

from __future__ import annotations

import bisect
import logging
import itertools
from dataclasses import dataclass
from typing import Any, Callable

from roll import IGNORE_INDEX
from roll.data import formats
from roll.data.dataset_info import DatasetEntry
from roll.data.formats import RowError, Skip
from roll.data.named_templates import TEMPLATES, TemplateEncoder, assemble, split_lengths, tokenize_slots
from roll.data.templates import Renderer
from roll.errors import DataError
from roll.logging import warn_once

logger = logging.getLogger(__name__)

META_COLUMNS = ("_drop", "_truncated", "_docs")


def split_budget(prompt_len: int, answer_len: int, budget: int) -> tuple[int, int]:
    """(prompt tokens kept, answer tokens kept) for a turn that may not fit in ``budget``."""
    if prompt_len + answer_len <= budget:
        return prompt_len, answer_len
    prompt_keep = max(min(prompt_len, budget // 2), budget - answer_len)
    return prompt_keep, budget - prompt_keep


def truncate_turns(turns: list[tuple[list[int], list[int], bool]], cutoff_len: int, train_on_prompt: bool = False):
    """[(prompt_ids, reply_ids, trainable)] -> (input_ids, labels, truncated); ``train_on_prompt`` trains the
    prompts (system, user turns, role headers) too."""
    input_ids: list[int] = []
    labels: list[int] = []
    truncated = False
    for prompt, reply, trainable in turns:
        budget = cutoff_len - len(input_ids)
        p_keep, r_keep = split_budget(len(prompt), len(reply), budget)
        if (p_keep, r_keep) != (len(prompt), len(reply)):
            truncated = True
        if r_keep <= 0:
            break
        kept_prompt = prompt[len(prompt) - p_keep:]
        input_ids += kept_prompt + reply[:r_keep]
        labels += (kept_prompt if train_on_prompt else [IGNORE_INDEX] * p_keep) + (
            reply[:r_keep] if trainable else [IGNORE_INDEX] * r_keep)
        if truncated:
            break
    if labels:
        labels[0] = IGNORE_INDEX  # nothing predicts the first token (DESIGN.md section 2)
    return input_ids, labels, truncated


def check_segmentation(tokenizer, turns: list[tuple[str, str, bool]], tokenized: list) -> None:
    """Warn (once) if tokenizing prompt and reply pieces separately differs from tokenizing the whole text.

    Masks are placed by tokenizing each piece on its own. Byte-level BPE tokenizers (Qwen, Llama 3)
    give the same tokens as the whole conversation because template pieces meet at special tokens
    and newlines; a tokenizer that prepends a space to every call (legacy SentencePiece) does not.
    Checked on one conversation per batch.
    """
    whole = _tokenize(tokenizer, ["".join(p + r for p, r, _ in turns)])[0]
    pieces = [tok for prompt, reply, _ in tokenized for tok in prompt + reply]
    if whole != pieces:
        warn_once(logger, "tokenizing the prompt and reply pieces separately gives different tokens than the "
                          "whole conversation with this tokenizer (it may add a prefix space per call); "
                          "training "
                          "sequences differ slightly from inference-time tokenization. Consider `template: "
                          "default` or a byte-level BPE tokenizer.")


def _rows(batch: dict[str, list]) -> list[dict]:
    keys = list(batch)
    return [dict(zip(keys, values)) for values in zip(*batch.values())]


def _tokenize(tokenizer, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []


_LONGEST_TOKEN: dict[int, int] = {}


def char_bound(tokenizer, cutoff_len: int) -> int:
    """Characters of one text that can matter for ``cutoff_len`` tokens: cutoff_len tokens of the tokenizer's
    longest vocabulary entry, plus slack for the merges at the cut. Only cutoff_len tokens of a prompt (its
    end) or an answer (its start) survive truncation, so a longer text is cut to this many characters before
    it is tokenized: one 50 MB row would otherwise take minutes and gigabytes to tokenize, to keep 1024."""
    key = id(tokenizer)
    if key not in _LONGEST_TOKEN:
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        _LONGEST_TOKEN[key] = max(map(len, vocab), default=64)
    return cutoff_len * max(_LONGEST_TOKEN[key], 1) + 4096


def bounded(text: str, limit: int, keep: str) -> str:
    """``text`` cut to ``limit`` characters, keeping its ``keep`` end ('head' or 'tail')."""
    if len(text) <= limit:
        return text
    return text[:limit] if keep == "head" else text[len(text) - limit:]


@dataclass
class _Processor:
    tokenizer: object
    cutoff_len: int
    fmt: str
    source: str
    """File name shown in errors."""
    file_rows: list[int] | None = None
    """The file's row index of each dataset row (Source.file_rows); None: dataset index = file row."""
    entry: DatasetEntry | None = None
    """The registry entry of the source (its columns are read into roll's own first), or None."""

    def parse(self, batch: dict[str, list], indices: list[int], parse_row: Callable[[dict], Any]) -> list:
        """``parse_row(row)`` for every row of the batch; a skipped row gives its :class:`Skip` instead.

        A structurally broken row (RowError) stops preprocessing with a DataError naming the file's row.
        """
        parsed = []
        for row, index in zip(_rows(batch), indices):
            try:
                parsed.append(parse_row(row if self.entry is None else self.entry.canonical(row, self.fmt)))
            except Skip as skip:
                parsed.append(skip)
            except RowError as exc:
                row_id = index if self.file_rows is None else self.file_rows[index]
                entry = f", {self.entry.describe()}" if self.entry is not None else ""
                raise DataError(f"{self.source}, row {row_id} (0-based): {exc} "
                                f"[format: {self.fmt}{entry}]") from None
        return parsed

    @staticmethod
    def keep(out: dict[str, list], input_ids: list[int], labels: list[int], truncated: bool) -> None:
        """One sample out (``labels[0]`` ignored: nothing predicts the first token, DESIGN.md section 2), or
        a skipped row when no label is left to train."""
        if labels:
            labels[0] = IGNORE_INDEX
        if all(label == IGNORE_INDEX for label in labels):
            _Processor.empty(out, "no_trainable_tokens", SEQ)
            return
        out["input_ids"].append(input_ids)
        out["attention_mask"].append([1] * len(input_ids))
        out["labels"].append(labels)
        out["_drop"].append("")
        out["_truncated"].append(truncated)
        out["_docs"].append(1)

    @staticmethod
    def empty(out: dict[str, list], reason: str, seq_keys: tuple[str, ...]) -> None:
        for key in seq_keys:
            out[key].append([])
        out["_drop"].append(reason)
        out["_truncated"].append(False)
        out["_docs"].append(0)


SEQ = ("input_ids", "attention_mask", "labels")
PAIR_SEQ = tuple(f"{side}_{key}" for side in ("chosen", "rejected") for key in SEQ)


@dataclass
class SupervisedProcessor(_Processor):
    """alpaca / sharegpt rows -> input_ids, attention_mask, labels (replies + end-of-turn trained)."""

    train_turns: str = "all"
    train_on_prompt: bool = False
    encoder: TemplateEncoder | None = None
    """A named template (``template:``, roll.data.named_templates); None: the tokenizer's chat template."""
    default_system: str | None = None
    """With the tokenizer's chat template: the system prompt of conversations that have none."""
    enable_thinking: bool = True
    """With the tokenizer's chat template: false is passed to it (Qwen3's reads ``enable_thinking``)."""

    def __call__(self, batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        if self.encoder is not None:
            return self._named(batch, indices)
        renderer = Renderer.for_tokenizer(self.tokenizer, enable_thinking=self.enable_thinking)
        out: dict[str, list] = {k: [] for k in SEQ + META_COLUMNS}
        limit = char_bound(self.tokenizer, self.cutoff_len)
        parsed = self.parse(batch, indices, lambda row: [
            (bounded(prompt, limit, "tail"), bounded(reply, limit, "head"), trainable)
            for prompt, reply, trainable in renderer.turns(
                with_system(_conversation(row, self.fmt), self.default_system), self.train_turns)])
        texts = [text for turns in parsed if not isinstance(turns, Skip)
                 for prompt, reply, _ in turns for text in (prompt, reply)]
        token_iter = iter(_tokenize(self.tokenizer, texts))
        checked = False
        for turns in parsed:
            if isinstance(turns, Skip):
                self.empty(out, turns.reason, SEQ)
                continue
            tokenized = [(next(token_iter), next(token_iter), trainable) for _, _, trainable in turns]
            if not checked:
                check_segmentation(self.tokenizer, turns, tokenized)
                checked = True
            self.keep(out, *truncate_turns(tokenized, self.cutoff_len, self.train_on_prompt))
        return out

    def _named(self, batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        """LLaMA-Factory's layout, labels and truncation for a named template (roll.data.named_templates)."""
        encoder, last = self.encoder, self.train_turns == "last"
        out: dict[str, list] = {k: [] for k in SEQ + META_COLUMNS}
        limit = char_bound(self.tokenizer, self.cutoff_len)
        parsed = self.parse(batch, indices, lambda row: encoder.turns(
            _bounded_messages(formats.conversation(row, self.fmt), limit), last, formats.tools(row)))
        groups = [slots for turns in parsed if not isinstance(turns, Skip) for turn in turns for slots in turn]
        token_iter = iter(tokenize_slots(self.tokenizer, groups))
        for turns in parsed:
            if isinstance(turns, Skip):
                self.empty(out, turns.reason, SEQ)
                continue
            tokenized = [(next(token_iter), next(token_iter)) for _ in turns]
            self.keep(out, *assemble(tokenized, self.cutoff_len, eos_id=self.tokenizer.eos_token_id,
                                     efficient_eos=encoder.template.efficient_eos,
                                     train_on_prompt=self.train_on_prompt, last_turn_only=last))
        return out


def with_system(messages: list[dict], system: str | None) -> list[dict]:
    """``messages`` with ``system`` as their system prompt when they have none (and ``system`` is set)."""
    if not system or (messages and messages[0]["role"] == "system"):
        return messages
    return [{"role": "system", "content": system}, *messages]


def _bounded_messages(messages: list[dict], limit: int) -> list[dict]:
    """Each message cut to ``limit`` characters from its start (a named template keeps the start of a prompt
    and of a reply; see char_bound); a function call is kept whole (its JSON is parsed)."""
    return [m if m.get("function_call") else {**m, "content": bounded(m["content"], limit, "head")}
            for m in messages]


def _conversation(row: dict, fmt: str) -> list[dict]:
    """formats.conversation for the tokenizer's own chat template, which does not lay a tool list out."""
    formats.refuse_tools(row, TEMPLATES)
    return formats.conversation(row, fmt)


@dataclass
class PairwiseProcessor(_Processor):
    """Preference rows -> chosen_* / rejected_* (prompt + answer each, answer + end-of-turn trained)."""

    encoder: TemplateEncoder | None = None
    """A named template (``template:``, roll.data.named_templates); None: the tokenizer's chat template."""
    default_system: str | None = None
    enable_thinking: bool = True

    def __call__(self, batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        out: dict[str, list] = {k: [] for k in PAIR_SEQ + META_COLUMNS}
        limit = char_bound(self.tokenizer, self.cutoff_len)
        if self.encoder is not None:
            parsed = self.parse(batch, indices, lambda row: self._slots(row, limit))
            token_iter = iter(tokenize_slots(self.tokenizer, [g for item in parsed if not isinstance(item, Skip)
                                                              for g in item]))
            split = split_lengths  # LLaMA-Factory's: the prompt keeps its start
        else:
            renderer = Renderer.for_tokenizer(self.tokenizer, enable_thinking=self.enable_thinking)
            parsed = self.parse(batch, indices, lambda row: self._render(renderer, row, limit))
            token_iter = iter(_tokenize(self.tokenizer, [text for item in parsed if not isinstance(item, Skip)
                                                         for text in item]))
            split = split_budget  # the prompt keeps its end
        for item in parsed:
            if isinstance(item, Skip):
                self.empty(out, item.reason, PAIR_SEQ)
                continue
            prompt, chosen, rejected = next(token_iter), next(token_iter), next(token_iter)
            if self.encoder is not None and self.encoder.template.efficient_eos:
                chosen, rejected = chosen + [self.tokenizer.eos_token_id], rejected + [self.tokenizer.eos_token_id]
            longest = max(len(chosen), len(rejected))
            p_keep, a_keep = split(len(prompt), longest, self.cutoff_len)
            truncated = p_keep < len(prompt) or a_keep < longest
            prompt = prompt[len(prompt) - p_keep:] if split is split_budget else prompt[:p_keep]
            if a_keep <= 0:
                self.empty(out, "no_trainable_tokens", PAIR_SEQ)
                continue
            for side, answer in (("chosen", chosen[:a_keep]), ("rejected", rejected[:a_keep])):
                labels = [IGNORE_INDEX] * len(prompt) + answer
                labels[0] = IGNORE_INDEX  # nothing predicts the first token (DESIGN.md section 2)
                out[f"{side}_input_ids"].append(prompt + answer)
                out[f"{side}_attention_mask"].append([1] * (len(prompt) + len(answer)))
                out[f"{side}_labels"].append(labels)
            out["_drop"].append("")
            out["_truncated"].append(truncated)
            out["_docs"].append(1)
        return out

    def _slots(self, row: dict, limit: int):
        """(prompt, chosen, rejected) slots of a named template: each side laid out as its last turn
        (LLaMA-Factory's encode_oneturn; the prompt is the chosen side's; a function_call answer in the
        template's function slots)."""
        prompt, chosen, rejected = formats.pair(row)
        prompt, tools = _bounded_messages(prompt, limit), formats.tools(row)
        sides = []
        for side, answer in (("chosen", chosen), ("rejected", rejected)):
            turn = formats.turns_to_messages(row[side], side)[-1] if isinstance(row[side], (dict, list)) else {}
            call = bool(turn.get("function_call"))
            message = {"role": "assistant", "content": answer if call else bounded(answer, limit, "head")}
            sides.append(self.encoder.one_turn(prompt + [{**message, "function_call": True} if call else message],
                                               tools))
        return sides[0][0], sides[0][1], sides[1][1]

    def _render(self, renderer: Renderer, row: dict, limit: int) -> tuple[str, str, str]:
        formats.refuse_tools(row, TEMPLATES)
        prompt, chosen, rejected = formats.pair(row)
        prompt = with_system(prompt, self.default_system)
        chosen_turns = renderer.turns(prompt + [{"role": "assistant", "content": chosen}])
        rejected_turns = renderer.turns(prompt + [{"role": "assistant", "content": rejected}])
        prompt_text = "".join(p + r for p, r, _ in chosen_turns[:-1]) + chosen_turns[-1][0]
        if prompt_text != "".join(p + r for p, r, _ in rejected_turns[:-1]) + rejected_turns[-1][0]:
            raise RowError("the chat template renders the prompt differently for chosen and rejected")
        return (bounded(prompt_text, limit, "tail"), bounded(chosen_turns[-1][1], limit, "head"),
                bounded(rejected_turns[-1][1], limit, "head"))


@dataclass
class PretrainProcessor(_Processor):
    """text rows -> text + EOS; concatenated and chunked to cutoff_len, or (packing) split per document."""

    packing: bool = False
    eos_id: int | None = None
    """The token each document ends with; None: the tokenizer's EOS (a named template may choose another)."""

    def __call__(self, batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        out: dict[str, list] = {k: [] for k in SEQ + META_COLUMNS}
        texts = []
        for item in self.parse(batch, indices, formats.text):
            if isinstance(item, Skip):
                self.empty(out, item.reason, SEQ)
            else:
                texts.append(item)
        eos = [self.tokenizer.eos_token_id if self.eos_id is None else self.eos_id]
        docs = [ids + eos for ids in _tokenize(self.tokenizer, texts)]
        chunks = self._per_document(docs) if self.packing else self._concatenated(docs)
        for ids, n_docs, truncated in chunks:
            out["input_ids"].append(ids)
            out["attention_mask"].append([1] * len(ids))
            out["labels"].append([IGNORE_INDEX] + ids[1:])
            out["_drop"].append("")
            out["_truncated"].append(truncated)
            out["_docs"].append(n_docs)
        return out

    def _per_document(self, docs: list[list[int]]):
        for doc in docs:
            for start in range(0, len(doc), self.cutoff_len):
                yield doc[start:start + self.cutoff_len], int(start == 0), len(doc) > self.cutoff_len

    def _concatenated(self, docs: list[list[int]]):
        """Concatenate the batch's documents and cut into cutoff_len rows; the short remainder is dropped, as
        LLaMA-Factory (and HF's ``group_texts``) drop it, so both train on the same rows.

        Yields (ids, documents ending in this row, whether the cut splits a document).
        """
        flat = [tok for doc in docs for tok in doc]
        ends = list(itertools.accumulate(len(doc) for doc in docs))
        end_set = set(ends)
        for start in range(0, len(flat) - self.cutoff_len + 1, self.cutoff_len):
            stop = start + self.cutoff_len
            n_docs = bisect.bisect_right(ends, stop) - bisect.bisect_right(ends, start)
            yield flat[start:stop], n_docs, stop not in end_set
