"""Stream HF safetensors into this rank's Megatron chunks.

Each rank works out which canonical Megatron tensors its chunks hold (PP/VPP layers, EP experts),
which HF tensors those need, and which safetensors files hold them; it then reads only those
tensors, file by file and tensor by tensor (``safetensors_io``: positioned reads; a memory map only for
``map_files``, a conversion's model that is only saved again),
converting a Megatron tensor as soon as all its HF inputs have arrived and dropping the inputs right
after. A parameter this rank holds whole is filled in place, input by input: a 1:1 rename is the parameter,
q/k/v and gate/up fill slices of the fused parameter (``Mapping.slots``); at the file's dtype the bytes are
read straight there (no buffer, no copy), at another one each input is converted into place as it arrives.
Peak memory is this rank's own weights plus the inputs of the few mappings still incomplete (under TP at
most a layer's q/k/v or gate/up, or the embedding when it is padded or split), never the whole model twice
and never a whole file.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from backends.mca.models import fused_experts, layout, sharding
from backends.mca.models.gpt import canonical_tensors, rank_coordinates
from backends.mca.models.mapping import Mapping
from backends.mca.models.safetensors_io import SafetensorsFile
from backends.mca.models.template import Template, template_for
from roll.errors import ModelError
from roll.logging import byte_progress, log_rank0
from roll.weights import check_weights_match

if TYPE_CHECKING:
    from backends.mca.models.config import McaModelConfig

logger = logging.getLogger(__name__)
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


@dataclass
class LoadReport:
    """What one rank read: lets tests prove a rank touched only the files and tensors it needs."""

    files_read: list[str] = field(default_factory=list)
    tensors_read: int = 0
    bytes_read: int = 0
    bytes_mapped: int = 0  # of ``bytes_read``: served by the files' memory maps, not copied (``map_files``)
    tensors_in_checkpoint: int = 0
    params_loaded: int = 0


@dataclass
class _Target:
    hf_names: tuple[str, ...]
    convert: Mapping
    params: list[torch.Tensor] = field(default_factory=list)


def hf_weight_map(hf_dir: str) -> dict[str, str]:
    """HF parameter name -> safetensors file (sharded index, or the single-file checkpoint)."""
    index = os.path.join(hf_dir, INDEX_NAME)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as fh:
            return dict(json.load(fh)["weight_map"])
    single = os.path.join(hf_dir, SINGLE_NAME)
    if not os.path.isfile(single):
        raise ModelError(f"{hf_dir!r} has neither {INDEX_NAME} nor {SINGLE_NAME}: no safetensors weights to load "
                         "(.bin checkpoints are not supported; re-save the model with safe_serialization=True).")
    with SafetensorsFile(single) as fh:
        return {name: SINGLE_NAME for name in fh.keys()}


def load_hf_weights(chunks: list[torch.nn.Module], config: McaModelConfig, hf_dir: str,
                    placements: list[layout.Placement] | None = None, coords: dict[str, int] | None = None,
                    map_files: bool = False) -> LoadReport:
    """Fill ``chunks`` (this rank's) from the HF checkpoint in ``hf_dir``; strict both ways.

    ``placements``/``coords`` default to this rank's (from Megatron's parallel state); tests pass
    them to load a chunk as any rank would, without process groups. ``map_files``: a parameter whose HF
    inputs are stored whole, in its order and at its dtype, one after the other in one file (a 1:1 rename;
    gate then up) becomes a view of the file's private memory map instead of a copy
    (``SafetensorsFile.mapped``): for a model that is only saved again (``roll-convert hf2mca``), not trained.
    """
    coords = coords if coords is not None else rank_coordinates()
    template = template_for(config)
    weight_map = fused_experts.expand_weight_map(hf_weight_map(hf_dir), template, config)
    targets = _targets(chunks, placements, config, template)
    _zero_absent_optional(targets, template, weight_map)
    missing = {n for t in targets.values() for n in t.hf_names} - set(weight_map)
    layer_patterns: dict[bool, set[str]] = {True: set(), False: set()}  # by layer kind: MoE or dense
    for canonical, target in targets.items():
        if "{layer}" in target.convert.mca:
            layer_patterns[config.is_moe_layer(layout.layer_index(canonical))].add(target.convert.mca)
    mtp = _multi_token_prediction(weight_map, config)
    unused = [name for name in weight_map if name not in mtp and name not in template.ignored
              and not _used_by_model(template, name, config, layer_patterns)]
    check_weights_match(hf_dir, missing=missing, unexpected=unused, model_type=config.hf_model_type,
                        checkpoint_size=len(weight_map))  # strict both ways, the standard backend's message
    report = LoadReport(tensors_in_checkpoint=len(weight_map))
    _stream(targets, config, hf_dir, weight_map, report, coords, map_files)
    return report


def _zero_absent_optional(targets: dict[str, _Target], template: Template, weight_map: dict[str, str]) -> None:
    """Parameters filled only from the template's optional HF tensors, none of which the checkpoint holds,
    start at zero and leave ``targets`` (a reward head trained from a causal LM)."""
    for canonical in [c for c, t in targets.items()
                      if set(t.hf_names) <= set(template.optional) and not set(t.hf_names) & set(weight_map)]:
        with torch.no_grad():
            for param in targets.pop(canonical).params:
                param.zero_()


def _used_by_model(template: Template, hf_name: str, config: McaModelConfig,
                   layer_patterns: dict[bool, set[str]]) -> bool:
    """Whether the whole model (every rank's part) reads ``hf_name``. A rank reads only its own layers and
    experts, but every rank holds at least one layer and all layers of a kind (MoE or dense) have the same
    parameters, so a layer tensor is read by some rank when the template maps it, its layer / expert index
    exists in this config and its Megatron parameter is one of this rank's layers of that kind
    (``layer_patterns``: e.g. no q/k/v bias in a model without one). A rank without a layer of that kind
    (a pipeline stage of dense first layers only) checks the MLP rows by their kind and the others against
    its layers of the other kind. Tensors outside layers (embedding, final norm, head) live on the first or
    last pipeline stage only: mapped is enough."""
    try:
        match, _ = template.match_hf(hf_name)
    except ModelError:
        return False
    layer, expert = match.index.get("layer"), match.index.get("expert")
    if layer is None:
        return True
    if layer >= config.num_layers or (expert is not None and expert >= (config.num_moe_experts or 0)):
        return False
    moe, pattern = config.is_moe_layer(layer), match.mapping.mca
    if layer_patterns[moe]:
        return pattern in layer_patterns[moe]
    kind = _mlp_kind(pattern)
    return kind == moe if kind is not None else pattern in layer_patterns[not moe]


def _mlp_kind(pattern: str) -> bool | None:
    """True for a Megatron MoE layer's MLP parameter, False for a dense layer's, None outside the MLP."""
    if any(part in pattern for part in (".mlp.router.", ".mlp.experts.", ".mlp.shared_experts.")):
        return True
    return False if ".mlp." in pattern else None


def _multi_token_prediction(weight_map: dict[str, str], config: McaModelConfig) -> set[str]:
    """The tensors of the multi-token-prediction layers a DeepSeek-V3 / GLM-4.5 checkpoint stores after its
    decoder layers (``model.layers.{num_hidden_layers + i}.*``, ``num_nextn_predict_layers`` of them). They
    are not part of HF's model (transformers ignores them too) and roll does not train them: they are left
    out, saying so once, and an exported model does not have them."""
    first, count = config.num_layers, int(config.hf_config.get("num_nextn_predict_layers") or 0)
    mtp = {name for name in weight_map if (layer := layout.hf_layer_index(name)) is not None
           and first <= layer < first + count}
    if mtp:
        log_rank0(logger, "%d tensors of the %d multi-token-prediction layer(s) model.layers.%s.* of the "
                  "checkpoint are not loaded: they are not part of the HF model, roll does not train them, "
                  "and the exported model will not have them (copy them from the original checkpoint for "
                  "MTP speculative decoding).", len(mtp), count,
                  first if count == 1 else f"{{{first}..{first + count - 1}}}", level=logging.WARNING)
    return mtp


def _targets(chunks: list[torch.nn.Module], placements: list[layout.Placement] | None, config: McaModelConfig,
             template: Template) -> dict[str, _Target]:
    """Canonical global Megatron name -> the HF inputs and this rank's parameters it fills."""
    targets: dict[str, _Target] = {}
    for canonical, param in canonical_tensors(chunks, config, placements):
        source = canonical
        if canonical == "output_layer.weight" and config.tie_embeddings_and_output_weights:
            source = "embedding.word_embeddings.weight"  # last PP stage's copy of the tied embedding
        match = template.match_mca(source)
        target = targets.setdefault(canonical, _Target(match.hf_names, match.mapping))
        target.params.append(param)
    return targets


def _stream(targets: dict[str, _Target], config: McaModelConfig, hf_dir: str, weight_map: dict[str, str],
            report: LoadReport, coords: dict[str, int], map_files: bool = False) -> None:
    """Read the needed tensors file by file (sorted), each into its place in its parameter when
    ``_whole_slots`` finds one, else into a buffer held only until its mapping is complete."""
    tp, etp = (coords["tp_size"], coords["tp_rank"]), (coords["etp_size"], coords["etp_rank"])
    expand = functools.partial(fused_experts.expand_header, template=template_for(config), config=config)
    waiting: dict[str, set[str]] = defaultdict(set)  # HF name -> canonical names still needing it
    for canonical, target in targets.items():
        for hf_name in target.hf_names:
            waiting[hf_name].add(canonical)
    by_file: dict[str, list[str]] = defaultdict(list)
    for hf_name in waiting:
        by_file[weight_map[hf_name]].append(hf_name)
    total, info = 0, {}
    for file in by_file:
        with SafetensorsFile(os.path.join(hf_dir, file), expand) as fh:
            total += sum(fh.nbytes(name) for name in by_file[file])
            info.update((name, fh.info(name)) for name in by_file[file])
    slots = _whole_slots(targets, waiting, info, config, (tp, etp))
    unread = {canonical: len(targets[canonical].hf_names) for canonical, _ in slots.values()}
    buffer: dict[str, torch.Tensor] = {}
    start = time.perf_counter()
    with byte_progress(total, "read HF weights") as bar:
        for file in sorted(by_file):
            report.files_read.append(file)
            with SafetensorsFile(os.path.join(hf_dir, file), expand) as fh:
                mapped = _map_whole(fh, by_file[file], slots, targets) if map_files else set()
                for hf_name in sorted(by_file[file]):
                    report.tensors_read += 1
                    report.bytes_read += fh.nbytes(hf_name)
                    bar.update(fh.nbytes(hf_name))
                    if hf_name in slots:  # into its place: the one parameter that needs it
                        canonical, views = slots[hf_name]
                        if hf_name in mapped:  # the parameter is the file's bytes already
                            report.bytes_mapped += fh.nbytes(hf_name)
                        elif info[hf_name][0] == views[0].dtype:
                            fh.read_into(hf_name, views)
                        else:  # converted into place from a buffer of this one tensor
                            _copy_into(fh.read(hf_name), views)
                        del waiting[hf_name]
                        unread[canonical] -= 1
                        report.params_loaded += 0 if unread[canonical] else len(targets[canonical].params)
                        continue
                    buffer[hf_name] = fh.read(hf_name)
                    _fill_ready(hf_name, waiting, targets, buffer, config, tp, etp, report)
    assert not buffer, f"HF tensors read but never consumed: {sorted(buffer)}"
    elapsed = time.perf_counter() - start
    mapped = f"; {report.bytes_mapped / 1e9:.2f} GB of them mapped, not copied" if report.bytes_mapped else ""
    log_rank0(logger, "read %.2f GB of HF weights from %d file(s) in %.1fs (%.2f GB/s%s)", report.bytes_read / 1e9,
              len(report.files_read), elapsed, report.bytes_read / 1e9 / max(elapsed, 1e-9), mapped)


def _whole_slots(targets: dict[str, _Target], waiting: dict[str, set[str]],
                 info: dict[str, tuple[torch.dtype, list[int]]], config: McaModelConfig,
                 sizes: tuple[tuple[int, int], tuple[int, int]]) -> dict[str, tuple[str, list[torch.Tensor]]]:
    """HF name -> (its parameter's canonical name, the views of the parameter its elements fill), for every
    parameter filled input by input: one parameter that this rank holds whole (no TP split, no vocab
    padding), whose HF inputs feed nothing else and fill it exactly (``Mapping.slots``). A padded vocab, a
    TP shard or a tensor shared by two parameters (tied embeddings) goes through ``_fill``."""
    out = {}
    for canonical, target in targets.items():
        if len(target.params) != 1 or any(waiting[name] != {canonical} for name in target.hf_names):
            continue
        if sharding.tp_size_rank(canonical, *sizes)[0] != 1 and sharding.tp_kind(canonical, config) != "replicated":
            continue
        param = target.params[0].data
        views = target.convert.slots(param, config) if param.device.type == "cpu" and param.is_contiguous() else None
        if views is None:
            continue
        fits = all(math.prod(info[name][1]) == sum(v.numel() for v in slot)
                   for name, slot in zip(target.hf_names, views))
        if fits and sum(v.numel() for slot in views for v in slot) == param.numel():
            out.update((name, (canonical, slot)) for name, slot in zip(target.hf_names, views))
    return out


def _map_whole(fh: SafetensorsFile, names: list[str], slots: dict[str, tuple[str, list[torch.Tensor]]],
               targets: dict[str, _Target]) -> set[str]:
    """Make every parameter of ``slots`` that ``fh`` stores whole (its inputs ``names`` of this file, each filling
    one slot, the slots in order over the whole parameter, their bytes one after the other in the file at its
    dtype) a view of the file's memory map; the HF names so served."""
    served: set[str] = set()
    for canonical in sorted({slots[name][0] for name in names if name in slots}):
        hf_names, param = targets[canonical].hf_names, targets[canonical].params[0]
        if not set(hf_names) <= set(names) or any(len(slots[name][1]) != 1 for name in hf_names):
            continue
        at = param.data_ptr()
        for view in (slots[name][1][0] for name in hf_names):
            at = at + view.nbytes if view.data_ptr() == at and view.dtype == param.dtype else -1
        span = fh.mapped(list(hf_names), param.dtype) if at == param.data_ptr() + param.nbytes else None
        if span is not None:
            param.data = span.view(param.shape)
            served.update(hf_names)
    return served


def _copy_into(tensor: torch.Tensor, views: list[torch.Tensor]) -> None:
    """``tensor``'s elements, in order, into ``views`` (converting the dtype), as ``read_into`` does from a file."""
    flat, at = tensor.reshape(-1), 0
    with torch.no_grad():
        for view in views:
            view.copy_(flat[at:at + view.numel()].view(view.shape))
            at += view.numel()


def _fill_ready(hf_name: str, waiting: dict[str, set[str]], targets: dict[str, _Target],
                buffer: dict[str, torch.Tensor], config: McaModelConfig, tp: tuple[int, int],
                etp: tuple[int, int], report: LoadReport) -> None:
    """Convert every mapping ``hf_name`` completes, then drop the buffered inputs nothing waits for."""
    for canonical in sorted(waiting[hf_name]):
        target = targets[canonical]
        if all(n in buffer for n in target.hf_names):
            _fill(canonical, target, [buffer[n] for n in target.hf_names], config, tp, etp)
            report.params_loaded += len(target.params)
            for n in target.hf_names:
                waiting[n].discard(canonical)
    for n in [n for n in buffer if not waiting[n]]:
        del buffer[n]  # no pending mapping needs it any more


def _fill(canonical: str, target: _Target, tensors: list[torch.Tensor], config: McaModelConfig,
          tp: tuple[int, int], etp: tuple[int, int]) -> None:
    full = target.convert.to_mca(tensors, config)
    shard = sharding.shard_for_rank(canonical, full, config, tp, etp)
    for param in target.params:
        if param.shape != shard.shape:
            raise ModelError(f"{canonical}: the converted HF weight has shape {tuple(shard.shape)} on this rank, the "
                             f"Megatron parameter {tuple(param.shape)}. Does config.json match the weights?")
        with torch.no_grad():
            param.copy_(shard)
