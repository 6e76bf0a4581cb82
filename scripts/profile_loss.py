"""Time and peak memory of a causal-LM loss's forward + backward on a real vocabulary (issue 20).

Three ways to get the token losses of ``[tokens, vocab]`` logits and their gradient:

- ``hf``: what a Hugging Face model's own loss runs (``ForCausalLMLoss``: upcast, ``F.cross_entropy``);
- ``unfused``: roll.loss's arithmetic under plain autograd (roll.loss before its kernel);
- ``roll``: ``roll.loss.token_log_probs`` (the chunked kernel both backends use).

The logits are the output of a small head (``hidden [tokens, 8] @ weight [8, vocab]``), as a model's are,
so the kernel may write their gradient into them. Each way runs in its own process (so that one's freed
memory does not hide another's peak): ``peak MB`` is the process's peak RSS minus its RSS before the first
pass minus the logits themselves, i.e. what the loss adds on top of the logits; ``ms`` the median of the
timed forward + backward passes (the tiny head's matmuls included, the same for every way).

    OMP_NUM_THREADS=2 python scripts/profile_loss.py [--tokens 512] [--vocab 151936] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rss_mb() -> float:
    with open("/proc/self/status", encoding="utf-8") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS")) / 1024


def _loss(way: str):
    import torch.nn.functional as F

    from roll import IGNORE_INDEX
    from roll import loss as roll_loss

    def hf(logits, labels):
        return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")

    def unfused(logits, labels):
        mask = labels != IGNORE_INDEX
        logits = logits.float()
        shifted = logits - logits.max(dim=-1, keepdim=True).values.detach()
        predicted = shifted.gather(-1, labels.masked_fill(~mask, 0).unsqueeze(-1)).squeeze(-1)
        return -(predicted - shifted.exp().sum(dim=-1).log()).masked_fill(~mask, 0.0).double().sum()

    def kernel(logits, labels):
        return roll_loss.loss_sum(roll_loss.token_log_probs(logits, labels)[0])

    return {"hf": hf, "unfused": unfused, "roll": kernel}[way]


def measure(way: str, dtype_name: str, tokens: int, vocab: int, repeat: int) -> dict:
    """One way's forward + backward, in this process."""
    import resource
    import time

    import torch

    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, dtype_name)
    hidden = torch.randn(tokens, 8, generator=gen, dtype=dtype, requires_grad=True)
    weight = (torch.randn(8, vocab, generator=gen) * 0.7).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    loss_fn = _loss(way)
    logits_mb = tokens * vocab * weight.element_size() / 2**20
    before = _rss_mb()
    times = []
    for _ in range(repeat + 1):
        start = time.perf_counter()
        loss_fn(hidden @ weight, labels).backward()
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"way": way, "dtype": dtype_name, "ms": round(1000 * sorted(times[1:])[len(times[1:]) // 2], 1),
            "peak MB": round(peak - before - logits_mb), "logits MB": round(logits_mb)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: WAY,DTYPE in this process
    args = parser.parse_args(argv)
    if args.one:
        way, dtype = args.one.split(",")
        print(json.dumps(measure(way, dtype, args.tokens, args.vocab, args.repeat)))
        return 0
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    print(f"{args.tokens} tokens x {args.vocab} vocabulary, {os.environ.get('OMP_NUM_THREADS', 'all')} threads, "
          f"load {os.getloadavg()[0]:.1f}")
    print("| way | dtype | ms fwd+bwd | peak MB over the logits | logits MB |\n|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        for way in ("hf", "unfused", "roll"):
            cmd = [sys.executable, __file__, "--one", f"{way},{dtype}", "--tokens", str(args.tokens),
                   "--vocab", str(args.vocab), "--repeat", str(args.repeat)]
            row = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True,
                                            timeout=600).stdout.splitlines()[-1])
            print(f"| {way} | {dtype} | {row['ms']} | {row['peak MB']} | {row['logits MB']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
