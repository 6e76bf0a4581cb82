"""Qwen2.5-VL, Qwen2-VL and Qwen3-VL on Megatron, under one 2-process torchrun per test (gloo, fp32, CPU): the families'
conversion guarantees and training.

Tiny models with random values in every tensor (vision tower included): roll.demo.tiny_vl's (hidden 64, 4 heads
over 2 KV groups, M-RoPE sections 2/3/3, tied), an odd-shaped one (hidden 48, 6 heads of 8 over 2 KV groups,
sections 1/1/2, a 517-row vocabulary that TP2 pads to 518, untied, merger out width 48) and a Qwen2-VL of that odd
language model with Qwen2-VL's own tower (``make_tiny_qwen2_vl_model``: LayerNorms with biases, fc1/fc2 MLP).
Qwen3-VL: roll.demo.tiny_vl's tiny Qwen3-VL (4 layers, q/k norms, interleaved sections 2/3/3, both tower blocks
feeding deepstack features to layers 0 and 1, tied) and an odd-shaped one (2 layers, hidden 48, 6 heads of 12 over
2 KV groups: a 72-wide attention, interleaved sections 2/2/2, vocabulary 517, untied, deepstack from block 1 into
layer 0), checked at TP1, TP2, PP2 (both deepstack layers on stage 0) and round-tripped TP1 -> TP2, PP2 -> TP1; the
training test runs both families' TP, PP, CP and packed layouts (CP and packed against transformers' unpacked loss
and the standard backend's packed batches):

- ``roll-convert check``'s logits parity (``convert.check_parity``) on a batch with two images of different sizes
  (grids 4x6 and 6x2 patches) and a text-only row, HF's ``...ForConditionalGeneration`` against the
  Megatron model (the vision tower on the first stage), at TP1, TP2, PP2 and PP2 x VPP2 (a 4-layer variant; Qwen2-VL
  at TP1, TP2, PP2), within the bounds of tests/bounds.py;
- HF -> Megatron -> HF bit-exact across TP1, TP2 and PP2 (written at one layout, exported at another), the vision
  tower's tensors included; the export loads with transformers and keeps the image processor.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.bounds import assert_within
from tests.distributed.test_mca_conversion import _read_weights, logit_comparisons, randomized, run_cases

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.distributed, pytest.mark.mca]


def odd_vl_model(out_dir: str) -> str:
    """roll.demo.tiny_vl's model at an odd shape (see the module docstring)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from roll.demo.tiny_vl import build_vl_tokenizer, tiny_image_processor, tiny_vl_config

    tok = build_vl_tokenizer()
    config = tiny_vl_config(tok, tie_word_embeddings=False)
    text = config.text_config
    text.hidden_size, text.num_attention_heads, text.num_key_value_heads = 48, 6, 2
    text.intermediate_size, text.vocab_size = 96, 517
    text.rope_parameters["mrope_section"] = [1, 1, 2]
    config.vision_config.out_hidden_size = 48
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    tiny_image_processor().save_pretrained(out_dir)
    return out_dir


def odd_qwen3_vl_model(out_dir: str) -> str:
    """roll.demo.tiny_vl's Qwen3-VL at an odd shape (see the module docstring)."""
    from roll.demo.tiny_vl import make_tiny_qwen3_vl_model

    text = dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, head_dim=12, intermediate_size=96,
                vocab_size=517, rope_parameters={"rope_type": "default", "mrope_section": [2, 2, 2],
                                                 "mrope_interleaved": True, "rope_theta": 1e4})
    return make_tiny_qwen3_vl_model(out_dir, num_layers=2, tie_word_embeddings=False, text=text,
                                    vision=dict(out_hidden_size=48, deepstack_visual_indexes=[1]))


def assert_vl_exported_like(original: str, exported: str) -> None:
    """Bit-exact tensors (the vision tower's too), the same config.json, the image processor kept, and
    transformers loads it as the vision-language model it was."""
    import json

    from transformers import AutoModelForImageTextToText

    a, b = _read_weights(original), _read_weights(exported)
    assert sorted(a) == sorted(b) and any(name.startswith(("visual.", "model.visual.")) for name in a)
    assert all(torch.equal(a[n], b[n]) for n in a), [n for n in a if not torch.equal(a[n], b[n])]
    with open(os.path.join(original, "config.json"), encoding="utf-8") as fa, \
            open(os.path.join(exported, "config.json"), encoding="utf-8") as fb:
        assert json.load(fa) == json.load(fb)
    assert os.path.isfile(os.path.join(exported, "preprocessor_config.json"))
    model = AutoModelForImageTextToText.from_pretrained(exported, dtype=torch.float32)
    loaded = model.state_dict()  # transformers' in-memory names: model.visual.*, model.language_model.*
    on_disk = {name: (name if name in a else name.replace("model.visual.", "visual.").replace("language_model.", ""))
               for name in ("model.visual.patch_embed.proj.weight", "model.language_model.embed_tokens.weight")}
    assert all(torch.equal(loaded[name], a[file]) for name, file in on_disk.items())


