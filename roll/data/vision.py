"""Images in the shared data pipeline (vision-language models; docs/vl.md).

LLaMA-Factory's multimodal rows: an ``images`` column (file paths, relative to the dataset file's folder, or to
``dataset_dir`` for a registry entry) and ``<image>`` placeholders in the turns, one per image, in order. At
tokenization each placeholder becomes ``<|vision_start|>`` + n ``<|image_pad|>`` + ``<|vision_end|>`` with n the
image's patch count over ``merge_size**2`` (the model's own PIL image processor decides the resize); the row
keeps its images' absolute paths in ``images``. The collator (``VisionCollator``) loads them and adds the
micro-batch's ``pixel_values`` and ``image_grid_thw`` (the batch contract of docs/vl.md).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from typing import Any

from roll import IGNORE_INDEX
from roll.data.formats import RowError
from roll.data.processors import SEQ, SupervisedProcessor
from roll.errors import ConfigError, DataError, ModelError

PLACEHOLDER = "<image>"
VL_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
"""config.json model types whose images roll lays out (Qwen2-VL's vision tokens and image processor)."""
IMAGE_CUT = "image_cut"
"""The skip reason of a row whose truncation to cutoff_len would lose vision tokens."""


@dataclass(frozen=True)
class Vision:
    """What the data side needs of a VL model: its image processor's settings and its vision tokens. Plain data
    (the tokenization cache key is taken over it); the processor itself is built once per process."""

    processor_config: str
    """The model's preprocessor_config.json (JSON text)."""
    image_token: str = "<|image_pad|>"
    start_token: str = "<|vision_start|>"
    end_token: str = "<|vision_end|>"
    token_ids: tuple[int, int, int] = (0, 0, 0)
    """(image, start, end) token ids."""

    @property
    def image_processor(self):
        return _image_processor(self.processor_config)

    @property
    def merge_size(self) -> int:
        return int(self.image_processor.merge_size)

    def num_tokens(self, image) -> int:
        """``<|image_pad|>`` tokens of a PIL image: its patch grid (after the processor's resize) over merge^2."""
        width, height = image.size
        patches = self.image_processor.get_number_of_image_patches(height, width, {})
        return patches // self.merge_size ** 2

    def expand(self, n: int) -> str:
        return self.start_token + self.image_token * n + self.end_token

    def process(self, images: list) -> dict:
        """The image processor on ``images`` (PIL, RGB): ``pixel_values`` [patches, C*T*P*P], ``image_grid_thw``."""
        out = self.image_processor(images=images, return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


@functools.lru_cache(maxsize=4)
def _image_processor(config_text: str):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**json.loads(config_text))


def is_vl_model(path: str | None) -> bool:
    """Whether ``path`` is a local model directory of a vision-language family roll lays images out for."""
    from roll.hf_config import has_hf_config, read_hf_config

    if not (path and has_hf_config(path)):
        return False
    try:
        return read_hf_config(path).get("model_type") in VL_MODEL_TYPES
    except ModelError:  # an unreadable config.json is reported, with its label, by the reader that needs it
        return False


def load_vision(model_args, tokenizer) -> Vision | None:
    """The model's Vision (None for a text model): its preprocessor_config.json and vision token ids."""
    from roll.hf_config import read_hf_config

    path = model_args.model_name_or_path
    if not is_vl_model(path):
        return None
    config_file = os.path.join(path, "preprocessor_config.json")
    if not os.path.isfile(config_file):
        raise ModelError(f"model_name_or_path={path!r} is a vision-language model without preprocessor_config.json "
                         "(its image processor's settings): copy it from the model's original folder.")
    with open(config_file, encoding="utf-8") as handle:
        settings = {k: v for k, v in json.load(handle).items()
                    if k not in ("image_processor_type", "processor_class", "auto_map")}
    hf = read_hf_config(path)
    ids = (hf.get("image_token_id"), hf.get("vision_start_token_id"), hf.get("vision_end_token_id"))
    tokens = [tokenizer.convert_ids_to_tokens(i) if isinstance(i, int) else None for i in ids]
    if None in tokens:
        raise ModelError(f"model_name_or_path={path!r}: config.json's image_token_id / vision_start_token_id / "
                         f"vision_end_token_id ({ids}) are not tokens of the tokenizer.")
    return Vision(processor_config=json.dumps(settings, sort_keys=True), image_token=tokens[0],
                  start_token=tokens[1], end_token=tokens[2], token_ids=tuple(ids))


def check_config(config) -> None:
    """What a VL model cannot do yet, refused when the recipe is read (docs/vl.md)."""
    if not is_vl_model(config.model.model_name_or_path):
        return
    data, stage = config.data, config.finetuning.stage
    refused = [(stage != "sft", f"stage {stage} (images are laid out for stage sft only)"),
               (data.streaming, "streaming: true"),
               (bool(data.tokenized_path), "tokenized_path (the prepared rows do not record the image processor)"),
               (config.finetuning.export_merged, "export_merged (the merge loads a causal LM)")]
    for bad, what in refused:
        if bad:
            raise ConfigError(f"model_name_or_path={config.model.model_name_or_path!r} is a vision-language model: "
                              f"{what} is not supported with it yet (docs/vl.md).")
    if config.finetuning.finetuning_type == "freeze" and not (config.finetuning.freeze_vision_tower and
                                                             config.finetuning.freeze_multi_modal_projector):
        raise ConfigError("finetuning_type: freeze trains the last language-model layers only: "
                          "freeze_vision_tower / freeze_multi_modal_projector: false need finetuning_type full "
                          "or lora.")


def open_image(path: str):
    """The image at ``path`` decoded, in RGB; RowError naming it when it is missing or unreadable."""
    from PIL import Image, UnidentifiedImageError

    if not os.path.isfile(path):
        raise RowError(f"image file {path!r} does not exist")
    try:
        with Image.open(path) as image:
            image.load()
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise RowError(f"image file {path!r} cannot be read as an image: {exc}") from None


def image_paths(value: Any, media_dir: str) -> list[str]:
    """A row's ``images`` value -> absolute paths (relative ones joined to ``media_dir``)."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise RowError(f"'images' must be a list of image file paths, got {str(value)[:80]!r}")
    return [os.path.abspath(v if os.path.isabs(v) else os.path.join(media_dir, v)) for v in value]


_TEXT_KEYS = ("history", "instruction", "input", "output", "conversations", "messages")
"""Where a canonical row's turns are, in conversation order (the system prompt is not searched, as in
LLaMA-Factory)."""


def expand_placeholders(row: dict, runs: list[str]) -> dict:
    """``row`` (roll's canonical columns) with its ``<image>`` placeholders, in turn order, replaced by ``runs``;
    RowError when their count differs from the images'."""
    it, count = iter(runs), 0

    def sub(text):
        nonlocal count
        if not isinstance(text, str) or PLACEHOLDER not in text:
            return text
        parts = text.split(PLACEHOLDER)
        count += len(parts) - 1
        return parts[0] + "".join(next(it, "") + part for part in parts[1:])

    def walk(value):
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, dict):
            return {k: sub(v) if k in ("value", "content") else walk(v) for k, v in value.items()}
        return sub(value)

    out = dict(row)
    for key in _TEXT_KEYS:
        if key in out:
            out[key] = walk(out[key])
    if count != len(runs):
        raise RowError(f"the row has {count} {PLACEHOLDER} placeholder(s) but {len(runs)} image(s) in 'images': "
                       f"each image needs one {PLACEHOLDER} in the text, in order")
    return out


