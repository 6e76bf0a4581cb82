"""Which parameters the mca backend's optimizer decays, by HF name (one launch, several models).

    torchrun --nproc_per_node=N param_groups.py CASES_JSON

Each case loads an HF model dir (at ``tp`` / ``pp``, default 1), optionally adds LoRA, builds the
trainer's optimizer (``build_optimizer``) and prints ``RESULT {"name", "decayed", "undecayed"}``: the
HF names of the parameters in groups with weight decay > 0 and == 0 on any rank (a LoRA adapter as
``layers.<n>.<proj>.lora_<A|B>``).
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch.distributed as dist  # noqa: E402

TRAINING = SimpleNamespace(learning_rate=1e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.999,
                           adam_epsilon=1e-8, max_grad_norm=1.0, bf16=False, fp16=False)


def _hf_names(name: str, config) -> list[str]:
    from backends.mca.lora.apply import is_lora_param
    from backends.mca.trainer.param_groups import hf_names_of

    if is_lora_param(name):  # decoder.layers.3.self_attention.linear_qkv.lora_A.q_proj
        parts = name.split(".")
        return [f"layers.{parts[2]}.{parts[-1]}.{parts[-2]}"]
    return list(hf_names_of(name, config))


def run_case(case: dict) -> dict:
    from backends.mca.convert import load_chunks
    from backends.mca.lora.apply import apply_lora
    from backends.mca.models.gpt import canonical_tensors
    from backends.mca.trainer.optim import build_optimizer, wrap_ddp
    from roll.config.finetuning import FinetuningArguments
    from roll.config.megatron import MegatronArguments

    megatron = MegatronArguments(use_distributed_optimizer=False,
                                 tensor_model_parallel_size=case.get("tp", 1),
                                 pipeline_model_parallel_size=case.get("pp", 1))
    chunks = load_chunks(case["dir"], megatron, megatron.build_layout(dist.get_world_size()))
    config = chunks[0].config
    if case.get("lora"):
        lora = FinetuningArguments(finetuning_type="lora", lora_rank=4, lora_alpha=8, lora_target="all")
        apply_lora(chunks, lora, seed=0)
    names = {id(tensor): name for name, tensor in canonical_tensors(chunks, config)}
    optimizer = build_optimizer(wrap_ddp(chunks, megatron, fp16=False, bf16=False), TRAINING, megatron)
    out: dict[str, list[str]] = {"decayed": [], "undecayed": []}
    for group in optimizer.param_groups:
        key = "decayed" if group["weight_decay"] > 0 else "undecayed"
        for param in group["params"]:
            out[key] += _hf_names(names[id(param)], config)
    return {key: sorted(value) for key, value in out.items()}


def main() -> None:
    from backends.mca.initialize import destroy_megatron

    with open(sys.argv[1], encoding="utf-8") as fh:
        cases = json.load(fh)
    dist.init_process_group("gloo")  # ours, so destroy_megatron between cases keeps it
    for case in cases:
        groups = run_case(case)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, groups)  # each rank holds its own shards / stages
        if dist.get_rank() == 0:
            union = {key: sorted({name for part in gathered for name in part[key]}) for key in groups}
            print("RESULT " + json.dumps({"name": case["name"], **union}), flush=True)
        destroy_megatron()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
