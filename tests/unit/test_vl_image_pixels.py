"""image_max_pixels / image_min_pixels: LLaMA-Factory 0.9.5's resize before the model's image processor
(roll.data.vision_resize, docs/vl.md "Image sizes"), against sizes and token counts worked out by hand.

LLaMA-Factory's steps (llamafactory/data/mm_plugin.py, _preprocess_image of BasePlugin then Qwen2VLPlugin): over
max pixels, both sides times sqrt(max / (w * h)), truncated; under min pixels the same with min; a side under 28
widened to 28; an aspect ratio over 200 squeezed to 180. Then Qwen2.5-VL's processor (14-pixel patches merged 2 x 2,
so 28-pixel tokens; its real bounds 3136 <= pixels <= 12845056): each side rounded to a multiple of 28.

By hand (w x h):
- 2000 x 1000 at 768*768 = 589824: factor sqrt(589824 / 2000000) = sqrt(0.294912) = 0.543058..., 1086.116 x
  543.058 -> 1086 x 543; the processor: 39 * 28 = 1092 x 19 * 28 = 532, grid (1, 38, 78), 2964 patches, 741 tokens.
  Without the resize: 71 * 28 = 1988 x 36 * 28 = 1008, grid (1, 72, 142), 10224 patches, 2556 tokens.
- 2000 x 1000 at 262144 (LLaMA-Factory's VL examples): sqrt(0.131072) = 0.362039..., 724.08 x 362.04 -> 724 x 362;
  the processor: 26 * 28 = 728 x 13 * 28 = 364, grid (1, 26, 52), 338 tokens.
- 1000 x 500 at 768*768: 500000 pixels, under the bound: unchanged.
- 20 x 10 at image_min_pixels 32*32 = 1024: factor sqrt(1024 / 200) = 2.2627..., 45.25 x 22.63 -> 45 x 22; then 22
  < 28: 45 x 28. The processor: 56 x 28 is under 3136, scaled by sqrt(3136 / 1260) = 1.5776 and rounded up to 84 x 56,
  grid (1, 4, 6), 6 tokens.
- 9000 x 20 at the defaults: 180000 pixels, inside the bounds; 20 < 28: 9000 x 28; 9000 / 28 > 200: 28 * 180 = 5040
  x 28; the processor: grid (1, 2, 360), 180 tokens (without the resize it refuses the aspect ratio, 450).
"""

from __future__ import annotations

import json

import pytest

from roll.data.vision_resize import ImageResize

QWEN25_PIXELS = dict(min_pixels=3136, max_pixels=12845056)
"""Qwen2.5-VL's own preprocessor_config.json bounds: wide enough that image_max_pixels decides the token count."""


@pytest.mark.parametrize("size, bounds, steps", [
    ((2000, 1000), (768 * 768, 32 * 32), [(1086, 543)]),
    ((2000, 1000), (262144, 32 * 32), [(724, 362)]),
    ((1000, 500), (768 * 768, 32 * 32), []),
    ((20, 10), (768 * 768, 32 * 32), [(45, 22), (45, 28)]),
    ((9000, 20), (768 * 768, 32 * 32), [(9000, 28), (5040, 28)]),
])
def test_the_resize_steps_are_llamafactorys_arithmetic(size, bounds, steps):
    assert ImageResize(*bounds).sizes(*size) == steps


