"""Megatron chunks -> a standard HF checkpoint (``model-0000x-of-0000y.safetensors`` + index + config.json).

The model is gathered one unit at a time (embedding, each decoder layer, final norm + output layer):
the tensor-parallel (or expert-TP) group all-gathers its shards, one holder per tensor sends it to
global rank 0, which converts the unit to HF names and appends it to the current shard file.
Rank 0 therefore holds one layer plus one output shard at a time, not the whole model.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from backends.mca.models import sharding
from backends.mca.models.gpt import canonical_tensors, model_device
from backends.mca.models.loader import INDEX_NAME
from backends.mca.models.safetensors_io import write_file
from backends.mca.models.template import template_for
from backends.mca.models.unwrap import unwrap_model
from roll.logging import byte_progress, log_rank0
from roll.outputs import remove_stale_weights

if TYPE_CHECKING:
    from backends.mca.models.config import McaModelConfig

logger = logging.getLogger(__name__)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "chat_template.jinja", "generation_config.json", "added_tokens.json", "tokenizer.model",
                   "preprocessor_config.json", "processor_config.json")  # a vision-language model's image processor
_PRE = ("embedding.", "visual.")  # the first pipeline stage's: embedding and a vision tower
_POST = ("decoder.final_layernorm.", "output_layer.")


def save_hf(chunks: list[torch.nn.Module], out_dir: str, *, max_shard_bytes: int = 2 * 1024**3,
            tokenizer_dir: str | None = None, config_updates: dict | None = None) -> None:
    """Write the full model in HF format to ``out_dir`` (collective: every rank must call it).
    ``config_updates``: config.json fields the run decides (a reward model's ``pad_token_id``).

    ``chunks`` may be wrapped for training (Megatron DDP, Float16Module, PEFT): names and the model
    config come from the bare model (``unwrap_model``), placements from Megatron's parameter tags.
    """
    config: McaModelConfig = unwrap_model(chunks[0]).config
    template = template_for(config)
    local = {name: (tensor, sharding.param_tp_kind(name, tensor, config))
             for name, tensor in canonical_tensors(chunks, config)}
    units = ["pre", *range(config.num_layers), "post"]
    start = time.perf_counter()
    with byte_progress(_hf_bytes(local, config), "write HF weights") as bar:
        writer = _ShardWriter(out_dir, max_shard_bytes, bar) if dist.get_rank() == 0 else None
        for unit in units:
            mine = {name: t for name, t in local.items() if _unit_of(name) == unit}
            gathered = gather_unit(mine)
            if writer is not None:
                full = {name: sharding.unpad_vocab(name, t, config) for name, t in gathered.items()}
                if config.tie_embeddings_and_output_weights:
                    full.pop("output_layer.weight", None)  # HF ties lm_head to embed_tokens itself
                writer.add(template.mca_to_hf(full, config))
        if writer is not None:
            written = writer.finish()
    if writer is not None:
        for name in remove_stale_weights(out_dir, keep=written):
            log_rank0(logger, "removed %s from %s: weights of an earlier save, another layout", name, out_dir)
        _write_config({**template.hf_config_dict(config), **(config_updates or {})}, out_dir)
        if tokenizer_dir:
            copy_tokenizer_files(tokenizer_dir, out_dir)
        elapsed = time.perf_counter() - start
        log_rank0(logger, "wrote HF checkpoint to %s (%d shard files, %.2f GB, %.2f GB of it copied file to file) in "
                  "%.1fs (%.2f GB/s)", out_dir, len(writer.files), writer.bytes_written / 1e9, writer.bytes_copied / 1e9,
                  elapsed, writer.bytes_written / 1e9 / elapsed)
    dist.barrier()


def _hf_bytes(local: dict[str, tuple[torch.Tensor, sharding.Kind]], config: McaModelConfig) -> int:
    """Bytes of the HF tensors ``save_hf`` writes (collective): each holder's shard times its (expert-)
    tensor-parallel size, without the vocab padding and the tied output layer, summed over ranks."""
    from megatron.core import parallel_state as ps

    total = 0
    for name, (tensor, kind) in local.items():
        expert = sharding.is_expert(name)
        if not _is_holder(expert) or (name == "output_layer.weight" and config.tie_embeddings_and_output_weights):
            continue
        size = ps.get_expert_tensor_parallel_world_size() if expert else ps.get_tensor_model_parallel_world_size()
        nbytes = tensor.numel() * tensor.element_size() * (1 if kind == "replicated" else size)
        if name in sharding.VOCAB_TENSORS:
            nbytes = nbytes * config.vocab_size // config.padded_vocab_size
        total += nbytes
    summed = torch.tensor([total], dtype=torch.int64, device=model_device())
    dist.all_reduce(summed)
    return int(summed.item())


def _unit_of(name: str) -> str | int:
    if name.startswith(_PRE):
        return "pre"
    if name.startswith(_POST):
        return "post"
    return int(name.split(".")[2])  # decoder.layers.<n>.


def gather_unit(mine: dict[str, tuple[torch.Tensor, sharding.Kind]]) -> dict[str, torch.Tensor]:
    """All-gather TP shards inside the owning group, then collect one copy of each tensor on rank 0.

    ``mine``: {canonical name: (this rank's tensor, its split kind)}; returns the full tensors on
    global rank 0 and ``{}`` elsewhere (collective; also used by ``backends.mca.lora.export``).
    """
    from megatron.core import parallel_state as ps

    send: dict[str, torch.Tensor] = {}
    for name in sorted(mine):
        expert = sharding.is_expert(name)
        group = ps.get_expert_tensor_parallel_group() if expert else ps.get_tensor_model_parallel_group()
        tensor, kind = mine[name]
        tensor = tensor.detach()
        if kind != "replicated" and dist.get_world_size(group) > 1:
            shards = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
            dist.all_gather(shards, tensor.contiguous(), group=group)
            tensor = sharding.merge(shards, kind)
        if _is_holder(expert):
            send[name] = tensor.cpu()
    rank0 = dist.get_rank() == 0
    received: list[dict] | None = [None] * dist.get_world_size() if rank0 else None
    if dist.get_world_size() > 1:  # rank 0's own tensors stay out of the pickles (all of them at world 1)
        dist.gather_object({} if rank0 else send, received, dst=0)
    if not rank0:
        return {}
    merged: dict[str, torch.Tensor] = dict(send)
    for part in received[1:]:
        for name, tensor in part.items():
            merged.setdefault(name, tensor)
    return merged


def _is_holder(expert: bool) -> bool:
    """Exactly one rank sends each tensor: TP/ETP rank 0 of the first data-parallel replica."""
    from megatron.core import parallel_state as ps

    if expert:
        return ps.get_expert_tensor_parallel_rank() == 0 and ps.get_expert_data_parallel_rank() == 0
    return ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank(with_context_parallel=True) == 0


class _ShardWriter:
    """Appends tensors to ``max_shard_bytes``-sized files, then names them model-0000x-of-0000y; ``progress``
    (a byte counter) advances as each file is written."""

    def __init__(self, out_dir: str, max_shard_bytes: int, progress=None) -> None:
        os.makedirs(out_dir, exist_ok=True)
        self.out_dir, self.max_bytes, self.progress = out_dir, max_shard_bytes, progress
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[str, list[str]]] = []
        self.bytes_written = 0
        self.bytes_copied = 0  # of bytes_written: copied file to file by the kernel (``safetensors_io.write_file``)

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            size = tensor.numel() * tensor.element_size()
            if self.pending and self.pending_bytes + size > self.max_bytes:
                self._flush()
            self.pending[name] = tensor.contiguous()
            self.pending_bytes += size

    def _flush(self) -> None:
        tmp = f"part-{len(self.files):05d}.safetensors.tmp"
        self.bytes_copied += write_file(os.path.join(self.out_dir, tmp), self.pending, metadata={"format": "pt"})
        self.bytes_written += self.pending_bytes
        if self.progress is not None:
            self.progress.update(self.pending_bytes)
        self.files.append((tmp, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> set[str]:
        """Name the shards, write the index; returns the names of the files written."""
        if self.pending:
            self._flush()
        total = len(self.files)
        weight_map, total_size = {}, 0
        for i, (tmp, names) in enumerate(self.files, start=1):
            final = f"model-{i:05d}-of-{total:05d}.safetensors"
            os.replace(os.path.join(self.out_dir, tmp), os.path.join(self.out_dir, final))
            weight_map.update({name: final for name in names})
            total_size += os.path.getsize(os.path.join(self.out_dir, final))
        with open(os.path.join(self.out_dir, INDEX_NAME), "w", encoding="utf-8") as fh:
            json.dump({"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}, fh,
                      indent=2)
        return {*weight_map.values(), INDEX_NAME}


def _write_config(hf_config: dict, out_dir: str) -> None:
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(hf_config, fh, indent=2, sort_keys=True)


def copy_tokenizer_files(src: str, dst: str) -> None:
    """Tokenizer/generation (and image processor) files travel with the weights so the output is a usable model
    dir."""
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy2(os.path.join(src, name), os.path.join(dst, name))