ROUND_TRIPS = (("tp1", {}, "tp2", {"tp": 2}), ("tp2", {"tp": 2}, "pp2", {"pp": 2}), ("pp2", {"pp": 2}, "tp1", {}),
               ("q2_tp2", {"tp": 2}, "pp2", {"pp": 2}))
"""(written at, its layout, exported at, its layout): every layout on both sides once; Qwen2-VL from TP2 to PP2."""


def qwen3_vl_cases(tmp_path) -> tuple[list[dict], list[tuple[str, str]]]:
    """Qwen3-VL's check cases and round trips (TP1 -> TP2 on the tiny model, PP2 -> TP1 on the odd one); the
    (original, export) directories to compare."""
    from roll.demo.tiny_vl import make_tiny_qwen3_vl_model

    tiny = randomized(make_tiny_qwen3_vl_model(str(tmp_path / "q3_tiny_src")), str(tmp_path / "q3_tiny"))
    odd = randomized(odd_qwen3_vl_model(str(tmp_path / "q3_odd_src")), str(tmp_path / "q3_odd"))
    cases = [dict(name="q3vl_tp1", kind="check", dir=tiny),
             dict(name="q3vl_tp2", kind="check", dir=tiny, tp=2),
             dict(name="q3vl_pp2", kind="check", dir=tiny, pp=2),  # both deepstack layers on stage 0
             dict(name="q3vl_odd_tp1", kind="check", dir=odd),
             dict(name="q3vl_odd_tp2_padded_vocab", kind="check", dir=odd, tp=2)]
    exports = []
    for written, write_layout, exported, export_layout, hf in (("tp1", {}, "tp2", {"tp": 2}, tiny),
                                                               ("pp2", {"pp": 2}, "tp1", {}, odd)):
        mca, out = str(tmp_path / f"q3_mca_{written}"), str(tmp_path / f"q3_hf_{written}_{exported}")
        cases += [dict(name=f"q3_to_mca_{written}", kind="hf2mca", dir=hf, out=mca, **write_layout),
                  dict(name=f"q3_to_hf_{written}_{exported}", kind="mca2hf", dir=mca, out=out, max_shard_bytes=60_000,
                       **export_layout)]
        exports.append((hf, out))
    return cases, exports


def test_qwen2_5_vl_logits_tp1_tp2_pp2_and_bit_exact_round_trips(tmp_path):
    """The three families (Qwen3-VL's cases from ``qwen3_vl_cases``) in one torchrun."""
    from roll.demo.tiny_vl import make_tiny_qwen2_vl_model, make_tiny_vl_model

    tiny = randomized(make_tiny_vl_model(str(tmp_path / "tiny_src")), str(tmp_path / "tiny"))
    odd = randomized(odd_vl_model(str(tmp_path / "odd_src")), str(tmp_path / "odd"))
    deep = randomized(make_tiny_vl_model(str(tmp_path / "deep_src"), num_layers=4), str(tmp_path / "deep"))
    qwen2_vl = randomized(make_tiny_qwen2_vl_model(str(tmp_path / "q2_src")), str(tmp_path / "q2"))
    cases = [dict(name="vl_tp1", kind="check", dir=tiny),
             dict(name="vl_tp2", kind="check", dir=tiny, tp=2),
             dict(name="vl_pp2", kind="check", dir=tiny, pp=2),
             dict(name="vl_pp2_vpp2", kind="check", dir=deep, pp=2, vpp=2),  # the tower on virtual stage 0 only
             dict(name="vl_odd_tp1", kind="check", dir=odd),
             dict(name="vl_odd_tp2_padded_vocab", kind="check", dir=odd, tp=2),
             dict(name="qwen2_vl_tp1", kind="check", dir=qwen2_vl),
             dict(name="qwen2_vl_tp2_padded_vocab", kind="check", dir=qwen2_vl, tp=2),
             dict(name="qwen2_vl_pp2", kind="check", dir=qwen2_vl, pp=2)]
    sources = (tiny, odd, tiny, qwen2_vl)
    for (written, write_layout, exported, export_layout), hf in zip(ROUND_TRIPS, sources):
        mca, out = str(tmp_path / f"mca_{written}"), str(tmp_path / f"hf_{written}_{exported}")
        cases += [dict(name=f"to_mca_{written}", kind="hf2mca", dir=hf, out=mca, **write_layout),
                  dict(name=f"to_hf_{written}_{exported}", kind="mca2hf", dir=mca, out=out, max_shard_bytes=60_000,
                       **export_layout)]
    qwen3_cases, qwen3_exports = qwen3_vl_cases(tmp_path)
    res = run_cases(cases + qwen3_cases, tmp_path, timeout=720)
    assert all(rows[0]["diff"] == rows[1]["diff"] for rows in res.values() if "diff" in rows[0])
    assert_within(logit_comparisons(res))
    for (written, _, exported, _), hf in zip(ROUND_TRIPS, sources):
        assert_vl_exported_like(hf, str(tmp_path / f"hf_{written}_{exported}"))
    for hf, export in qwen3_exports:
        assert_vl_exported_like(hf, export)


