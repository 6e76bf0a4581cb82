"""Create the tiny VL demo locally (no downloads): a random tiny Qwen2.5-VL (roll.demo.tiny_vl) and a dataset
of generated images of coloured shapes with questions about them (roll.demo.vl_data), for
recipes/demo/tiny_vl_sft.yaml.

usage: python scripts/make_tiny_vl_demo.py [--model .demo/tiny-vl] [--data .demo/tiny_vl_data]
           [--tokenizer bpe|qwen] [--image-pixels tiny|qwen2.5]

--tokenizer qwen --image-pixels qwen2.5: the model of the LLaMA-Factory side by side (docs/llamafactory-parity.md):
the real Qwen2.5 tokenizer and Qwen2.5-VL's own image bounds, so that image_max_pixels decides the token counts.
"""

import argparse
import logging
import os
import sys

from roll.demo.tiny_vl import QWEN25_IMAGE_PIXELS, make_tiny_vl_model
from roll.demo.vl_data import make_shapes_dataset
from roll.logging import setup_logging

logger = logging.getLogger("roll.scripts.make_tiny_vl_demo")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=".demo/tiny-vl", help="model output directory")
    parser.add_argument("--data", default=".demo/tiny_vl_data", help="dataset output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="rebuild the model even if the directory has one")
    parser.add_argument("--tokenizer", default="bpe", choices=("bpe", "qwen"),
                        help="bpe: the tiny test tokenizer with Qwen2-VL's vision tokens; qwen: the real Qwen2.5 one")
    parser.add_argument("--image-pixels", default="tiny", choices=("tiny", "qwen2.5"),
                        help="the image processor's bounds: 4..16 tokens an image (tiny), or Qwen2.5-VL's own")
    args = parser.parse_args()
    setup_logging()
    if os.path.isfile(os.path.join(args.model, "config.json")) and not args.force:
        logger.info("tiny VL model already at %s (use --force to rebuild)", args.model)
    else:
        make_tiny_vl_model(args.model, seed=args.seed, tokenizer=args.tokenizer,
                           image_pixels=QWEN25_IMAGE_PIXELS if args.image_pixels == "qwen2.5" else None)
        logger.info("tiny VL model written to %s", args.model)
    logger.info("dataset written to %s", make_shapes_dataset(args.data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
