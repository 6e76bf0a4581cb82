"""torchrun worker: the per-step stop poll (``roll.reliability.max_over_ranks``) of a run whose default group is NCCL.

There is no NCCL on a CPU machine, so the default group is gloo and ``dist.get_backend`` is made to answer
"nccl", as it does on a GPU run: the poll must then all-reduce a CPU tensor over a gloo group of all ranks
(made once, with the default group's timeout), never a device tensor (whose ``.item()`` waits for every kernel
queued before it). Prints one ``RESULT {json}`` line per rank.
"""

from __future__ import annotations

import datetime
import json


def main() -> None:
    import torch
    import torch.distributed as dist

    from roll import reliability

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=37))
    rank = dist.get_rank()
    calls, made = [], []
    all_reduce, new_group = dist.all_reduce, dist.new_group

    def recorded_all_reduce(tensor, *args, group=None, **kwargs):
        calls.append({"device": str(tensor.device), "default_group": group in (None, dist.group.WORLD)})
        return all_reduce(tensor, *args, group=group, **kwargs)

    def recorded_new_group(*args, **kwargs):
        made.append(kwargs.get("backend"))
        return new_group(*args, **kwargs)

    dist.all_reduce, dist.new_group = recorded_all_reduce, recorded_new_group
    dist.get_backend = lambda group=None: "nccl"
    values = [reliability.max_over_ranks(3 * rank), reliability.max_over_ranks(5 - rank)]
    if rank == 1:
        reliability.STOP.signum = 15  # what the SIGTERM handler sets
    action = reliability.STOP.poll()
    group = reliability.host_group()
    timeout = group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    print("RESULT " + json.dumps({"rank": rank, "values": values, "action": action.name, "calls": calls,
                                  "groups_made": made, "timeout": timeout}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