def vl_rows(hf_config: dict, seed: int = 0) -> list[dict]:
    """Four tokenized sft rows: two text-only ones (one micro-batch without images), one with a 4 x 6-patch image,
    one with a 6 x 2- and a 4 x 6-patch image; prompt and vision tokens unlabelled, random pixel values."""
    gen = torch.Generator().manual_seed(seed)
    vs, pad, ve = (hf_config[f"{n}_token_id"] for n in ("vision_start", "image", "vision_end"))
    vision = hf_config["vision_config"]
    width = 3 * vision["temporal_patch_size"] * vision["patch_size"] ** 2

    def text(n: int) -> list[int]:
        return torch.randint(3, 500, (n,), generator=gen).tolist()

    def image(grid: tuple[int, int, int]) -> tuple[list[int], tuple[torch.Tensor, tuple[int, int, int]]]:
        patches = grid[0] * grid[1] * grid[2]
        return [vs, *[pad] * (patches // 4), ve], (torch.randn(patches, width, generator=gen), grid)

    (a, image_a), (b, image_b), (c, image_c) = image((1, 4, 6)), image((1, 6, 2)), image((1, 4, 6))
    layouts = [(text(6), [], text(4)), (text(3), [], text(5)), (text(2) + a + text(1), [image_a], text(4)),
               (text(1) + b + text(1) + c, [image_b, image_c], text(3))]
    rows = []
    for prompt, images, answer in layouts:
        ids = prompt + answer
        rows.append({"input_ids": ids, "attention_mask": [1] * len(ids), "images": images,
                     "labels": [-100] * len(prompt) + answer})
    return rows


def hf_loss(model_dir: str, rows: list[dict]) -> float:
    """transformers' loss of ``rows`` as one batch (right-padded), with the modality of each token so that HF uses
    its M-RoPE positions: the mean over the labelled tokens, what the mca backend's step logs."""
    from transformers import AutoModelForImageTextToText

    from roll.mrope import mm_token_type_ids

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32,
                                                        attn_implementation="sdpa").eval()
    length = max(len(r["input_ids"]) for r in rows)

    def padded(key: str, value: int) -> torch.Tensor:
        return torch.tensor([r[key] + [value] * (length - len(r[key])) for r in rows])

    input_ids = padded("input_ids", 0)
    images = [image for r in rows for image in r["images"]]
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=padded("attention_mask", 0), labels=padded("labels", -100),
                    pixel_values=torch.cat([p for p, _ in images]), image_grid_thw=torch.tensor([g for _, g in images]),
                    mm_token_type_ids=mm_token_type_ids(input_ids, model.config.to_dict()))
    return float(out.loss)