@dataclass
class VisionSupervisedProcessor(SupervisedProcessor):
    """SupervisedProcessor for a VL model: placeholders expanded into vision tokens, labels masked on them,
    rows whose truncation would cut an image's tokens dropped (``image_cut``), and an ``images`` column of
    absolute paths."""

    vision: Vision | None = None
    media_dir: str = "."
    """The folder relative image paths are read from."""
    images_column: str = "images"
    _row_images: list = field(default_factory=list, repr=False)

    def parse(self, batch, indices, parse_row):
        column = batch.get(self.images_column) or [None] * len(indices)
        values = iter(column)

        def with_images(row: dict):
            paths = image_paths(next(values), self.media_dir)
            self._row_images.append((paths, [self._num_tokens(p) for p in paths]))
            return parse_row(expand_placeholders(row, [self.vision.expand(n) for n in self._row_images[-1][1]]))

        self._row_images = []
        return super().parse(batch, indices, with_images)

    def _num_tokens(self, path: str) -> int:
        image = open_image(path)
        try:
            return self.vision.num_tokens(image)
        except ValueError as exc:  # e.g. an aspect ratio over 200 (LLaMA-Factory squeezes such images first)
            raise RowError(f"image file {path!r} ({image.size[0]}x{image.size[1]} pixels): the model's image "
                           f"processor refuses it: {exc}") from None

    def __call__(self, batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        out = super().__call__(batch, indices)
        image_id, start_id, end_id = self.vision.token_ids
        out["images"] = []
        for i, (paths, counts) in enumerate(self._row_images):
            if out["_drop"][i]:
                out["images"].append([])
                continue
            ids, labels = out["input_ids"][i], out["labels"][i]
            if ids.count(image_id) != sum(counts) or ids.count(start_id) != len(paths):
                self._drop(out, i, IMAGE_CUT)
            else:
                vision_ids = {image_id, start_id, end_id}
                out["labels"][i] = labels = [IGNORE_INDEX if t in vision_ids else y for t, y in zip(ids, labels)]
                if all(label == IGNORE_INDEX for label in labels):
                    self._drop(out, i, "no_trainable_tokens")
            out["images"].append(paths if not out["_drop"][i] else [])
        return out

    @staticmethod
    def _drop(out: dict[str, list], i: int, reason: str) -> None:
        for key in SEQ:
            out[key][i] = []
        out["_drop"][i], out["_truncated"][i], out["_docs"][i] = reason, False, 0


def media_dir(source, data_args) -> str:
    """Relative image paths: a registry entry's from dataset_dir (LLaMA-Factory's media_dir), a file's from
    its folder."""
    if source.entry is not None:
        return data_args.dataset_dir or "."
    return os.path.dirname(os.path.abspath(source.name)) if os.path.isfile(source.name) else source.name


def check_source(source, vision: Vision | None) -> None:
    """A dataset with images for a text model is refused (its placeholders would be trained as text)."""
    column = source.entry.column("images") if source.entry is not None else "images"
    if vision is None and column in source.dataset.column_names:
        raise DataError(f"{source.name} has an images column, but model_name_or_path is not a vision-language model "
                        f"({', '.join(VL_MODEL_TYPES)}): train it with one, or drop the column.")


@dataclass
class VisionCollator:
    """The text collator's batch plus the micro-batch's images (docs/vl.md, the batch contract).

    Example (a row with one 100 x 60 image and a text-only row; the tiny demo's processor: 14-pixel patches,
    2 x 2 merge): ``[{..., "images": ["/d/a.png"]}, {..., "images": []}]`` -> the base batch plus
    ``mm_token_type_ids`` [2, L] (1 at the 8 ``<|image_pad|>`` of row 0, else 0), ``pixel_values`` [32, 1176] and
    ``image_grid_thw`` [[1, 4, 8]]. No image in the micro-batch: no pixel_values / image_grid_thw.
    """

    base: Any
    vision: Vision

    def __call__(self, features: list[dict[str, Any]]) -> dict:
        batch = self.base(features)
        # transformers 5.23's Qwen-VL builds the 3-D M-RoPE positions only when it gets the token types (its
        # processor's mm_token_type_ids: 1 at <|image_pad|>); without them it falls back to 1-D positions silently
        batch["mm_token_type_ids"] = (batch["input_ids"] == self.vision.token_ids[0]).long()
        paths = [p for f in features for p in (f.get("images") or [])]
        if paths:
            try:
                images = [open_image(p) for p in paths]
            except RowError as exc:
                raise DataError(f"while collating a batch: {exc} (it was readable when the data was tokenized)") \
                    from None
            batch.update(self.vision.process(images))
        return batch


def image_example(job, marked_text) -> list[str]:
    """--dry-run: the first training row with an image (else the first row), each image's run of
    ``<|image_pad|>`` folded to ``<|image_pad|>*n``, and each image's size, resize and grid."""
    import re

    vision = job.collator.vision
    dataset = job.train_dataset
    index = next((i for i, paths in enumerate(dataset["images"]) if paths), 0)
    row = dataset[index]
    text = marked_text(job.tokenizer, row["input_ids"], row["labels"])
    token = re.escape(vision.image_token)
    text = re.sub(f"(?:{token})+", lambda m: f"{vision.image_token}*{len(m.group(0)) // len(vision.image_token)}",
                  text)
    lines = [f"--- training row {index} (0-based, in training order) ---", text]
    for i, path in enumerate(row["images"]):
        image = open_image(path)
        grid = vision.process([image])["image_grid_thw"][0].tolist()
        patch = int(vision.image_processor.patch_size)
        lines.append(f"image {i}: {path}: {image.size[0]}x{image.size[1]} pixels, resized to "
                     f"{grid[2] * patch}x{grid[1] * patch}, grid (t, h, w) {tuple(grid)}, "
                     f"{vision.num_tokens(image)} {vision.image_token} tokens")
    return lines
