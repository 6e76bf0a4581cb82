"""Conversion checks under one ``torchrun``: several layouts per run, because each launch costs ~10 s.

    torchrun --nproc_per_node=2 convert_worker.py CASES_JSON RESULTS_DIR

CASES_JSON is a list of cases run in order; between cases Megatron's parallel state is torn down
(the process group, created here, stays). Every case writes ``RESULTS_DIR/<name>.rank<r>.json``
(files, not stdout: two ranks' prints can interleave on one line).
Case kinds:
- ``check``: ``convert.check_parity`` (the ``roll-convert check`` path) on an HF dir at a layout;
- ``hf2mca`` / ``mca2hf``: the converter functions at a layout;
- ``logits``: load any model dir (HF or Megatron) at a layout through AutoModel and report its
  logits on the fixed batch (full vocab, from the last pipeline stage);
- ``stream``: load an HF dir and report which files/tensors this rank read.
"""

from __future__ import annotations

import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def _settings(case: dict):
    """(MegatronArguments, ParallelLayout) of a case, built the way roll-convert builds them."""
    from backends.mca.convert import megatron_settings

    return megatron_settings(tp=case.get("tp", 1), pp=case.get("pp", 1), vpp=case.get("vpp"), ep=case.get("ep", 1),
                             etp=case.get("etp"))


def _logits(case: dict) -> dict:
    from backends.mca.convert import load_chunks, megatron_logits, sample_input_ids

    chunks = load_chunks(case["dir"], *_settings(case))
    config = chunks[0].config
    logits = megatron_logits(chunks, config, sample_input_ids(config.vocab_size))
    if logits is not None and case.get("save_to") and dist.get_rank() == dist.get_world_size() - 1:
        torch.save(logits, case["save_to"])
    if case.get("resave_to"):
        from backends.mca.models.auto import save_mca

        save_mca(chunks, config, case["resave_to"], tokenizer_dir=case["dir"])
    return {"has_logits": logits is not None}


def _stream(case: dict) -> dict:
    from backends.mca.initialize import initialize_megatron
    from backends.mca.models.auto import AutoConfig
    from backends.mca.models.gpt import build_model_chunks
    from backends.mca.models.loader import load_hf_weights

    megatron, layout = _settings(case)
    initialize_megatron(layout)
    config = AutoConfig.from_pretrained(case["dir"], megatron)
    report = load_hf_weights(build_model_chunks(config), config, case["dir"])
    return {"files_read": report.files_read, "tensors_read": report.tensors_read,
            "tensors_in_checkpoint": report.tensors_in_checkpoint}


def run_case(case: dict) -> dict:
    from backends.mca import convert

    kind = case["kind"]
    if kind == "check":
        return {"diff": convert.check_parity(case["dir"], *_settings(case), seq_len=case.get("seq_len", 16))}
    if kind == "hf2mca":
        convert.hf_to_mca(case["dir"], case["out"], *_settings(case))
        return {}
    if kind == "mca2hf":
        convert.mca_to_hf(case["dir"], case["out"], *_settings(case), max_shard_bytes=case.get("max_shard_bytes", 2**31))
        return {}
    if kind == "logits":
        return _logits(case)
    if kind == "stream":
        return _stream(case)
    raise ValueError(f"unknown case kind {kind!r}")


def main() -> None:
    from backends.mca.initialize import destroy_megatron

    with open(sys.argv[1], encoding="utf-8") as fh:
        cases = json.load(fh)
    dist.init_process_group("gloo")  # ours, so destroy_megatron between cases keeps it
    for case in cases:
        result = run_case(case)
        path = os.path.join(sys.argv[2], f"{case['name']}.rank{dist.get_rank()}.json")
        with open(path, "w", encoding="utf-8") as fh:
            json.dump({"rank": dist.get_rank(), "name": case["name"], **result}, fh)
        destroy_megatron()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