def hf_losses(model_dir: str, rows: list[dict], steps: int, tower_trained: bool, packed: bool = False) -> list[float]:
    """transformers' losses of ``rows`` as one batch (right-padded; with the modality of each token, so that HF uses
    its M-RoPE positions; ``packed``: the standard backend's packed batch, ``standard_packed_batch``) over ``steps``
    steps of the mca runs' optimisation, written out: AdamW (lr 1e-3 decaying linearly to 0 over the steps, betas
    0.9 / 0.999, eps 1e-8, no weight decay), gradients clipped at norm 1, the vision tower and merger trained or
    frozen. Each loss is the mean over the labelled tokens, what a step logs. The model is loaded as the standard
    backend loads it (``load_vl_model``: without a KV cache, whose mask builder would let packed samples attend to
    each other)."""
    from transformers import get_scheduler

    from backends.standard.vision import load_vl_model
    from roll.mrope import mm_token_type_ids

    model = load_vl_model(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.model.visual.requires_grad_(tower_trained)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    schedule = get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=steps)
    length = max(len(r["input_ids"]) for r in rows)

    def padded(key: str, value: int) -> torch.Tensor:
        return torch.tensor([r[key] + [value] * (length - len(r[key])) for r in rows])

    input_ids = padded("input_ids", 0)
    images = [image for r in rows for image in r["images"]]
    batch = standard_packed_batch(model_dir, rows) if packed else dict(
        input_ids=input_ids, attention_mask=padded("attention_mask", 0), labels=padded("labels", -100),
        pixel_values=torch.cat([p for p, _ in images]), image_grid_thw=torch.tensor([g for _, g in images]),
        mm_token_type_ids=mm_token_type_ids(input_ids, model.config.to_dict()))
    losses = []
    for _ in range(steps):
        loss = model(**batch).loss
        losses.append(float(loss.detach()))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
    return losses


FAMILY_RUNS = {"qwen2_5_vl": ["tp1", "tp2_sp", "pp2", "pp2_resume", "pp2_frozen", "cp2", "packed", "packed_pp2",
                              "packed_cp2"],
               "qwen2_vl": ["tp1"], "qwen3_vl": ["tp1", "tp2_sp", "pp2", "pp2_frozen", "cp2", "packed", "packed_cp2",
                                                   "packed_tp2_sp"]}
"""The worker's runs per family (tests/distributed/_mca_workers/vl_train_runs.py); resuming is family-neutral."""


