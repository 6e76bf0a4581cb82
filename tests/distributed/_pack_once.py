"""torchrun worker: a packed sft set is packed once per node, by local rank 0; the other ranks load its file.

usage: torchrun --nproc_per_node=2 _pack_once.py TOKENIZER_DIR

Each rank builds the same packed dataset twice through ``roll.data.build_datasets`` (a first start on an empty
datasets cache, then a warm start) and prints one ``RESULT {json}`` line: how many times it wrote packed rows
in each build (``roll.data.packing._write_packed``) and the packed rows it got.
"""

from __future__ import annotations

import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)


def main() -> None:
    import torch.distributed as dist

    from roll.config.data import DataArguments
    from roll.config.model import ModelArguments
    from roll.data import build_datasets, load_tokenizer, packing

    dist.init_process_group("gloo")
    writes = []
    write_packed = packing._write_packed

    def counted(*args, **kwargs):
        writes[-1] += 1
        return write_packed(*args, **kwargs)

    packing._write_packed = counted
    data_args = DataArguments(dataset=os.path.join(REPO, "recipes/demo/data/arithmetic_sft.json"), cutoff_len=64,
                              packing=True)
    tokenizer = load_tokenizer(ModelArguments(model_name_or_path=sys.argv[1]), data_args)
    rows = []
    for _start in ("first", "warm"):
        writes.append(0)
        bundle = build_datasets(data_args, tokenizer, stage="sft", processor="supervised",
                                formats=("alpaca", "sharegpt"), seed=0)
        rows.append([bundle.train[i]["input_ids"] for i in range(len(bundle.train))])
    print("RESULT " + json.dumps({"rank": dist.get_rank(), "writes": writes, "rows": rows}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
