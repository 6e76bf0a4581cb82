"""Write the final model in Hugging Face format: full weights, or a LoRA adapter (+ merged model).

The directory loads with ``AutoModelForCausalLM.from_pretrained`` (full/freeze) or
``PeftModel.from_pretrained`` (lora) and carries the tokenizer with its chat template.
"""

from __future__ import annotations

import logging
import os
import shutil

from backends.standard._compat import drop_hf_deepspeed_config
from roll.logging import is_rank0, log_rank0
from roll.outputs import remove_stale_weights, weight_file_states, written_since
from roll.reliability import barrier

logger = logging.getLogger(__name__)

MERGED_SUBDIR = "merged"
"""With export_merged: the merged base + adapter model is written to OUTPUT_DIR/merged."""


def save_final_model(trainer, tokenizer, output_dir: str) -> str:
    """Save through the trainer on every rank (ZeRO-3 gathers the partitioned weights collectively)."""
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    config = getattr(unwrapped, "config", None)
    if config is not None:
        config.use_cache = True  # training turned the KV cache off; inference wants it back
        config.get_text_config().use_cache = True  # a VL model's language model's too
    before = weight_file_states(output_dir)
    trainer.save_model(output_dir)
    barrier()
    if is_rank0():
        tokenizer.save_pretrained(output_dir)
        for name in remove_stale_weights(output_dir, keep=written_since(output_dir, before)):
            logger.info("removed %s from %s: weights of an earlier save, another layout", name, output_dir)
        if "ref" in (getattr(unwrapped, "peft_config", None) or {}):
            # TRL's DPO keeps a frozen copy of the adapter as "ref" for the reference;
            # only the trained one ships.
            shutil.rmtree(os.path.join(output_dir, "ref"), ignore_errors=True)
    barrier()
    return output_dir


def export_merged(base_model_path: str, adapter_dir: str, tokenizer, *,
                  trust_remote_code: bool = False) -> str:
    """Merge the saved adapter into a fresh copy of the base model, on rank 0 only.

    Done from the saved files, not the live (maybe ZeRO-3 partitioned) model, so every DeepSpeed
    stage takes the same path; the HF DeepSpeed config is dropped first (W4) so this rank-0-only
    ``from_pretrained`` does not enter ZeRO-3 collectives.
    """
    out = os.path.join(adapter_dir, MERGED_SUBDIR)
    drop_hf_deepspeed_config()
    if is_rank0():
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(base_model_path, dtype="auto",
                                                    trust_remote_code=trust_remote_code)
        merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
        merged.config.use_cache = True
        merged.save_pretrained(out)
        tokenizer.save_pretrained(out)
        log_rank0(logger, "merged model (base + LoRA adapter) written to %s", out)
    barrier()
    return out