def test_qwen2_5_vl_trains_through_the_mca_trainer_tp1_tp2_pp2_tower_trained_and_frozen(tmp_path):
    """The batch keys through Megatron's schedule (a micro-batch without images, one with three), the first stage's
    vision forward, and freezing, in one torchrun for the three families. Qwen2.5-VL: step 1's loss is HF's on the
    same rows at TP1 x DP2, TP2 with sequence parallelism (the images go in before the sequence is split), PP2, CP2
    (each rank 2 of every row's 4 chunks: the 3-D positions are cut as the tokens are) and packed in pairs (each
    sample its own M-RoPE positions; at DP2, PP2 and CP2: each packed sample cut into 4 chunks); step 2 agrees across
    layouts; resuming PP2's step-1 checkpoint (the HF tower inside Megatron's checkpoint) repeats its step 2 exactly.
    Qwen2-VL (its own tower) trains at TP1 x DP2 with step 1 at HF's loss. Qwen2.5-VL and Qwen3-VL (deepstack into
    layers 0 and 1, both on PP2's first stage; under CP and packing its features take the rows of the main image
    features): both steps' losses are transformers' with the same optimisation written out (``hf_losses``) at TP1 x
    DP2, TP2 + SP with full recompute, PP2, CP2 and packed at DP2 and CP2 (Qwen3-VL also packed at TP2 + SP: its
    deepstack features scattered along the packed stream), tower trained, and at PP2 with
    LLaMA-Factory's defaults (tower and merger frozen); every packed run's two steps are also the standard backend's
    on the same packed batches (``standard_packed_batch``); a trained tower, projector and deepstack mergers change,
    frozen ones do not."""
    import json

    from roll.demo.tiny_vl import make_tiny_qwen2_vl_model, make_tiny_qwen3_vl_model, make_tiny_vl_model
    from tests.bounds import BACKEND_VL, BACKEND_VL_STEPS, VL_LAYOUT, Comparison
    from tests.helpers import REPO, output_of, torchrun

    makers = {"qwen2_5_vl": make_tiny_vl_model, "qwen2_vl": make_tiny_qwen2_vl_model,
              "qwen3_vl": make_tiny_qwen3_vl_model}
    spec, rows = [], {}
    for family, runs in FAMILY_RUNS.items():
        model = randomized(makers[family](str(tmp_path / f"{family}_src")), str(tmp_path / family))
        with open(os.path.join(model, "config.json"), encoding="utf-8") as fh:
            rows[family] = vl_rows(json.load(fh))
        torch.save(rows[family], tmp_path / f"{family}_rows.pt")
        spec.append({"family": family, "model": model, "rows": str(tmp_path / f"{family}_rows.pt"), "runs": runs})
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    worker = os.path.join(REPO, "tests", "distributed", "_mca_workers", "vl_train_runs.py")
    proc = torchrun(worker, str(tmp_path / "spec.json"), str(tmp_path / "result.json"), timeout=1200)
    assert proc.returncode == 0, output_of(proc)
    results = json.loads((tmp_path / "result.json").read_text())
    models = {entry["family"]: entry["model"] for entry in spec}
    comparisons = []
    for family in ("qwen2_5_vl", "qwen3_vl"):
        res = results[family]
        reference = {trained: hf_losses(models[family], rows[family], 2, trained) for trained in (True, False)}
        standard_packed = hf_losses(models[family], rows[family], 2, True, packed=True)
        for name, run in res.items():
            if name == "pp2_resume":  # logs step 2 only
                continue
            hf = reference[name != "pp2_frozen"]
            comparisons.append(Comparison(f"{family}_{name}_step1_vs_hf", run["losses"][:1], hf[:1], BACKEND_VL))
            if name in FAMILY_RUNS["qwen3_vl"]:
                comparisons.append(Comparison(f"{family}_{name}_vs_hf", run["losses"], hf, BACKEND_VL_STEPS))
            if name.startswith("packed"):
                comparisons += [Comparison(f"{family}_{name}_step1_vs_standard_packed", run["losses"][:1],
                                           standard_packed[:1], BACKEND_VL),
                                Comparison(f"{family}_{name}_vs_standard_packed", run["losses"], standard_packed,
                                           BACKEND_VL_STEPS)]
        comparisons += [Comparison(f"{family}_{name}_vs_tp1", res[name]["losses"], res["tp1"]["losses"], VL_LAYOUT)
                        for name in res if name not in ("tp1", "pp2_resume", "pp2_frozen")]
        parts = ("tower", "merger", "deepstack") if family == "qwen3_vl" else ("tower", "merger")
        assert all(res[n][f"{part}_changed"] for n in ("tp1", "tp2_sp", "pp2") for part in parts), res
        assert not any(res["pp2_frozen"][f"{part}_changed"] for part in parts), res
        assert res["tp2_sp"]["sequence_parallel"] and not res["tp1"]["sequence_parallel"]
        assert res["tp2_sp"]["tower_recomputes"] and not res["tp1"]["tower_recomputes"]  # recompute: the same losses
        assert res["pp2_frozen"]["losses"][1] != res["pp2"]["losses"][1]  # the tower's update changed step 2
    res, qwen2_vl = results["qwen2_5_vl"], results["qwen2_vl"]["tp1"]
    comparisons.append(Comparison("qwen2_vl_step1_vs_hf", qwen2_vl["losses"][:1],
                                  [hf_loss(models["qwen2_vl"], rows["qwen2_vl"])], BACKEND_VL))
    assert_within(comparisons)
    assert qwen2_vl["tower_changed"] and qwen2_vl["losses"] != res["tp1"]["losses"]
    assert res["pp2_resume"]["losses"][-1] == res["pp2"]["losses"][-1]  # the tower came back from the checkpoint


def standard_packed_batch(model_dir: str, rows: list[dict]) -> dict:
    """The standard backend's batch of ``rows`` packed in pairs (rows 2i and 2i+1 in one row, as the worker packs
    them): roll's packing collator, the images concatenated in the packed order and ``PackedVisionBatch`` (HF's
    packed position_ids [4, b, s])."""
    from backends.standard.vision import PackedVisionBatch
    from roll.data.collators import SequenceCollator
    from roll.data.policy import PaddingPolicy
    from roll.hf_config import read_hf_config

    pairs = [(rows[i], rows[i + 1]) for i in range(0, len(rows) - 1, 2)]
    packed = [{"input_ids": a["input_ids"] + b["input_ids"], "labels": a["labels"] + b["labels"],
               "position_ids": list(range(len(a["input_ids"]))) + list(range(len(b["input_ids"]))),
               "images": a["images"] + b["images"]} for a, b in pairs]

    def collate(features: list[dict]) -> dict:
        batch = SequenceCollator(0, PaddingPolicy(packing=True))([{k: v for k, v in f.items() if k != "images"}
                                                                  for f in features])
        images = [image for f in features for image in f["images"]]
        return {**batch, "pixel_values": torch.cat([p for p, _ in images]),
                "image_grid_thw": torch.tensor([g for _, g in images])}

    return PackedVisionBatch(collate, read_hf_config(model_dir))(packed)
