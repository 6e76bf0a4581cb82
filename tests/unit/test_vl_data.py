"""Images in the shared data pipeline (roll.data.vision, docs/vl.md) with the tiny Qwen2.5-VL: token layouts and
batches against counts computed by hand from the image sizes, the errors that name the file and row, the
image_cut drop, the dry-run and the config refusals.

Hand counts, the tiny processor (14-pixel patches merged 2 x 2: 28-pixel tokens, 56^2 <= pixels <= 112^2; Qwen's
smart resize: each side rounded to a multiple of 28, then scaled into the pixel bounds):
- 100 x 60 (w x h): 112 x 56, grid (1, 4, 8): 32 patches, 8 tokens;
- 40 x 30: 28 x 28 is under 56^2, scaled by sqrt(3136 / 1200) and rounded up: 84 x 56, grid (1, 4, 6): 6 tokens;
- 200 x 150: 196 x 140 is over 112^2, scaled by sqrt(30000 / 12544) and rounded down: 112 x 84, grid (1, 6, 8): 12.
"""

from __future__ import annotations

import json
import os

import pytest

from roll import IGNORE_INDEX
from roll.errors import ConfigError, DataError

SIZES = {"a.png": (100, 60), "b.png": (40, 30), "c.png": (200, 150)}
GRIDS = {"a.png": (1, 4, 8), "b.png": (1, 4, 6), "c.png": (1, 6, 8)}
TOKENS = {"a.png": 8, "b.png": 6, "c.png": 12}


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory) -> str:
    from roll.demo.tiny_vl import make_tiny_vl_model

    return make_tiny_vl_model(str(tmp_path_factory.mktemp("tiny_vl")))


