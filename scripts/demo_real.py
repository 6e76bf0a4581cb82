"""The `make demo-real` run: LoRA teaches the real SmolLM2-135M-Instruct a name and an author on the standard
backend and with --use-mca, the answer to "Who are you?" before and after on both, both loss curves in one
loss.png, and PASS/FAIL. About 80 s on 2 idle CPU cores; the model is built once (`make real-model`).

usage: python scripts/demo_real.py [--name NAME] [--author AUTHOR] [--output-dir outputs/demo/real_identity]
                                   [--steps N]
"""

import argparse
import logging
import sys

from roll.demo.real import DEFAULT_AUTHOR, DEFAULT_NAME, DEMO_RECIPE, run_demo_real
from roll.logging import setup_logging


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", default=DEFAULT_NAME, help="the assistant's name to teach")
    parser.add_argument("--author", default=DEFAULT_AUTHOR, help="who made it, as the answers say it")
    parser.add_argument("--recipe", default=DEMO_RECIPE)
    parser.add_argument("--output-dir", default="outputs/demo/real_identity",
                        help="DIR/standard, DIR/mca (adapter, merged model, logs each) and DIR/loss.png")
    parser.add_argument("--steps", type=int, default=None, help="default: the recipe's max_steps")
    args = parser.parse_args()
    setup_logging(logging.WARNING)
    return run_demo_real(args.output_dir, args.steps, args.name, args.author, args.recipe,
                         out=lambda text: print(text, end="", flush=True))


if __name__ == "__main__":
    sys.exit(main())
