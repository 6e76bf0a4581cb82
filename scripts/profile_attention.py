"""Core attention of the mca local spec: roll's ``LocalCoreAttention`` against Megatron's ``DotProductAttention``.

One process, no launcher: builds both modules for the bench model's attention shape (8 query / 2 key-value
heads of 64) and times forward+backward of a causal [s, 1, h, d] batch, after checking that both give the
same output and gradients.

    python scripts/profile_attention.py                     # seq 256 and 1024, 5 repeats
    python scripts/profile_attention.py --seq 4096 --repeats 2
"""

from __future__ import annotations

import argparse
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def _megatron_single_process() -> None:
    import torch.distributed as dist

    from backends.mca import platform

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29613")
    dist.init_process_group("gloo", rank=0, world_size=1)
    platform.apply_patches()
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)


def _time(module, q, k, v, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        module(q, k, v, None).sum().backward()
    return (time.perf_counter() - start) / repeats


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", default="256,1024", help="sequence lengths, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    import torch

    _megatron_single_process()
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from backends.mca.attention import LocalCoreAttention

    config = TransformerConfig(num_layers=1, hidden_size=512, num_attention_heads=8, num_query_groups=2,
                               use_cpu_initialization=True, attention_dropout=0.0)
    modules = {"megatron": DotProductAttention(config, 1, AttnMaskType.causal, "self"),
               "roll": LocalCoreAttention(config, 1, AttnMaskType.causal, "self")}
    print(f"{'seq':>6} {'megatron ms':>12} {'roll ms':>10} {'speed-up':>9} {'max |diff|':>11}")
    for seq in (int(s) for s in args.seq.split(",")):
        torch.manual_seed(0)
        q, k, v = (torch.randn(seq, 1, heads, 64, requires_grad=True) for heads in (8, 2, 2))
        outs = {name: m(q, k, v, None) for name, m in modules.items()}
        grads = {name: torch.autograd.grad(out.square().sum(), (q, k, v)) for name, out in outs.items()}
        diff = max([(outs["roll"] - outs["megatron"]).abs().max().item()]
                   + [(a - b).abs().max().item() for a, b in zip(grads["roll"], grads["megatron"])])
        times = {name: _time(m, q, k, v, args.repeats) for name, m in modules.items()}
        print(f"{seq:>6} {times['megatron'] * 1e3:>12.1f} {times['roll'] * 1e3:>10.1f} "
              f"{times['megatron'] / times['roll']:>8.2f}x {diff:>11.2e}")


if __name__ == "__main__":
    main()
