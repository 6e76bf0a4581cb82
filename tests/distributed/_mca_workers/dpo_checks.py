"""Worker: DPO on Megatron, the pieces the loss tests cannot see.

usage: torchrun --nproc_per_node=N dpo_checks.py MODEL_DIR OUT_DIR [key=value ...]

1. per-token log-probs from this layout's vocab-parallel logits (padded vocabulary included) against
   ``log_softmax`` of the HF model's logits on the same weights;
2. three DPO steps through McaBackend.train: the reference chunks' weights are bit-identical after,
   the policy's changed.
Rank 0 prints ``RESULT {...}``.
"""

from __future__ import annotations

import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, REPO)


def log_prob_error(chunks, model_dir: str, vocab_size: int) -> float:
    """max |Megatron vocab-parallel log-probs - HF log_softmax| over a random batch (last stage; else 0)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from transformers import AutoModelForCausalLM

    from backends.mca.trainer.data import model_inputs
    from backends.mca.trainer.loss import token_log_probs

    tokens = torch.randint(0, vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
    inputs = model_inputs(batch, torch.device("cpu"))
    labels = inputs.pop("labels")
    hidden = None
    error = torch.zeros(())
    with torch.no_grad():
        for chunk in chunks:  # PP1 here: the chunks of one rank form the whole model
            chunk.eval()
            if hidden is not None:
                chunk.set_input_tensor(hidden)
            hidden = chunk(**inputs)
        if ps.is_pipeline_last_stage():
            ours, _ = token_log_probs(hidden, labels, vocab_size)
            hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
            reference = hf(input_ids=batch["input_ids"]).logits.log_softmax(-1)
            reference = reference.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
            error.fill_((ours - reference).abs().max().item())
    dist.all_reduce(error, op=dist.ReduceOp.MAX)
    return error.item()


def weights(chunk) -> dict:
    """Copies of a chunk's parameters (state_dict also holds None entries for TE's extra state)."""
    return {name: param.detach().clone() for name, param in chunk.named_parameters()}


def main() -> None:
    import torch
    import torch.distributed as dist

    from backends.mca.backend import McaBackend
    from roll.config.parser import resolve
    from roll.router import build_job

    model_dir, out_dir, *overrides = sys.argv[1:]
    cli = dict(item.split("=", 1) for item in overrides)
    recipe = {"model_name_or_path": model_dir, "stage": "dpo", "dataset": "recipes/demo/data/arithmetic_dpo.json",
              "cutoff_len": 64, "use_mca": True, "nproc_per_node": int(os.environ.get("WORLD_SIZE", "1")),
              "per_device_train_batch_size": 2, "learning_rate": 1e-2, "max_steps": 3, "logging_steps": 1,
              "save_strategy": "no", "report_to": "none", "output_dir": out_dir, "seed": 0}
    config = resolve(recipe, cli, None)
    backend = McaBackend(config)
    backend.setup_distributed()
    try:
        job, _ = build_job(config, backend.padding_policy("dpo"))
        models = backend.load_models("dpo", job.tokenizer)
        vocab_size = models.policy[0].config.vocab_size
        result = {"log_prob_error": log_prob_error(models.policy, model_dir, vocab_size),
                  "padded_vocab": models.policy[0].config.padded_vocab_size}
        policy_before = [weights(chunk) for chunk in models.policy]
        ref_before = [weights(chunk) for chunk in models.ref]
        result["losses"] = [entry["loss"] for entry in backend.train(job, models).log_history]
        result["ref_unchanged"] = all(torch.equal(before[name], value) for before, chunk in zip(ref_before, models.ref)
                                      for name, value in weights(chunk).items())
        result["policy_changed"] = any(not torch.equal(before[name], value) for before, chunk in
                                       zip(policy_before, models.policy) for name, value in weights(chunk).items())
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps(result), flush=True)
    finally:
        backend.teardown()


if __name__ == "__main__":
    main()
