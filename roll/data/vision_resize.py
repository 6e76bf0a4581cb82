"""``image_max_pixels`` / ``image_min_pixels``: LLaMA-Factory 0.9.5's resize of every image before the model's
image processor (docs/vl.md, "Image sizes").

LLaMA-Factory's Qwen-VL plugin (``llamafactory/data/mm_plugin.py``: ``BasePlugin._preprocess_image`` then
``Qwen2VLPlugin._preprocess_image``) resizes each image it opens, in this order, each step on the result of the
one before and only when its condition holds:

1. more than ``image_max_pixels`` pixels: both sides times ``sqrt(image_max_pixels / (w * h))``, truncated (int);
2. fewer than ``image_min_pixels``: both sides times ``sqrt(image_min_pixels / (w * h))``, truncated;
3. a side under 28 pixels: that side widened to 28;
4. width / height over 200: width = height * 180; then height / width over 200: height = width * 180;

each with PIL's default filter (``Image.resize`` without ``resample``: bicubic, nearest for modes "1" and "P"), on
the image in its file's mode; the conversion to RGB comes last. roll does the same steps with the same arithmetic
(``ImageResize.sizes``) and the same calls (``ImageResize.apply``); the model's processor then resizes the
result to its patch grid as before.

The default (``image_resize``): with ``template: qwen2_vl`` (LLaMA-Factory's template, whose plugin does this)
LLaMA-Factory's defaults, 768*768 and 32*32, as under ``llamafactory-cli``; without a named template no resize
first (the model's processor alone, as roll did before these keys), unless a key is set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from roll.errors import ConfigError

MAX_PIXELS = 768 * 768
"""LLaMA-Factory 0.9.5's ``image_max_pixels`` default (``hparams/model_args.py``)."""
MIN_PIXELS = 32 * 32
"""LLaMA-Factory 0.9.5's ``image_min_pixels`` default."""
TEMPLATES = ("qwen2_vl",)
"""roll's named templates whose LLaMA-Factory template resizes images first (its ``Qwen2VLPlugin``)."""
MIN_SIDE = 28
"""``Qwen2VLPlugin``: a shorter side is widened to this."""
MAX_RATIO, SQUEEZED_RATIO = 200, 180
"""``Qwen2VLPlugin``: an aspect ratio over MAX_RATIO is squeezed to SQUEEZED_RATIO."""


@dataclass(frozen=True)
class ImageResize:
    """LLaMA-Factory's resize of an image before the model's processor (plain data: part of the tokenization
    cache key through roll.data.vision.Vision)."""

    max_pixels: int = MAX_PIXELS
    min_pixels: int = MIN_PIXELS
    origin: str = "the recipe"
    """Where the bounds come from (the data report says it)."""

    def sizes(self, width: int, height: int) -> list[tuple[int, int]]:
        """The (width, height) of each resize LLaMA-Factory makes to a ``width`` x ``height`` image, in order
        (empty: none); the last one is the image the model's processor gets. ValueError when a side would be
        0 pixels."""
        steps = []
        for bound, sign in ((self.max_pixels, 1), (self.min_pixels, -1)):  # the second on the first's result
            if sign * (width * height - bound) > 0:  # as mm_plugin.py computes it: the factor, then each side (int)
                factor = math.sqrt(bound / (width * height))
                width, height = int(width * factor), int(height * factor)
                steps.append((width, height))
                if min(width, height) < 1:  # LLaMA-Factory fails here too (PIL refuses the size)
                    raise ValueError(f"image_max_pixels {self.max_pixels} / image_min_pixels {self.min_pixels} "
                                     f"scale it to {width}x{height} pixels")
        if min(width, height) < MIN_SIDE:
            width, height = max(width, MIN_SIDE), max(height, MIN_SIDE)
            steps.append((width, height))
        if width / height > MAX_RATIO:
            width = height * SQUEEZED_RATIO
            steps.append((width, height))
        if height / width > MAX_RATIO:
            height = width * SQUEEZED_RATIO
            steps.append((width, height))
        return steps

    def size(self, width: int, height: int) -> tuple[int, int]:
        """The size the model's processor gets."""
        steps = self.sizes(width, height)
        return steps[-1] if steps else (width, height)

    def apply(self, image):
        """``image`` (PIL, in its file's mode) resized step by step as LLaMA-Factory does (ValueError as ``sizes``)."""
        for size in self.sizes(*image.size):
            image = image.resize(size)  # PIL's default filter, as LLaMA-Factory's call (see the module docstring)
        return image

    def describe(self) -> str:
        return (f"image_max_pixels {self.max_pixels}, image_min_pixels {self.min_pixels} ({self.origin}): each "
                "image is resized first as LLaMA-Factory 0.9.5 does")


NO_RESIZE = ("image_max_pixels and image_min_pixels unset, no named VL template: each image goes to the model's "
             "image processor as it is (its own min_pixels / max_pixels)")
"""The data report's line without an ImageResize."""


def image_resize(data_args) -> ImageResize | None:
    """The resize ``data_args`` asks for: the keys set, LLaMA-Factory's defaults for an unset one when the other is
    set or the template is LLaMA-Factory's VL template; None without either (ConfigError for bad bounds)."""
    max_pixels, min_pixels = data_args.image_max_pixels, data_args.image_min_pixels
    for key, value in (("image_max_pixels", max_pixels), ("image_min_pixels", min_pixels)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{key} must be a positive whole number of pixels (e.g. 589824 for 768*768), got "
                              f"{value!r}.")
    named = data_args.template in TEMPLATES
    if max_pixels is None and min_pixels is None and not named:
        return None
    defaults = [key for key, value in (("image_max_pixels", max_pixels), ("image_min_pixels", min_pixels))
                if value is None]
    origin = ("set in the recipe" if not defaults else
              f"LLaMA-Factory's defaults, with template {data_args.template}" if len(defaults) == 2 else
              f"{defaults[0]}: LLaMA-Factory's default")
    resize = ImageResize(MAX_PIXELS if max_pixels is None else max_pixels,
                         MIN_PIXELS if min_pixels is None else min_pixels, origin)
    if resize.max_pixels < resize.min_pixels:
        raise ConfigError(f"image_max_pixels ({resize.max_pixels}) is smaller than image_min_pixels "
                          f"({resize.min_pixels}) ({origin}): raise image_max_pixels or lower image_min_pixels.")
    return resize
