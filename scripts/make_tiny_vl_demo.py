"""Create the tiny VL demo locally (no downloads): a random tiny Qwen2.5-VL (roll.demo.tiny_vl) and a dataset
of generated images of coloured shapes with questions about them (roll.demo.vl_data), for
recipes/demo/tiny_vl_sft.yaml.

usage: python scripts/make_tiny_vl_demo.py [--model .demo/tiny-vl] [--data .demo/tiny_vl_data]
"""

import argparse
import logging
import os
import sys

from roll.demo.tiny_vl import make_tiny_vl_model
from roll.demo.vl_data import make_shapes_dataset
from roll.logging import setup_logging

logger = logging.getLogger("roll.scripts.make_tiny_vl_demo")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=".demo/tiny-vl", help="model output directory")
    parser.add_argument("--data", default=".demo/tiny_vl_data", help="dataset output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="rebuild the model even if the directory has one")
    args = parser.parse_args()
    setup_logging()
    if os.path.isfile(os.path.join(args.model, "config.json")) and not args.force:
        logger.info("tiny VL model already at %s (use --force to rebuild)", args.model)
    else:
        make_tiny_vl_model(args.model, seed=args.seed)
        logger.info("tiny VL model written to %s", args.model)
    logger.info("dataset written to %s", make_shapes_dataset(args.data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
