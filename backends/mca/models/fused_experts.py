"""Checkpoints that store MoE experts fused, read as the per-expert tensors the templates map.

transformers 5 keeps the routed experts of an MoE layer fused in memory: ``mlp.experts.gate_up_proj``
``[E, 2I, H]`` (each expert's gate rows, then its up rows) and ``mlp.experts.down_proj`` ``[E, H, I]``; Mixtral
also renames ``block_sparse_moe`` to ``mlp``. ``save_pretrained`` writes the original per-expert names by default
(``experts.{e}.gate_proj.weight`` ..., Mixtral's ``block_sparse_moe.experts.{e}.w1`` ...), and so do the released
checkpoints of every family here, but ``save_pretrained(save_original_format=False)`` (and a model saved while a
PEFT adapter or offloading is attached) writes the fused layout, which transformers loads as well.

A family declares the fused spelling next to its weight rows (``Template.on_disk``): a ``Fused`` row names the
tensor on disk and the per-expert HF tensors it stacks. Each expert's part of a contiguous ``[E, R, C]`` tensor is a
contiguous byte range, so the fused tensor's header entry becomes per-expert entries (``expand_header``) and the
loader reads them like any other tensor, straight into the parameter's slots: bit-exact, and no copy of the fused
tensor is ever held. The shapes are checked against the config (``[num_experts, parts x rows, cols]``): a
transposed or interleaved fused layout (GPT-OSS, Qwen3-VL-MoE) is an error naming the key, never a silent misread.
Export writes the per-expert layout (what ``save_pretrained`` writes by default; transformers loads both).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from backends.mca.models.mapping import compile_pattern
from roll.errors import ModelError

if TYPE_CHECKING:
    from backends.mca.models.config import McaModelConfig
    from backends.mca.models.template import Template


@dataclass(frozen=True)
class Fused:
    """The on-disk tensor ``disk`` (a pattern with ``{layer}``) holds ``parts`` (HF names with ``{layer}`` and
    ``{expert}``): ``[num_experts, len(parts) x rows, cols]``, expert by expert, each part's ``[rows, cols]``
    after the other; ``shape`` names the config fields of (rows, cols). A part without ``{expert}`` is the whole
    tensor under another name (Mixtral's router, ``mlp.gate`` on disk)."""

    disk: str
    parts: tuple[str, ...]
    shape: tuple[str, str] | None = None

    @property
    def regex(self) -> re.Pattern:
        return compile_pattern(self.disk)


def fused_expert_rows(disk: str, parts: str, gate: str = "gate_proj", up: str = "up_proj",
                      down: str = "down_proj") -> tuple[Fused, ...]:
    """transformers 5's fused experts of an MoE layer: ``{disk}gate_up_proj`` / ``{disk}down_proj`` <->
    ``{parts}{gate}.weight`` + ``{parts}{up}.weight`` / ``{parts}{down}.weight`` (``parts`` holds ``{expert}``)."""
    return (Fused(disk + "gate_up_proj", (parts + gate + ".weight", parts + up + ".weight"),
                  ("moe_ffn_hidden_size", "hidden_size")),
            Fused(disk + "down_proj", (parts + down + ".weight",), ("hidden_size", "moe_ffn_hidden_size")))


def _match(template: Template, name: str) -> tuple[Fused, dict] | None:
    for row in template.on_disk:
        m = row.regex.match(name)
        if m:
            return row, {k: int(v) for k, v in m.groupdict().items()}
    return None


def expand_weight_map(weight_map: dict[str, str], template: Template, config: McaModelConfig) -> dict[str, str]:
    """HF name -> file, with each fused tensor replaced by the per-expert names it holds (same file)."""
    out: dict[str, str] = {}
    for name, file in weight_map.items():
        found = _match(template, name)
        if found is None:
            out[name] = file
            continue
        row, index = found
        experts = range(config.num_moe_experts or 0) if any("{expert}" in p for p in row.parts) else [None]
        for expert in experts:
            out.update((part.format(**index, expert=expert), file) for part in row.parts)
    return out


def expand_header(entries: dict[str, dict], path: str, *, template: Template,
                  config: McaModelConfig) -> dict[str, dict]:
    """A safetensors header (name -> entry with ``dtype``, ``shape``, ``data_offsets``, ``torch_dtype``) with each
    fused tensor replaced by per-expert entries over its bytes."""
    out: dict[str, dict] = {}
    for name, entry in entries.items():
        found = _match(template, name)
        if found is None:
            out[name] = entry
            continue
        row, index = found
        if not any("{expert}" in part for part in row.parts):
            out.update((part.format(**index), entry) for part in row.parts)
            continue
        rows, cols = (getattr(config, field) for field in row.shape)
        experts = config.num_moe_experts
        expected = [experts, len(row.parts) * rows, cols]
        if list(entry["shape"]) != expected:
            raise ModelError(
                f"{path}: fused expert tensor {name!r} has shape {entry['shape']}; roll reads transformers 5's fused "
                f"layout, [experts {experts}, {len(row.parts)} x {row.shape[0]} {rows}, {row.shape[1]} {cols}] "
                f"({' then '.join(p.rsplit('.', 2)[-2] for p in row.parts)} rows of each expert). Other fused "
                "layouts (transposed, interleaved) are not supported: load the model in transformers and save it "
                "with save_pretrained() (per-expert tensors, its default).")
        size = rows * cols * entry["torch_dtype"].itemsize
        begin = entry["data_offsets"][0]
        for expert in range(experts):
            for k, part in enumerate(row.parts):
                start = begin + (expert * len(row.parts) + k) * size
                out[part.format(**index, expert=expert)] = {**entry, "shape": [rows, cols],
                                                            "data_offsets": [start, start + size]}
    return out
