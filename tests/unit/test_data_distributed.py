"""Two ranks (torchrun + gloo) build the same tokenized rows in the same order (DESIGN.md section 3);
local rank 0 tokenizes and packs first and the other rank reuses its cache (and memory-maps the packed rows)."""

from __future__ import annotations

import json
import textwrap

from tests.helpers import REPO, output_of, torchrun

SCRIPT = textwrap.dedent("""
    import json, logging, os, sys
    import datasets
    import torch.distributed as dist
    from roll.config.data import DataArguments
    from roll.config.model import ModelArguments
    from roll.data import build_datasets, load_tokenizer, packing

    packs = []
    write_packed = packing._write_packed
    packing._write_packed = lambda *a, **k: (packs.append(1), write_packed(*a, **k))

    dist.init_process_group("gloo")
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    datasets.logging.set_verbosity_info()
    datasets.logging.get_logger().addHandler(handler)
    model_dir, out_dir = sys.argv[1], sys.argv[2]
    tok = load_tokenizer(ModelArguments(model_name_or_path=model_dir), DataArguments())
    args = DataArguments(dataset="recipes/demo/data/arithmetic_sft.json", cutoff_len=128, packing=True)
    bundle = build_datasets(args, tok, stage="sft", processor="supervised", formats=("alpaca",), seed=3)
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as handle:
        json.dump({"input_ids": list(bundle.train["input_ids"]),
                   "num_samples": bundle.stats.num_samples, "packs": len(packs),
                   "mapped": [f["filename"] for f in bundle.train.cache_files],
                   "from_cache": any("Loading cached processed dataset" in m for m in messages)}, handle)
    dist.destroy_process_group()
""")


def test_ranks_see_the_same_rows_in_the_same_order(tiny_model_dir, tmp_path):
    script = tmp_path / "build.py"
    script.write_text(SCRIPT)
    proc = torchrun(str(script), tiny_model_dir, str(tmp_path), nproc=2, timeout=240,
                    HF_DATASETS_CACHE=str(tmp_path / "cache"), PYTHONPATH=REPO)
    assert proc.returncode == 0, output_of(proc)
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0["input_ids"] == rank1["input_ids"] and rank0["num_samples"] == 100
    assert (rank0["from_cache"], rank1["from_cache"]) == (False, True)  # rank 0 tokenized, rank 1 reused it
    assert (rank0["packs"], rank1["packs"]) == (1, 0)  # rank 0 packed, rank 1 memory-maps its file
    assert rank0["mapped"] == rank1["mapped"] and "roll-packed" in rank0["mapped"][0]
