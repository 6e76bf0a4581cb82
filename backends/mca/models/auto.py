"""AutoConfig / AutoModel: Megatron model chunks from an HF or a roll Megatron checkpoint directory.

``AutoModel.from_pretrained(path, megatron_args, bf16=..., fp16=...)`` decides how to load:

- ``mca_config.json`` present and its layout equals the requested one -> load the Megatron
  checkpoint directly;
- present but the layout differs -> reshard it (Megatron dist checkpointing loads any layout),
  or, when it has no weights, convert from the HF ``config.json`` + safetensors next to it;
- only an HF ``config.json`` -> convert the HF weights on the fly (streaming, per rank).

It returns the list of model chunks, one per virtual pipeline stage. Megatron must be initialised
first for the run's ParallelLayout (``initialize_megatron``; ``McaBackend.setup_distributed`` and
``roll-convert`` do), and ``megatron_args`` must be the settings that layout was built from.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch

from backends.mca.models.config import MCA_CONFIG_NAME, McaModelConfig, parallel_overrides
from backends.mca.models.gpt import build_model_chunks
from backends.mca.models.loader import load_hf_weights
from roll.errors import ModelError
from roll.hf_config import HF_CONFIG_FILE, has_hf_config, read_hf_config
from roll.logging import log_rank0

if TYPE_CHECKING:
    from roll.config.megatron import MegatronArguments

logger = logging.getLogger(__name__)


def has_mca_config(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MCA_CONFIG_NAME))


def has_megatron_weights(path: str) -> bool:
    """A torch_dist checkpoint (written by ``backends.mca.checkpoint``) lives in ``path``."""
    from backends.mca.checkpoint import is_dist_checkpoint

    return is_dist_checkpoint(path)


class AutoConfig:
    @staticmethod
    def from_pretrained(path: str, megatron_args: MegatronArguments | None = None, *, bf16: bool = False,
                        fp16: bool = False, **overrides: Any) -> McaModelConfig:
        """The model config for ``path`` with the run's Megatron settings and precision applied.

        ``megatron_args`` None means ``MegatronArguments()`` (TP1, PP1, ..., transformer_impl auto);
        ``overrides`` are McaModelConfig fields and win over both.
        """
        _check_dir(path)
        kwargs = {**parallel_overrides(megatron_args, bf16=bf16, fp16=fp16), **overrides}
        if has_mca_config(path):
            return McaModelConfig.from_pretrained(path, **kwargs)
        return McaModelConfig.from_hf(read_hf_config(path), **kwargs)


class AutoModel:
    @staticmethod
    def from_pretrained(path: str, megatron_args: MegatronArguments | None, *, bf16: bool = False,
                        fp16: bool = False, map_files: bool = False, **overrides: Any) -> list[torch.nn.Module]:
        """This rank's model chunks for ``path`` (see the module docstring), weights loaded. ``map_files``: the
        parameters stored whole become views of the files' private memory maps (``loader.load_hf_weights``' and
        ``checkpoint.load_checkpoint``'s ``map_files``), for a model that is only saved again."""
        _check_dir(path)
        config = AutoConfig.from_pretrained(path, megatron_args, bf16=bf16, fp16=fp16, **overrides)
        chunks = _build_uninitialised(config)
        if has_mca_config(path) and has_megatron_weights(path):
            saved = McaModelConfig.from_pretrained(path)
            how = "directly" if saved.distribute_config_match(config) else "resharding from its saved layout"
            log_rank0(logger, "loading Megatron checkpoint %s %s", path, how)
            from backends.mca.checkpoint import load_checkpoint

            load_checkpoint(chunks, path, map_files=map_files)
        elif has_hf_config(path):
            from roll.model_dir import check_weight_files

            check_weight_files(path, use_mca=True)  # missing, .bin-only or truncated: a ModelError naming it
            log_rank0(logger, "converting HF checkpoint %s to Megatron on the fly", path)
            load_hf_weights(chunks, config, path, map_files=map_files)
        else:
            raise ModelError(f"{path!r} has {MCA_CONFIG_NAME} but no Megatron weights and no HF "
                             f"{HF_CONFIG_FILE} "
                             "to convert from.")
        return chunks


def _build_uninitialised(config: McaModelConfig) -> list[torch.nn.Module]:
    """Chunks without random init: every weight is overwritten next (the loaders are strict), and
    initialising a large model on the CPU only to discard it takes minutes."""
    previous, config.perform_initialization = config.perform_initialization, False
    try:
        return build_model_chunks(config)
    finally:
        config.perform_initialization = previous


def save_mca(chunks: list[torch.nn.Module], config: McaModelConfig, out_dir: str,
             tokenizer_dir: str | None = None) -> None:
    """Write a Megatron checkpoint (torch_dist, loadable at any layout) plus ``mca_config.json``
    (and the tokenizer files of ``tokenizer_dir``, so the directory stays a usable model).

    Files are not fsync'ed (as ``save_pretrained``): the OS writes them back; a conversion can be rerun."""
    import torch.distributed as dist

    from backends.mca.checkpoint import save_checkpoint

    save_checkpoint(chunks, out_dir, sync_files=False)
    if dist.get_rank() == 0:
        config.save_pretrained(out_dir)
        if tokenizer_dir:
            from backends.mca.models.export import copy_tokenizer_files

            copy_tokenizer_files(tokenizer_dir, out_dir)
    dist.barrier()


def _check_dir(path: str) -> None:
    if not os.path.isdir(path):
        raise ModelError(f"model path {path!r} is not a directory (roll loads local checkpoints only).")
    if not has_mca_config(path) and not has_hf_config(path):
        raise ModelError(f"{path!r} has neither {MCA_CONFIG_NAME} nor {HF_CONFIG_FILE}: not a model "
                         "directory.")