def test_the_resize_runs_in_the_files_mode_with_pils_default_filter_then_rgb(tmp_path):
    """A palette image: LLaMA-Factory resizes it as "P" (PIL's default filter there is nearest), then converts to
    RGB; converting first would resize bicubically and blend colours no palette entry has."""
    from PIL import Image

    from roll.data.vision import open_image

    image = Image.new("P", (40, 20))
    image.putpalette([255, 0, 0, 0, 0, 255] + [0] * 762)
    image.putdata([(x // 3 + y) % 2 for y in range(20) for x in range(40)])
    image.save(tmp_path / "p.png")
    resize = ImageResize(max_pixels=600, min_pixels=100)  # 800 px: sqrt(600 / 800) -> 34 x 17, then 34 x 28
    expected = image.resize((34, 17), Image.NEAREST).resize((34, 28), Image.NEAREST).convert("RGB")
    got = open_image(str(tmp_path / "p.png"), resize)
    assert got.mode == "RGB" and got.size == (34, 28)
    assert list(got.getdata()) == list(expected.getdata())
    assert list(got.getdata()) != list(image.convert("RGB").resize((34, 17)).resize((34, 28)).getdata())


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory) -> str:
    """The tiny Qwen2.5-VL with Qwen2.5-VL's own image processor bounds."""
    from roll.demo.tiny_vl import make_tiny_vl_model

    return make_tiny_vl_model(str(tmp_path_factory.mktemp("tiny_vl_qwen25_pixels")), image_pixels=QWEN25_PIXELS)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    from PIL import Image

    folder = tmp_path_factory.mktemp("vl_pixels_data")
    Image.new("RGB", (2000, 1000), (200, 30, 30)).save(folder / "big.png")
    Image.new("RGB", (20, 10), (30, 30, 200)).save(folder / "tiny.png")
    rows = [{"messages": [{"role": "user", "content": "<image>Big?"}, {"role": "assistant", "content": "Yes."}],
             "images": ["big.png"]},
            {"messages": [{"role": "user", "content": "<image>Tiny?"}, {"role": "assistant", "content": "Yes."}],
             "images": ["tiny.png"]}]
    (folder / "rows.json").write_text(json.dumps(rows))
    return str(folder / "rows.json")


def build(vl_model, data, *args):
    from roll import router
    from roll.config.parser import parse_args
    from roll.data.policy import PaddingPolicy

    _, config = parse_args(["recipes/demo/tiny_vl_sft.yaml", f"model_name_or_path={vl_model}", f"dataset={data}",
                            "shuffle=false", "overwrite_cache=true", "cutoff_len=4096", *args])
    return router.build_job(config, PaddingPolicy())


@pytest.mark.parametrize("args, max_pixels, big_grid, big_tokens", [
    ((), None, (1, 72, 142), 2556),  # no named template, no key: the processor alone, as before the keys
    (("template=qwen2_vl",), 589824, (1, 38, 78), 741),  # LLaMA-Factory's template: its 768*768 and 32*32
    (("image_max_pixels=262144",), 262144, (1, 26, 52), 338),  # the key alone: it, and LLaMA-Factory's 32*32
], ids=["processor_alone", "qwen2_vl_template", "image_max_pixels"])
def test_images_are_resized_first_as_llamafactory_does(vl_model, data, args, max_pixels, big_grid, big_tokens):
    """Tokens at tokenization and pixel patches at collation follow the same resize (the model needs both to
    agree); the tiny image comes to 6 tokens either way."""
    from roll.data.report import dry_run_report

    job, stats = build(vl_model, data, *args)
    image_pad = job.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert [row.count(image_pad) for row in job.train_dataset["input_ids"]] == [big_tokens, 6]
    batch = job.collator([job.train_dataset[i] for i in range(2)])
    assert batch["image_grid_thw"].tolist() == [list(big_grid), [1, 4, 6]]
    assert batch["pixel_values"].shape[0] == 4 * (big_tokens + 6)
    summary, text = dry_run_report(job, stats)
    assert (summary["image_resize"] or {}).get("max_pixels") == max_pixels
    if args:
        origin = "LLaMA-Factory's defaults, with template qwen2_vl" if "template" in args[0] else \
            "image_min_pixels: LLaMA-Factory's default"
        assert f"({origin}): each image is resized first as LLaMA-Factory 0.9.5 does" in text
        first = "1086x543" if "template" in args[0] else "724x362"
        assert f"2000x1000 pixels, scaled first to {first}, resized to" in text
    else:
        assert "images: image_max_pixels and image_min_pixels unset" in text
        assert "2000x1000 pixels, resized to 1988x1008" in text


@pytest.mark.parametrize("args, message", [
    (("image_max_pixels=1000", "image_min_pixels=2000"), "image_max_pixels (1000) is smaller than image_min_pixels"),
    (("image_min_pixels=1000000", "template=qwen2_vl"), "image_max_pixels (589824) is smaller than image_min_pixels"),
    (("image_max_pixels=0",), "image_max_pixels must be a positive whole number"),
    (("image_do_pan_and_scan=true",), "image_do_pan_and_scan=True (LLaMA-Factory's key, in the command line) is not"),
])
def test_bad_pixel_bounds_are_refused_when_the_recipe_is_read(args, message):
    from roll.config.parser import parse_args
    from roll.errors import ConfigError

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_args(["recipes/demo/tiny_vl_sft.yaml", *args])


def test_llamafactorys_pan_and_scan_default_is_accepted():
    """LLaMA-Factory's default, false, from the command line too (a bool word there was kept as text and refused)."""
    from roll.config.parser import parse_args

    _, config = parse_args(["recipes/demo/tiny_vl_sft.yaml", "image_do_pan_and_scan=false", "image_max_pixels=262144"])
    assert config.data.image_max_pixels == 262144
