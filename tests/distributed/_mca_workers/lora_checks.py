"""LoRA on Megatron under one ``torchrun`` (several layouts per launch; each launch costs ~10 s).

    torchrun --nproc_per_node=2 lora_checks.py CASES_JSON OUT_DIR

Each case loads an HF model dir at a layout, applies ``apply_lora`` and writes under
``OUT_DIR/<name>/``: ``init/`` (the initial adapter, PEFT format), ``adapter/`` (after random adapter
values are set: global tensors drawn per name, each rank keeping its shard), ``merged/``,
``logits.pt`` (Megatron logits with that adapter), ``steps.pt`` (losses and full adapter grads of a
few SGD steps) and ``result.rank<r>.json`` (checks done here: base weights bit-identical after the
steps, adapters changed, trainable = adapters only, utilities' names).
"""

from __future__ import annotations

import json
import os
import sys
import zlib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

SEED = 1234


def _load(case: dict):
    from backends.mca.convert import load_chunks
    from roll.config.megatron import MegatronArguments

    megatron = MegatronArguments(tensor_model_parallel_size=case.get("tp", 1),
                                 pipeline_model_parallel_size=case.get("pp", 1),
                                 expert_model_parallel_size=case.get("ep", 1),
                                 sequence_parallel=case.get("sp", False))
    return load_chunks(case["dir"], megatron, megatron.build_layout(dist.get_world_size()))


def _randomize_adapters(chunks) -> None:
    """Non-zero adapters: a global tensor per canonical name (seeded by the name), this rank's shard."""
    from backends.mca.lora.apply import lora_parameters
    from backends.mca.models.gpt import chunk_placements

    place = chunk_placements(chunks[0].config)[0]
    for name, param in lora_parameters(chunks):
        shape, dim, tp, rank = list(param.shape), None, 1, 0
        if getattr(param, "tensor_model_parallel", False):
            module = chunks[0].get_submodule(name.rsplit(".", 2)[0])
            dim, tp, rank = param.partition_dim, module.tp_group.size(), module.tp_group.rank()
            shape[dim] *= tp
        gen = torch.Generator().manual_seed(zlib.crc32(place.to_global(name).encode()))
        full = 0.1 * torch.randn(shape, generator=gen)
        with torch.no_grad():
            param.copy_(full if dim is None else full.chunk(tp, dim=dim)[rank])


def _full_grads(chunks) -> dict[str, torch.Tensor]:
    from backends.mca.lora.apply import lora_parameters
    from backends.mca.lora.export import hf_adapter_name
    from backends.mca.models.export import gather_unit
    from backends.mca.models.gpt import chunk_placements

    place = chunk_placements(chunks[0].config)[0]
    local = {}
    for name, p in lora_parameters(chunks):
        kind = ("column" if p.partition_dim == 0 else "row") if getattr(p, "tensor_model_parallel", False) \
            else "replicated"
        local[place.to_global(name)] = (p.grad, kind)
    return {hf_adapter_name(k, chunks[0].config): v for k, v in gather_unit(local).items()}


def _sgd_steps(chunks, steps: int = 3) -> dict:
    """Forward/backward of the mean token loss, plain SGD on the adapters; base must not move."""
    from backends.mca.convert import sample_input_ids
    from backends.mca.lora.apply import is_lora_param, lora_parameters

    chunk = chunks[0]
    base_before = {n: p.detach().clone() for n, p in chunk.named_parameters() if not is_lora_param(n)}
    lora_before = {n: p.detach().clone() for n, p in lora_parameters(chunks)}
    trainable = sorted(n for n, p in chunk.named_parameters() if p.requires_grad)
    params = [p for _, p in lora_parameters(chunks)]
    optimizer = torch.optim.SGD(params, lr=0.02)
    ids = sample_input_ids(chunk.config.vocab_size, seq_len=16, seed=99)
    position_ids = torch.arange(ids.shape[1]).unsqueeze(0).expand(ids.shape[0], -1)
    labels = torch.roll(ids, -1, dims=1)
    losses, grads = [], []
    chunk.train()
    for _ in range(steps):
        optimizer.zero_grad()
        loss = chunk(ids, position_ids, attention_mask=None, labels=labels).mean()  # of [b, s] token losses
        loss.backward()
        losses.append(loss.item())
        grads.append(_full_grads(chunks))
        optimizer.step()
    base_same = all(torch.equal(p, base_before[n]) for n, p in chunk.named_parameters() if n in base_before)
    lora_moved = all(not torch.equal(p, lora_before[n]) for n, p in lora_parameters(chunks))
    return {"losses": losses, "grads": grads, "base_same": base_same, "lora_moved": lora_moved,
            "trainable_all_lora": all(is_lora_param(n) for n in trainable) and bool(trainable),
            "lora_fp32": all(p.dtype == torch.float32 for p in params)}


