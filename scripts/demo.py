"""The `make demo` run: recipes/demo/quick_sft.yaml on the standard backend and with --use-mca (TP2, 2
processes), the per-step losses side by side, both curves in one loss.png, and one sample generation.

usage: python scripts/demo.py [--output-dir outputs/demo/tiny_sft] [--steps N (default: the recipe's max_steps)]
"""

import argparse
import logging
import sys

from roll.demo.quick import DEMO_RECIPE, run_demo
from roll.logging import setup_logging


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default=DEMO_RECIPE)
    parser.add_argument("--output-dir", default="outputs/demo/tiny_sft",
                        help="DIR/standard, DIR/mca (models, logs, loss.png each) and DIR/loss.png (both curves)")
    parser.add_argument("--steps", type=int, default=None, help="steps to train (default: the recipe's max_steps)")
    args = parser.parse_args()
    setup_logging(logging.WARNING)
    return run_demo(args.output_dir, args.steps, args.recipe, out=lambda text: print(text, end="", flush=True))


if __name__ == "__main__":
    sys.exit(main())
