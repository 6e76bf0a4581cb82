"""Core attention of the mca local spec: roll's ``LocalCoreAttention`` against Megatron's ``DotProductAttention``.

One process, no launcher: builds both modules for the bench model's attention shape (8 query / 2 key-value
heads of 64) and times forward+backward of a causal [s, 1, h, d] batch, after checking that both give the
same output and gradients.

    python scripts/profile_attention.py                     # seq 256 and 1024, 5 repeats
    python scripts/profile_attention.py --seq 4096 --repeats 2
    python scripts/profile_attention.py --packed --seq 256,1024 --window-min 32,64,128

``--packed``: a THD stream of two rows of ``seq`` tokens, each filled with short samples (18-34 tokens, as the
bench's demo documents) and a padding sequence at its end, through roll's ``LocalCoreAttention`` as the stream
(one ``t x t`` block-diagonal mask) and as ``PackedWindows`` of each ``--window-min``, interleaved, after
checking that every form gives the stream's output and gradients. Each cell is CPU milliseconds (this process's
user + system time: on a shared machine less distorted than wall time) of one layer's forward + backward, plus
those of the plan the model makes once per forward for all its layers.
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


def _pack(seq: int, rows: int = 2) -> list[int]:
    """cu_seqlens of ``rows`` rows of ``seq`` tokens, each of seeded 18-34-token samples and a padding tail."""
    import random

    rng, cu = random.Random(0), [0]
    for _ in range(rows):
        end = cu[-1] + seq
        while end - cu[-1] >= 34:
            cu.append(cu[-1] + rng.randint(18, 34))
        cu.append(end)
    return cu


def packed(seqs: list[int], window_mins: list[int], repeats: int) -> None:
    """The packed stream as one masked SDPA against ``PackedWindows`` of each minimum size."""
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from backends.mca import attention

    config = TransformerConfig(num_layers=1, hidden_size=512, num_attention_heads=8, num_query_groups=2,
                               use_cpu_initialization=True, attention_dropout=0.0)
    module = attention.LocalCoreAttention(config, 1, AttnMaskType.causal, "self")
    forms = ["stream"] + [f"window {w}" for w in window_mins]

    plans = {}

    def run(form: str, q, k, v, params):
        """One layer's forward; the plan is made once per forward of the model, so it is timed apart."""
        attention.WINDOW_MIN = int(form.split()[1]) if form != "stream" else 1 << 30
        if (form, id(params)) not in plans:
            attention._planned = None
            start = time.process_time()
            attention.packed_windows(params.cu_seqlens_q)
            plans[form, id(params)] = (attention._planned, time.process_time() - start)
        attention._planned = plans[form, id(params)][0]
        return module(q, k, v, None, packed_seq_params=params)

    print(f"{'seq':>6} {'sequences':>9} " + " ".join(f"{f + ' cpu ms':>15}" for f in forms) + f" {'max |diff|':>11}")
    for seq in seqs:
        cu = torch.tensor(_pack(seq), dtype=torch.int32)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
        torch.manual_seed(0)
        q, k, v = (torch.randn(int(cu[-1]), heads, 64, requires_grad=True) for heads in (8, 2, 2))
        results = {}
        for form in forms:
            out = run(form, q, k, v, params)
            results[form] = [out, *torch.autograd.grad(out.square().sum(), (q, k, v))]
        diff = max((a - b).abs().max().item() for form in forms[1:] for a, b in zip(results[form], results["stream"]))
        times = dict.fromkeys(forms, 0.0)
        for _ in range(repeats):
            for form in forms:
                start = time.process_time()
                run(form, q, k, v, params).sum().backward()
                times[form] += (time.process_time() - start) / repeats
        cells = [f"{times[f] * 1e3:.1f}+{plans[f, id(params)][1] * 1e3:.1f}" for f in forms]
        print(f"{seq:>6} {len(cu) - 1:>9} " + " ".join(f"{c:>15}" for c in cells) + f" {diff:>11.2e}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", default="256,1024", help="sequence lengths, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--packed", action="store_true", help="a packed stream: as one mask against windows")
    parser.add_argument("--window-min", default="32,64,128", help="with --packed: the windows' minimum sizes")
    args = parser.parse_args(argv)
    import torch

    _megatron_single_process()
    if args.packed:
        packed([int(s) for s in args.seq.split(",")], [int(w) for w in args.window_min.split(",")], args.repeats)
        return
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
