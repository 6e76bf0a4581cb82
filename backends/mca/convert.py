"""Library functions behind ``roll-convert``: HF -> Megatron, Megatron -> HF, and the logits parity check.

All three are collective: under ``torchrun`` every rank calls them with the same arguments. The
parity check is the production path (AutoModel.from_pretrained on the HF directory), so a passing
check means the converter, sharding and streaming loader agree with Hugging Face's model.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from backends.mca.models.auto import AutoModel, save_mca
from backends.mca.models.config import McaModelConfig
from backends.mca.models.export import save_hf
from backends.mca.models.gpt import model_device
from roll.config.layout import ParallelLayout
from roll.config.megatron import MegatronArguments
from roll.errors import ModelError
from roll.hf_config import has_hf_config
from roll.logging import log_rank0

logger = logging.getLogger(__name__)


def megatron_settings(tp: int = 1, pp: int = 1, vpp: int | None = None, ep: int = 1,
                      etp: int | None = None) -> tuple[MegatronArguments, ParallelLayout]:
    """The Megatron settings of a conversion and its one ParallelLayout (world size from the launcher).

    Built once per command (``roll-convert`` does it from ``--tp/--pp/--vpp/--ep/--etp``) and passed
    to every function below, as a training run passes ``RunConfig.megatron`` and ``RunConfig.layout``.
    """
    megatron = MegatronArguments(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vpp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=etp)
    return megatron, megatron.build_layout(int(os.environ.get("WORLD_SIZE", "1")))


def load_chunks(path: str, megatron: MegatronArguments, layout: ParallelLayout,
                map_files: bool = False) -> list[torch.nn.Module]:
    """Initialise Megatron for ``layout`` (idempotent) and load ``path`` (HF or Megatron) at it."""
    from backends.mca.initialize import initialize_megatron

    initialize_megatron(layout)
    return AutoModel.from_pretrained(path, megatron, map_files=map_files)


def hf_to_mca(hf_dir: str, out_dir: str, megatron: MegatronArguments, layout: ParallelLayout) -> McaModelConfig:
    """Convert an HF checkpoint to a Megatron (torch_dist) checkpoint with ``mca_config.json``."""
    # Only saved again: the parameters stored whole in the HF files stay the page cache's pages (no fresh memory
    # to fault in, no copy), and the writer copies them to the new files once.
    chunks = load_chunks(hf_dir, megatron, layout, map_files=True)
    config = chunks[0].config
    save_mca(chunks, config, out_dir, tokenizer_dir=hf_dir)
    log_rank0(logger, "wrote Megatron checkpoint to %s", out_dir)
    return config


def mca_to_hf(mca_dir: str, out_dir: str, megatron: MegatronArguments, layout: ParallelLayout,
              max_shard_bytes: int = 2 * 1024**3) -> None:
    """Export a Megatron checkpoint (any saved layout, loaded at ``layout``) as a standard HF checkpoint."""
    # Only written out again: the parameters stored whole in the checkpoint's files stay the page cache's pages
    # (no read into fresh memory), and the HF writer copies them to the new files once.
    chunks = load_chunks(mca_dir, megatron, layout, map_files=True)
    save_hf(chunks, out_dir, max_shard_bytes=max_shard_bytes, tokenizer_dir=mca_dir)


def sample_input_ids(vocab_size: int, batch: int = 2, seq_len: int = 16, seed: int = 1234) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq_len), generator=gen)


def vision_language(config: McaModelConfig) -> bool:
    """Whether the model has a vision tower (Qwen2.5-VL): its check batch has images, its HF class is not a causal LM."""
    return "vision_config" in config.hf_config


def check_batch(config: McaModelConfig, seq_len: int = 16) -> dict[str, torch.Tensor]:
    """The fixed batch ``check_parity`` compares on: random tokens, for a vision-language model with two images
    of different sizes and a text-only row (``backends.mca.models.qwen2_5_vl.sample_batch``)."""
    if vision_language(config):
        from backends.mca.models.qwen2_5_vl import sample_batch

        return sample_batch(config.hf_config, seq_len)
    return {"input_ids": sample_input_ids(config.vocab_size, seq_len=seq_len)}


@torch.no_grad()
def megatron_logits(chunks: list[torch.nn.Module], config: McaModelConfig,
                    input_ids: torch.Tensor, **images: torch.Tensor) -> torch.Tensor | None:
    """Full-vocab logits ``[b, s, vocab]`` on the last pipeline stage (None on other stages).

    A plain forward through the (virtual) pipeline: each stage receives the previous stage's
    hidden states, runs its chunk and passes them on, in chunk order (v, p) -> (v, p + 1) -> ...
    ``images`` (``pixel_values``, ``image_grid_thw``) go to every chunk of a vision-language model, which computes
    its M-RoPE positions from them on every stage and encodes the images on the first.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    pp, pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    device = model_device()
    input_ids = input_ids.to(device)
    batch, seq = input_ids.shape
    images = {name: tensor.to(device) for name, tensor in images.items()}
    position_ids = None if vision_language(config) else torch.arange(seq, device=device).unsqueeze(0).expand(batch, -1)
    local_seq = seq // config.tensor_model_parallel_size if config.sequence_parallel else seq
    logits = None
    for stage, chunk in enumerate(chunks):  # this rank's chunk `stage` is virtual stage stage * pp + pp_rank
        chunk.eval()
        first, last = stage == 0 and pp_rank == 0, stage == len(chunks) - 1 and pp_rank == pp - 1
        if not first:
            hidden = torch.empty(local_seq, batch, config.hidden_size, dtype=config.params_dtype, device=device)
            dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
            chunk.set_input_tensor(hidden)
        out = chunk(input_ids, position_ids, attention_mask=None, **images)
        if last:
            logits = gather_from_tensor_model_parallel_region(out)[..., : config.vocab_size].cpu()
        else:
            dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
    return logits


def hf_logits(hf_dir: str, input_ids: torch.Tensor, **images: torch.Tensor) -> torch.Tensor:
    """HF's logits on the batch; with ``images`` (a vision-language model) also the modality of each token, without
    which transformers would use 1-D positions (``roll.mrope``)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from roll.hf_config import read_hf_config
    from roll.mrope import mm_token_type_ids

    hf_config = read_hf_config(hf_dir)
    auto = AutoModelForImageTextToText if "vision_config" in hf_config else AutoModelForCausalLM
    model = auto.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="sdpa")
    if "vision_config" in hf_config:
        images = {**images, "mm_token_type_ids": mm_token_type_ids(input_ids, hf_config)}
    with torch.no_grad():
        return model.eval()(input_ids=input_ids, **images).logits


def check_parity(hf_dir: str, megatron: MegatronArguments, layout: ParallelLayout, seq_len: int = 16) -> float:
    """Max |HF logits - Megatron logits| (fp32) over a fixed random batch, the same on every rank."""
    if os.path.isdir(hf_dir) and not has_hf_config(hf_dir):  # checked before minutes of Megatron loading
        raise ModelError(f"{hf_dir!r} has no HF config.json: the check needs an HF checkpoint to compare with "
                         "(export a Megatron checkpoint with `roll-convert mca2hf` first).")
    chunks = load_chunks(hf_dir, megatron, layout)
    config = chunks[0].config
    batch = check_batch(config, seq_len)
    logits = megatron_logits(chunks, config, **batch)
    diff = torch.zeros((), device=model_device())  # nccl reduces device tensors only
    if logits is not None:
        diff.fill_((logits.float() - hf_logits(hf_dir, **batch)).abs().max().item())
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return float(diff)