def run_case(case: dict, out: str) -> dict:
    from backends.mca.convert import megatron_logits, sample_input_ids
    from backends.mca.lora import utils
    from backends.mca.lora.apply import apply_lora
    from backends.mca.lora.export import export_merged, save_hf_adapter
    from roll.config.finetuning import FinetuningArguments

    chunks = _load(case)
    names = {"linear": utils.find_all_linear_modules(chunks[0]),
             "linear_with_head": utils.find_all_linear_modules(chunks[0], include_output_layer=True),
             "embedding": utils.find_all_embedding_modules(chunks[0]),
             "router": utils.find_all_router_modules(chunks[0]),
             "experts_marked": utils.set_linear_is_expert(chunks[0])}
    ft = FinetuningArguments(finetuning_type="lora", lora_rank=4, lora_alpha=8, lora_target=case["target"])
    apply_lora(chunks, ft, seed=SEED)
    result = {"names": names}
    save_hf_adapter(chunks, os.path.join(out, "init"), case["dir"])
    _randomize_adapters(chunks)
    adapter_dir = save_hf_adapter(chunks, os.path.join(out, "adapter"), case["dir"])
    if case.get("save_ckpt"):
        from backends.mca.lora.checkpoint import save_adapter_checkpoint

        save_adapter_checkpoint(chunks, case["save_ckpt"])
    if case.get("load_ckpt"):  # adapters from a checkpoint written at another layout, exported again
        from backends.mca.lora.checkpoint import load_adapter_checkpoint

        load_adapter_checkpoint(chunks, case["load_ckpt"])
        save_hf_adapter(chunks, os.path.join(out, "reloaded"), case["dir"])
    if case.get("merged"):
        export_merged(adapter_dir, case["dir"], os.path.join(out, "merged"))
    logits = megatron_logits(chunks, chunks[0].config, sample_input_ids(chunks[0].config.vocab_size))
    if case.get("steps"):
        steps = _sgd_steps(chunks)
        result.update({k: v for k, v in steps.items() if k != "grads"})
        if dist.get_rank() == 0:
            torch.save(steps, os.path.join(out, "steps.pt"))
    if case.get("expert_lora"):
        result["expert_lora"] = _expert_lora(chunks)
    if logits is not None and dist.get_rank() == dist.get_world_size() - 1:  # the last pipeline stage has them
        torch.save(logits, os.path.join(out, "logits.pt"))
    return result


def _expert_lora(chunks) -> dict:
    """LoRA on the routed experts' fc1/fc2 (add_lora directly: no HF export for them): the adapter
    changes the output, backward reaches every expert adapter, and they carry the expert tags."""
    from backends.mca.convert import megatron_logits, sample_input_ids
    from backends.mca.lora.layers import add_lora

    chunk = chunks[0]
    experts = [(n, m) for n, m in chunk.named_modules()
               if ".experts.local_experts." in n and n.rsplit(".", 1)[-1] in ("linear_fc1", "linear_fc2")]
    for name, module in experts:
        rows = module.weight.shape[0]
        if name.endswith("linear_fc1"):
            add_lora(module, {"gate_proj": rows // 2, "up_proj": rows // 2}, rank=4, alpha=8, fusion="concat")
        else:
            add_lora(module, {"down_proj": rows}, rank=4, alpha=8)
        with torch.no_grad():
            for p in list(module.lora_A.values()) + list(module.lora_B.values()):
                p.normal_(0, 0.1)
    ids = sample_input_ids(chunk.config.vocab_size)
    before = megatron_logits(chunks, chunk.config, ids)
    position_ids = torch.arange(ids.shape[1]).unsqueeze(0).expand(ids.shape[0], -1)
    chunk.train()
    chunk(ids, position_ids, attention_mask=None, labels=torch.roll(ids, -1, 1)).mean().backward()
    adapters = [p for _, m in experts for p in list(m.lora_A.values()) + list(m.lora_B.values())]
    return {"modules": len(experts), "is_expert": all(m.is_expert for _, m in experts),
            "allreduce_false": all(getattr(p, "allreduce", True) is False for p in adapters),
            "all_have_grad": all(p.grad is not None and p.grad.abs().sum() > 0 for p in adapters),
            "finite": bool(torch.isfinite(before).all()) if before is not None else True}


def main() -> None:
    from backends.mca.initialize import destroy_megatron

    with open(sys.argv[1], encoding="utf-8") as fh:
        cases = json.load(fh)
    dist.init_process_group("gloo")  # ours, so destroy_megatron between cases keeps it
    for case in cases:
        out = os.path.join(sys.argv[2], case["name"])
        os.makedirs(out, exist_ok=True)
        result = run_case(case, out)
        with open(os.path.join(out, f"result.rank{dist.get_rank()}.json"), "w", encoding="utf-8") as fh:
            json.dump({"rank": dist.get_rank(), "name": case["name"], **result}, fh)
        destroy_megatron()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
