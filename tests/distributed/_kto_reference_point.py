"""torchrun worker: roll.kto's KL reference point over 2 data-parallel ranks (gloo).

Three micro-batches of mismatched rows' policy - reference log-prob differences per rank (rank 1's second
micro-batch is all filler, the end of an epoch): each rank's mean over its real rows, averaged over the
ranks that hold one, clamped at 0. Prints one ``RESULT {json}`` line per rank.
"""

from __future__ import annotations

import json


def main() -> None:
    import torch
    import torch.distributed as dist

    from roll import kto

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    diffs = {0: [[1.0, 3.0, 0.0], [2.0, 4.0, 0.0], [-1.0, -1.0, 0.0]],
             1: [[0.0, 0.0, 50.0], [0.0, 0.0, 0.0], [-3.0, -3.0, -3.0]]}[rank]
    valid = {0: [[True, True, False], [True, True, False], [True, True, False]],
             1: [[True, True, False], [False, False, False], [True, True, True]]}[rank]
    policy = torch.tensor(diffs, dtype=torch.float64) - 40.0
    reference = torch.full_like(policy, -40.0)
    z = kto.kl_reference_points(policy, reference, torch.tensor(valid), dist.group.WORLD)
    print("RESULT " + json.dumps({"rank": rank, "z": z.tolist()}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