@pytest.fixture(scope="module")
def tok(vl_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(vl_model)


def turn(user: str, reply: str) -> list[dict]:
    return [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]


ROWS = [{"messages": turn("<image>What colour?", "Red."), "images": ["img/a.png"]},
        {"messages": turn("Hi", "Hello."), "images": []},
        {"messages": turn("<image><image>Two?", "Yes."), "images": ["img/b.png", "img/c.png"]}]


def write_data(folder, rows=ROWS, name="data.json") -> str:
    from PIL import Image

    os.makedirs(folder / "img", exist_ok=True)
    for image, size in SIZES.items():
        Image.new("RGB", size, (200, 30, 30)).save(folder / "img" / image)
    (folder / name).write_text(json.dumps(rows))
    return str(folder / name)


def job_for(vl_model, dataset, *args):
    from roll import router
    from roll.config.parser import parse_args
    from roll.data.policy import PaddingPolicy

    _, config = parse_args(["recipes/demo/tiny_vl_sft.yaml", f"model_name_or_path={vl_model}", f"dataset={dataset}",
                            "shuffle=false", "overwrite_cache=true", *args])
    return router.build_job(config, PaddingPolicy())


def test_each_placeholder_becomes_its_images_hand_counted_vision_tokens_never_trained(vl_model, tok, tmp_path):
    job, stats = job_for(vl_model, write_data(tmp_path), "train_on_prompt=true")
    rows = job.train_dataset
    ids = tok.convert_tokens_to_ids
    start, pad, end = ids("<|vision_start|>"), ids("<|image_pad|>"), ids("<|vision_end|>")

    def text(s):
        return tok(s, add_special_tokens=False)["input_ids"]

    prompt = text("<|im_start|>user\n") + [start] + [pad] * 8 + [end] + text(
        "What colour?<|im_end|>\n<|im_start|>assistant\n")
    assert rows[0]["input_ids"] == prompt + text("Red.<|im_end|>")
    vision = [i for i, t in enumerate(rows[0]["input_ids"]) if t in (start, pad, end)]
    assert vision == list(range(len(text("<|im_start|>user\n")), len(text("<|im_start|>user\n")) + 10))
    # train_on_prompt trains the prompt, never the vision tokens (nor the first position)
    assert [rows[0]["labels"][i] for i in vision] == [IGNORE_INDEX] * 10
    assert rows[0]["labels"][1:vision[0]] == rows[0]["input_ids"][1:vision[0]]
    two = rows[2]["input_ids"]
    first = two.index(start)
    assert two[first:first + 22] == [start] + [pad] * 6 + [end] + [start] + [pad] * 12 + [end]
    assert rows[1]["images"] == [] and rows[0]["images"] == [str(tmp_path / "img" / "a.png")]
    assert stats.num_dropped == 0


def test_the_collator_concatenates_the_micro_batchs_images_in_row_order(vl_model, tmp_path):
    from roll.demo.tiny_vl import tiny_image_processor
    from PIL import Image

    job, _ = job_for(vl_model, write_data(tmp_path))
    rows = [job.train_dataset[i] for i in range(3)]
    batch = job.collator(rows)
    assert batch["image_grid_thw"].tolist() == [list(GRIDS[n]) for n in ("a.png", "b.png", "c.png")]
    patches = [GRIDS[n][0] * GRIDS[n][1] * GRIDS[n][2] for n in ("a.png", "b.png", "c.png")]
    assert tuple(batch["pixel_values"].shape) == (sum(patches), 3 * 2 * 14 * 14)
    processor = tiny_image_processor()  # each image alone, transformers' own processor
    alone = [processor(images=[Image.open(tmp_path / "img" / n).convert("RGB")], return_tensors="pt")["pixel_values"]
             for n in ("a.png", "b.png", "c.png")]
    import torch

    assert torch.equal(batch["pixel_values"], torch.cat(alone))
    assert int((batch["input_ids"] == job.collator.vision.token_ids[0]).sum()) == sum(TOKENS.values())
    assert "pixel_values" not in job.collator([rows[1]]) and "image_grid_thw" not in job.collator([rows[1]])
    # the HF model takes the batch as it is (it checks image tokens against image features itself)
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(vl_model)
    assert torch.isfinite(model(**batch).loss)
    assert batch["mm_token_type_ids"].tolist() == (batch["input_ids"] == job.collator.vision.token_ids[0]).long().tolist()


def test_the_batch_gives_the_model_its_3d_positions(vl_model, tmp_path):
    """M-RoPE of row 0 by hand: "<|im_start|>user\n" (4 tokens) and <|vision_start|> at 0..4; the 8 image tokens
    (grid 1 x 4 x 8 merged 2 x 2: 1 x 2 x 4) at t = 5, h = 5 + row, w = 5 + column; the text after them from
    5 + max(0, 1, 3) + 1 = 9 on, 1-D. transformers 5.23 computes them only with mm_token_type_ids."""
    import torch
    from transformers import AutoModelForImageTextToText

    job, _ = job_for(vl_model, write_data(tmp_path))
    batch = job.collator([job.train_dataset[0]])
    model = AutoModelForImageTextToText.from_pretrained(vl_model).eval()
    positions, _ = model.model.get_rope_index(batch["input_ids"], batch["mm_token_type_ids"],
                                              image_grid_thw=batch["image_grid_thw"],
                                              attention_mask=batch["attention_mask"])
    length = batch["input_ids"].shape[1]
    text_after = list(range(9, 9 + length - 13))
    assert positions[0, 0].tolist() == list(range(5)) + [5] * 8 + text_after
    assert positions[1, 0].tolist() == list(range(5)) + [5] * 4 + [6] * 4 + text_after
    assert positions[2, 0].tolist() == list(range(5)) + [5, 6, 7, 8] * 2 + text_after
    without = {k: v for k, v in batch.items() if k != "mm_token_type_ids"}  # 1-D positions: other logits
    with torch.no_grad():
        assert not torch.allclose(model(**batch).logits[0, 13:], model(**without).logits[0, 13:])


def test_cutoff_len_never_cuts_an_image_the_row_is_dropped_and_counted(vl_model, tmp_path):
    # Tokens (tiny BPE, the tokenizer's ChatML): row 0 = 4 ("<|im_start|>user\n") + 10 (vision) + 15 + 4 ("Red.
    # <|im_end|>") = 33; row 2 = 4 + 22 + 10 + 4 = 40; the text row 17. At 32 the prompt is cut from the left
    # (docs/data.md): row 0 loses "<|im_start|>" only and is kept whole-imaged; row 2 loses 8, 4 of them vision.
    job, stats = job_for(vl_model, write_data(tmp_path), "cutoff_len=32")
    assert stats.dropped == {"image_cut": 1} and stats.num_truncated == 1
    pad = job.collator.vision.token_ids[0]
    assert [r["input_ids"].count(pad) for r in job.train_dataset] == [8, 0]
    assert len(job.train_dataset[0]["input_ids"]) == 32


@pytest.mark.parametrize("rows, expected", [
    ([{"messages": turn("<image>What?", "Red."), "images": ["img/missing.png"]}], ["missing.png", "row 0", "exist"]),
    ([ROWS[1], {"messages": turn("<image><image>What?", "Red."), "images": ["img/a.png"]}],
     ["row 1", "2 <image> placeholder(s) but 1 image(s)"]),
    ([{"messages": turn("<image>What?", "Red."), "images": ["img/broken.png"]}], ["broken.png", "cannot be read"]),
])
def test_bad_images_and_placeholder_counts_name_the_file_and_row(vl_model, tmp_path, rows, expected):
    dataset = write_data(tmp_path, rows)
    (tmp_path / "img" / "broken.png").write_bytes(b"not an image")
    with pytest.raises(DataError) as raised:
        job_for(vl_model, dataset)
    assert all(part in str(raised.value) for part in expected), str(raised.value)
    assert "data.json" in str(raised.value)


def test_a_registry_entry_reads_images_from_dataset_dir(vl_model, tmp_path):
    write_data(tmp_path, ROWS, name="shapes.json")
    (tmp_path / "dataset_info.json").write_text(json.dumps({"shapes": {
        "file_name": "shapes.json", "formatting": "sharegpt", "columns": {"messages": "messages", "images": "images"},
        "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}}}))
    job, _ = job_for(vl_model, "shapes", f"dataset_dir={tmp_path}")
    assert job.train_dataset[2]["images"] == [str(tmp_path / "img" / n) for n in ("b.png", "c.png")]


def test_dry_run_shows_the_layout_and_the_image_sizes(vl_model, tmp_path):
    from roll.data.report import dry_run_report

    job, stats = job_for(vl_model, write_data(tmp_path))
    summary, text = dry_run_report(job, stats)
    assert "<|vision_start|><|image_pad|>*8<|vision_end|>What colour?" in text
    assert "100x60 pixels, resized to 112x56, grid (t, h, w) (1, 4, 8), 8 <|image_pad|> tokens" in text
    assert summary["batch_shapes"]["pixel_values"] == [32, 1176]


@pytest.mark.parametrize("args, named", [
    (["stage=dpo"], "stage dpo"), (["streaming=true"], "streaming"),
    (["finetuning_type=freeze", "freeze_vision_tower=false"], "freeze_vision_tower"),
])
def test_what_a_vl_model_cannot_do_yet_is_refused_when_the_recipe_is_read(vl_model, args, named):
    from roll.config.parser import parse_args

    with pytest.raises(ConfigError, match=named):
        parse_args(["recipes/demo/tiny_vl_sft.yaml", f"model_name_or_path={vl_model}", *args])


def test_images_for_a_text_model_are_refused(tiny_model_dir, tmp_path):
    from roll import router
    from roll.config.parser import parse_args
    from roll.data.policy import PaddingPolicy

    _, config = parse_args(["recipes/demo/tiny_sft.yaml", f"model_name_or_path={tiny_model_dir}",
                            f"dataset={write_data(tmp_path)}"])
    with pytest.raises(DataError, match="not a vision-language model"):
        router.build_job(config, PaddingPolicy())


def tiny_qwen3_vl(out: str) -> str:
    """A tiny Qwen3-VL (interleaved M-RoPE, deepstack after vision block 0, 16-pixel patches: 32-pixel tokens,
    64^2 <= pixels <= 128^2) with the tiny VL tokenizer (roll.demo.tiny_vl's, at 2 layers)."""
    from roll.demo.tiny_vl import make_tiny_qwen3_vl_model

    return make_tiny_qwen3_vl_model(out, num_layers=2, vision=dict(deepstack_visual_indexes=[0]))


def test_qwen3_vl_takes_the_same_batch(tmp_path):
    """Qwen3-VL: the same layout with its 32-pixel tokens. By hand: 100 x 60 -> 96 x 64, grid (1, 4, 6), 6 tokens;
    40 x 30 -> 32 x 32 is under 64^2, scaled by sqrt(4096 / 1200), rounded up: 96 x 64, 6 tokens; 200 x 150 ->
    192 x 160 is over 128^2, scaled by sqrt(30000 / 16384), rounded down: 128 x 96, grid (1, 6, 8), 12 tokens.
    Positions of row 0: text and <|vision_start|> 0..4, the 1 x 2 x 3 merged grid at 5 + (0, row, column), text
    from 5 + 2 + 1 = 8 on."""
    import torch
    from transformers import AutoModelForImageTextToText

    model_dir = tiny_qwen3_vl(str(tmp_path / "qwen3_vl"))
    job, _ = job_for(model_dir, write_data(tmp_path))
    batch = job.collator([job.train_dataset[i] for i in range(3)])
    assert batch["image_grid_thw"].tolist() == [[1, 4, 6], [1, 4, 6], [1, 6, 8]]
    assert batch["mm_token_type_ids"].sum(dim=1).tolist() == [6, 0, 6 + 12]
    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    assert torch.isfinite(model(**batch).loss)
    positions, _ = model.model.get_rope_index(batch["input_ids"][:1], batch["mm_token_type_ids"][:1],
                                              image_grid_thw=batch["image_grid_thw"][:1],
                                              attention_mask=batch["attention_mask"][:1])
    assert positions[1, 0, :14].tolist() == [0, 1, 2, 3, 4, 5, 5, 5, 6, 6, 6, 8, 9, 10]
    assert positions[2, 0, :14].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 5, 6, 7, 8, 9, 10]


def test_packed_rows_keep_their_images_each_samples_positions_and_the_per_token_loss(vl_model, tmp_path):
    """packing: true with a VL model (the standard backend's path): the three rows (40, 33 and 17 tokens, see
    test_cutoff_len_never_cuts_an_image...) packed best-fit into one row of 128 carry their images in the packed
    order (row 2's two, then row 0's); each sample's M-RoPE positions are HF's get_rope_index of the sample alone;
    and HF's loss of the packed row (position_ids [4, 1, s]: the restarting text positions keep attention inside
    each sample) is the unpacked batch's, over the same trained tokens. Measured: 4.8e-7 apart (fp32 rounding);
    2.0e-2 with the language model's KV cache on (its mask builder then skips the packed rule: the samples attend
    to each other)."""
    import torch

    from backends.standard.vision import PackedVisionBatch, load_vl_model
    from roll import router
    from roll.config.parser import parse_args
    from roll.data.policy import PaddingPolicy
    from roll.hf_config import read_hf_config

    data = write_data(tmp_path)
    plain, _ = job_for(vl_model, data, "cutoff_len=128")
    _, config = parse_args(["recipes/demo/tiny_vl_sft.yaml", f"model_name_or_path={vl_model}", f"dataset={data}",
                            "shuffle=false", "overwrite_cache=true", "cutoff_len=128", "packing=true"])
    packed, _ = router.build_job(config, PaddingPolicy(packing=True))
    images = plain.train_dataset["images"]
    assert packed.train_dataset["images"] == [images[2] + images[0]]
    assert packed.train_dataset["seq_lens"] == [[40, 33, 17]]
    hf_config = read_hf_config(vl_model)
    batch = PackedVisionBatch(packed.collator, hf_config)([packed.train_dataset[0]])
    assert "cu_seqlens" not in batch and "attention_mask" not in batch
    model = load_vl_model(vl_model, dtype=torch.float32, attn_implementation="sdpa").eval()  # the backend's load
    grids = batch["image_grid_thw"]
    start = 0
    for row, length, grid in ((2, 40, grids[:2]), (0, 33, grids[2:]), (1, 17, None)):
        alone = plain.collator([plain.train_dataset[row]])
        expected, _ = model.model.get_rope_index(alone["input_ids"], alone["mm_token_type_ids"], image_grid_thw=grid)
        assert torch.equal(batch["position_ids"][1:, :, start:start + length], expected), row
        assert batch["position_ids"][0, 0, start:start + length].tolist() == list(range(length))
        start += length
    with torch.no_grad():
        packed_loss = model(**batch).loss
        unpacked_loss = model(**plain.collator([plain.train_dataset[i] for i in range(3)])).loss
    assert abs(float(packed_loss) - float(unpacked_loss)) < 2e-6, (float(packed_loss), float(unpacked_loss))


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_the_standard_backend_trains_packed_vl_rows_as_the_unpacked_ones(vl_model, family, tmp_path):
    """One step of StandardBackend.train (the HF Trainer, the backend's collator for packed VL rows) on the three
    rows packed into one, against the three unpacked rows in one batch: the same loss (measured 4.8e-7 apart;
    Qwen3-VL, its deepstack features at the packed image tokens: 0.0)."""
    from backends.standard.backend import StandardBackend
    from roll import router
    from roll.config.parser import parse_args
    from roll.demo.tiny_vl import make_tiny_qwen3_vl_model

    data = write_data(tmp_path)
    if family == "qwen3_vl":
        vl_model = make_tiny_qwen3_vl_model(str(tmp_path / "tiny_qwen3_vl"))
    losses = {}
    for name, args in (("unpacked", ["per_device_train_batch_size=3"]),
                       ("packed", ["packing=true", "per_device_train_batch_size=1"])):
        _, config = parse_args(["recipes/demo/tiny_vl_sft.yaml", f"model_name_or_path={vl_model}", f"dataset={data}",
                                "shuffle=false", "overwrite_cache=true", "cutoff_len=128", "max_steps=1",
                                "logging_steps=1", "disable_tqdm=true", f"output_dir={tmp_path / name}", *args])
        backend = StandardBackend(config)
        backend.setup_distributed()
        try:
            job, _ = router.build_job(config, backend.padding_policy("sft"))
            result = backend.train(job, backend.apply_finetuning(backend.load_models("sft", job.tokenizer)))
        finally:
            backend.teardown()
        losses[name] = result.log_history[0]["loss"]
    assert abs(losses["packed"] - losses["unpacked"]) < 2e-6, losses
