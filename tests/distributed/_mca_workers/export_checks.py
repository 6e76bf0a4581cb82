"""Worker: train at a layout, export to HF, reload the export, compare its logits with the trained model's.

usage: torchrun --nproc_per_node=2 export_checks.py SPEC.json RESULT.json

SPEC.json: {"base": {recipe keys}, "runs": [{"name": str, "overrides": {key: value}}, ...]}. Each run trains
with ``roll.router.run`` (the production path: train, then ``McaBackend.save`` exports the final model) and
is observed, never steered, at two points:

- before the last training step: Megatron's parameter all-gather is forced (``start_param_sync(force_sync=
  True)``, so every rank holds the weights of step N-1 whatever the overlap options deferred) and the
  model's logits on a fixed batch are kept: ``before_last_step``;
- after the export returned: the same forced all-gather (now the last update's weights), the trained model's
  logits on the same batch (``backends.mca.convert.megatron_logits``, a plain forward through the pipeline),
  and the export loaded with transformers from disk and run on that batch.

Rank 0 writes {name: {"losses": [...], "export_vs_trained": max |diff|, "last_step_moved": max |diff| between
the trained model's logits before and after the last step, "logit_scale": max |logit|}} to RESULT.json. The
observation forces the all-gather itself, so an export that skipped it (or read the weights from before the
last step) differs from the trained model by what the last step moved.
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def trained_logits(ddp_chunks: list[torch.nn.Module]) -> torch.Tensor | None:
    """The model's logits on a fixed batch, after forcing the distributed optimizer's all-gather (on the
    last pipeline stage; None on the others)."""
    from backends.mca.convert import megatron_logits, sample_input_ids
    from backends.mca.models.unwrap import unwrap_model

    for chunk in ddp_chunks:
        if chunk.ddp_config.use_distributed_optimizer:
            chunk.start_param_sync(force_sync=True)
    bare = [unwrap_model(chunk) for chunk in ddp_chunks]
    config = bare[0].config
    logits = megatron_logits(bare, config, sample_input_ids(config.vocab_size))
    for chunk in ddp_chunks:
        chunk.train()  # megatron_logits leaves the chunks in eval mode
    return logits


def to_rank0(logits: torch.Tensor | None) -> torch.Tensor | None:
    """Global rank 0's copy of the logits: its own, or under PP the last stage's (sent by its first TP/DP
    rank)."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return logits if dist.get_rank() == 0 else None
    sender = (ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
              and ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0)
    if sender:
        dist.send(logits.contiguous(), dst=0)
    if dist.get_rank() == 0:
        logits = torch.empty(OBSERVED["shape"])
        dist.recv(logits)
    return logits


OBSERVED: dict = {}


def observe() -> None:
    """Wrap the trainer's step and the backend's save to record the logits described in the module doc."""
    from backends.mca.backend import McaBackend
    from backends.mca.convert import hf_logits, sample_input_ids
    from backends.mca.trainer.loop import MegatronTrainer

    train_step, save = MegatronTrainer._train_step, McaBackend.save

    def observed_step(self, *args, **kwargs):
        if self.state.global_step == self.training.max_steps - 1:
            OBSERVED["vocab_size"] = self.model_config.vocab_size
            OBSERVED["shape"] = (*sample_input_ids(1).shape, self.model_config.vocab_size)
            OBSERVED["before"] = to_rank0(trained_logits(self.chunks))
        return train_step(self, *args, **kwargs)

    def observed_save(self, models, tokenizer, output_dir):
        written = save(self, models, tokenizer, output_dir)
        OBSERVED["trained"] = to_rank0(trained_logits(self._trainer.chunks))
        if dist.get_rank() == 0:
            OBSERVED["export"] = hf_logits(written, sample_input_ids(OBSERVED["vocab_size"]))
        dist.barrier()
        return written

    MegatronTrainer._train_step, McaBackend.save = observed_step, observed_save


def run_one(spec: dict, item: dict) -> dict | None:
    from roll.router import run

    from spec_runs import recipe_config

    OBSERVED.clear()
    result = run(recipe_config(spec, item, save_hf_model=True))
    if dist.get_rank() != 0:
        return None
    trained, export, before = OBSERVED["trained"], OBSERVED["export"], OBSERVED["before"]
    return {"losses": [entry["loss"] for entry in result.log_history if "loss" in entry],
            "export_vs_trained": (export - trained).abs().max().item(),
            "last_step_moved": (trained - before).abs().max().item(),
            "logit_scale": trained.abs().max().item()}


if __name__ == "__main__":
    from spec_runs import main

    main(run_one, setup=observe)
