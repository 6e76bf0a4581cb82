"""HF <-> Megatron conversion under real 2-process torchrun (gloo, fp32, CPU).

- logits parity through ``convert.check_parity`` (the ``roll-convert check`` path):
  at TP1 and at TP2, PP2, PP2 x VPP2 and EP2 (MoE), within the measured bounds (tests/bounds.py);
- a checkpoint saved at TP1 loads at TP2 and PP2 (and back) with equal logits;
- export Megatron -> HF is bit-exact and loads with ``AutoModelForCausalLM``;
- each rank reads only the safetensors files its layers need.

The tiny checkpoints get random values in every tensor (HF init leaves biases at 0 and norms at 1,
which would hide a wrong bias or norm mapping) and large enough weights that logits are O(1).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys

import pytest
import torch

from tests.bounds import CONVERT_PARALLEL, CONVERT_TP1, Comparison, assert_within
from tests.helpers import REPO, output_of, run, torchrun

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.distributed, pytest.mark.mca]

WORKER = os.path.join(REPO, "tests", "distributed", "_mca_workers", "convert_worker.py")


def _read_weights(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        out.update(load_file(path))
    return out


def randomized(src: str, dst: str, seed: int = 0, files: int = 1, vocab: int | None = None) -> str:
    """Copy of an HF model dir with every tensor redrawn (norms ~ 1 + noise), optionally split in
    files, optionally with the vocab cut to ``vocab`` rows (to need padding under TP)."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, t in sorted(_read_weights(src).items()):
        noise = torch.randn(t.shape, generator=gen)
        weights[name] = 1 + 0.1 * noise if "norm" in name else (0.5 if "embed" in name else 0.15) * noise
        if vocab and name in ("model.embed_tokens.weight", "lm_head.weight"):
            weights[name] = weights[name][:vocab].contiguous()
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if not name.endswith(".safetensors") and not name.endswith(".index.json"):
            shutil.copy2(os.path.join(src, name), dst)
    if vocab:
        config = json.loads(open(os.path.join(dst, "config.json"), encoding="utf-8").read())
        with open(os.path.join(dst, "config.json"), "w", encoding="utf-8") as fh:
            json.dump({**config, "vocab_size": vocab}, fh)
    if files == 1:
        save_file(weights, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
        return dst
    groups = _split_by_layer(list(weights), files)
    weight_map = {}
    for i, names in enumerate(groups, start=1):
        file = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: weights[n] for n in names}, os.path.join(dst, file), metadata={"format": "pt"})
        weight_map.update({n: file for n in names})
    with open(os.path.join(dst, "model.safetensors.index.json"), "w", encoding="utf-8") as fh:
        json.dump({"metadata": {}, "weight_map": weight_map}, fh)
    return dst


def _split_by_layer(names: list[str], files: int) -> list[list[str]]:
    """[embedding + layer 0], [layer 1], ..., [final norm + lm_head]: the layout pipeline stages want."""
    def key(name: str) -> int:
        if name.startswith("model.layers."):
            return int(name.split(".")[2])
        return -1 if "embed" in name else 10**6
    order = sorted({key(n) for n in names})
    bucket = {k: min(i * files // len(order), files - 1) for i, k in enumerate(order)}
    groups: list[list[str]] = [[] for _ in range(files)]
    for n in names:
        groups[bucket[key(n)]].append(n)
    return [g for g in groups if g]


def run_cases(cases: list[dict], tmp_path, timeout: float = 240) -> dict[str, dict[int, dict]]:
    """Run the cases in one torchrun; ``{case name: {rank: result}}``."""
    spec = tmp_path / f"cases_{cases[0]['name']}.json"
    spec.write_text(json.dumps(cases))
    out = tmp_path / f"results_{cases[0]['name']}"
    out.mkdir()
    proc = torchrun(WORKER, str(spec), str(out), timeout=timeout)
    assert proc.returncode == 0, output_of(proc)
    results: dict[str, dict[int, dict]] = {}
    for path in out.glob("*.json"):
        row = json.loads(path.read_text())
        results.setdefault(row["name"], {})[row["rank"]] = row
    assert {name: sorted(rows) for name, rows in results.items()} == {c["name"]: [0, 1] for c in cases}, \
        output_of(proc)
    return results


def dense_parity_runs(make_model, tmp_path) -> dict[str, dict[int, dict]]:
    """``roll-convert check`` on randomized Qwen2, Qwen3, Llama (odd vocabulary) and Llama-3 RoPE scaling at
    TP1, TP2, PP2 and PP2 x VPP2, in one torchrun job."""
    qwen2 = randomized(make_model("qwen2"), str(tmp_path / "qwen2"))  # tied, qkv bias
    qwen3 = randomized(make_model("qwen3", num_layers=4, tie_word_embeddings=False), str(tmp_path / "qwen3"))
    # vocab 509 is odd: TP2 pads the embedding/output layer to 510 rows, and parity must still hold
    llama = randomized(make_model("llama", tie_word_embeddings=False), str(tmp_path / "llama"), vocab=509)
    # Llama-3 RoPE scaling with factor 32 (Megatron's default would be 8); at 64 tokens dropping the
    # scaling changes logits by ~1, so parity proves the factor arrived
    from roll.demo.tiny_model import make_tiny_model

    rope = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    llama3 = randomized(make_tiny_model(str(tmp_path / "llama3_src"), kind="llama", rope_parameters=rope,
                                        max_position_embeddings=131072), str(tmp_path / "llama3"))
    cases = [dict(name="qwen2_tp1", kind="check", dir=qwen2),
             dict(name="llama3_rope_tp2", kind="check", dir=llama3, tp=2, seq_len=64),
             dict(name="qwen2_tp2", kind="check", dir=qwen2, tp=2),
             dict(name="qwen2_pp2", kind="check", dir=qwen2, pp=2),
             dict(name="qwen3_pp2_vpp2", kind="check", dir=qwen3, pp=2, vpp=2),
             dict(name="llama_tp2_padded_vocab", kind="check", dir=llama, tp=2)]
    return run_cases(cases, tmp_path)


def logit_comparisons(res: dict[str, dict[int, dict]]) -> list[Comparison]:
    """Max |HF logits - Megatron logits| of every check case (logits are O(1): absolute), at TP1 or not."""
    return [Comparison(name, [rows[0]["diff"]], [0.0], CONVERT_TP1 if name.endswith(("_tp1", "_ep1"))
                       else CONVERT_PARALLEL, scale=1.0) for name, rows in res.items() if "diff" in rows[0]]


def test_dense_logits_parity_tp1_tp2_pp2_vpp(tiny_model_factory, tmp_path):
    res = dense_parity_runs(tiny_model_factory, tmp_path)
    assert all(rows[0]["diff"] == rows[1]["diff"] for rows in res.values())  # all-reduced: one verdict
    assert_within(logit_comparisons(res))


def moe_parity_runs(make_model, tmp_path) -> tuple[dict[str, dict[int, dict]], str, str, str]:
    """``roll-convert check`` on randomized Qwen2-MoE and Qwen3-MoE at EP1, EP2, TP2 (experts split by TP) and
    TP2 x EP2 with SP, and a Megatron checkpoint at EP2 exported at EP2 and at TP2 x EP2, in one torchrun job;
    (results, the Qwen2-MoE HF dir, the EP2 export, the TP2 x EP2 export)."""
    qwen2_moe = randomized(make_model("qwen2_moe"), str(tmp_path / "qwen2_moe"))  # shared expert + gate
    qwen3_moe = randomized(make_model("qwen3_moe", tie_word_embeddings=False), str(tmp_path / "qwen3_moe"))
    mca, out_hf, out_sp = str(tmp_path / "mca_ep2"), str(tmp_path / "hf_ep2"), str(tmp_path / "hf_tp2_ep2")
    cases = [dict(name="qwen2_moe_ep1", kind="check", dir=qwen2_moe),
             dict(name="qwen2_moe_ep2", kind="check", dir=qwen2_moe, ep=2),
             dict(name="qwen3_moe_ep2", kind="check", dir=qwen3_moe, ep=2),
             dict(name="qwen3_moe_tp2_etp2", kind="check", dir=qwen3_moe, tp=2),  # experts split by TP too
             dict(name="qwen2_moe_tp2_ep2_sp", kind="check", dir=qwen2_moe, tp=2, ep=2, etp=1),  # SP forced on
             dict(name="to_mca_ep2", kind="hf2mca", dir=qwen2_moe, out=mca, ep=2),
             dict(name="to_hf_ep2", kind="mca2hf", dir=mca, out=out_hf, ep=2, max_shard_bytes=60_000),
             dict(name="to_hf_tp2_ep2", kind="mca2hf", dir=mca, out=out_sp, tp=2, ep=2, etp=1, max_shard_bytes=60_000)]
    return run_cases(cases, tmp_path), qwen2_moe, out_hf, out_sp


def test_moe_logits_parity_ep2_tp2_and_export(tiny_model_factory, tmp_path):
    res, qwen2_moe, out_hf, out_sp = moe_parity_runs(tiny_model_factory, tmp_path)
    _assert_exported_like(qwen2_moe, out_hf)  # experts gathered from both EP ranks, bit-exact
    _assert_exported_like(qwen2_moe, out_sp)  # + dense weights gathered over TP
    assert_within(logit_comparisons(res))


def test_checkpoint_reshards_and_exports_bit_exact(tiny_model_factory, tmp_path):
    """HF -> Megatron at TP1; load at TP2 and PP2 (equal logits); TP2 re-save -> TP1; TP2 -> HF export."""
    hf = randomized(tiny_model_factory("qwen2", tie_word_embeddings=False), str(tmp_path / "hf"))
    mca_tp1, mca_tp2, out_hf, out_pp2, cfg_only = (str(tmp_path / n) for n in
                                                   ("mca_tp1", "mca_tp2", "hf_out", "hf_out_pp2", "cfg_only"))
    logits = {n: str(tmp_path / f"{n}.pt") for n in ("hf_tp1", "tp1", "tp2", "pp2", "back_tp1", "cfg_only_tp2")}
    shutil.copytree(hf, cfg_only)  # + mca_config.json but no Megatron weights: AutoModel converts from HF
    from backends.mca.models.config import McaModelConfig

    with open(os.path.join(hf, "config.json"), encoding="utf-8") as fh:
        McaModelConfig.from_hf(json.load(fh)).save_pretrained(cfg_only)
    cases = [dict(name="hf_tp1", kind="logits", dir=hf, save_to=logits["hf_tp1"]),
             dict(name="to_mca", kind="hf2mca", dir=hf, out=mca_tp1),
             dict(name="tp1", kind="logits", dir=mca_tp1, save_to=logits["tp1"]),
             dict(name="tp2", kind="logits", dir=mca_tp1, tp=2, save_to=logits["tp2"], resave_to=mca_tp2),
             dict(name="pp2", kind="logits", dir=mca_tp1, pp=2, save_to=logits["pp2"]),
             dict(name="back_tp1", kind="logits", dir=mca_tp2, save_to=logits["back_tp1"]),
             dict(name="to_hf", kind="mca2hf", dir=mca_tp2, tp=2, out=out_hf, max_shard_bytes=60_000),
             dict(name="to_hf_pp2", kind="mca2hf", dir=mca_tp1, pp=2, out=out_pp2, max_shard_bytes=60_000),
             dict(name="cfg_only_tp2", kind="logits", dir=cfg_only, tp=2, save_to=logits["cfg_only_tp2"])]
    run_cases(cases, tmp_path)
    ref = torch.load(logits["hf_tp1"])
    assert ref.abs().max() > 1.0  # a meaningful tolerance needs O(1) logits
    assert torch.equal(torch.load(logits["tp1"]), ref)  # Megatron checkpoint == on-the-fly conversion
    for name in ("tp2", "pp2", "back_tp1", "cfg_only_tp2"):
        assert (torch.load(logits[name]) - ref).abs().max() <= CONVERT_PARALLEL.rel, name
    _assert_exported_like(hf, out_hf)
    _assert_exported_like(hf, out_pp2)


def _assert_exported_like(original: str, exported: str) -> None:
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(exported, "model-*.safetensors")))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors", files
    with open(os.path.join(exported, "model.safetensors.index.json"), encoding="utf-8") as fh:
        assert set(json.load(fh)["weight_map"].values()) == set(files)
    a, b = _read_weights(original), _read_weights(exported)
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[n], b[n]) for n in a), [n for n in a if not torch.equal(a[n], b[n])]
    with open(os.path.join(original, "config.json"), encoding="utf-8") as fa, \
            open(os.path.join(exported, "config.json"), encoding="utf-8") as fb:
        assert json.load(fa) == json.load(fb)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    assert torch.equal(model.model.embed_tokens.weight, a["model.embed_tokens.weight"])
    assert os.path.isfile(os.path.join(exported, "tokenizer.json"))


def test_each_pipeline_rank_reads_only_its_files(tiny_model_factory, tmp_path):
    hf = randomized(tiny_model_factory("llama", tie_word_embeddings=False), str(tmp_path / "sharded"), files=3)
    res = run_cases([dict(name="stream_pp2", kind="stream", dir=hf, pp=2)], tmp_path)["stream_pp2"]
    # files: [embed + layer 0], [layer 1], [norm + lm_head]
    assert res[0]["files_read"] == ["model-00001-of-00003.safetensors"]
    assert res[1]["files_read"] == ["model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors"]
    total = res[0]["tensors_in_checkpoint"]
    assert res[0]["tensors_read"] + res[1]["tensors_read"] == total and res[0]["tensors_read"] < total


def test_roll_convert_check_cli_passes_and_fails_on_tolerance(tiny_model_factory, tmp_path):
    model = randomized(tiny_model_factory("qwen3_moe"), str(tmp_path / "moe"))
    ok = run([sys.executable, "-m", "backends.mca.convert_cli", "check", "--input", model], timeout=180)
    assert ok.returncode == 0 and "max |HF - Megatron| logit difference" in ok.stdout, output_of(ok)
    bad = run([sys.executable, "-m", "backends.mca.convert_cli", "check", "--input", model, "--tolerance", "1e-12"],
              timeout=180)
    assert bad.returncode == 1 and "FAILED" in bad.stdout, output_of(bad)
    # A Megatron checkpoint has no HF model to compare with: a clear error before loading, not a traceback.
    mca = str(tmp_path / "moe_mca")
    to_mca = run([sys.executable, "-m", "backends.mca.convert_cli", "hf2mca", "--input", model, "--output", mca],
                 timeout=180)
    assert to_mca.returncode == 0, output_of(to_mca)
    wrong = run([sys.executable, "-m", "backends.mca.convert_cli", "check", "--input", mca], timeout=180)
    assert wrong.returncode == 2 and "has no HF config.json" in wrong.stderr, output_of(wrong)
    assert "Traceback" not in wrong.stderr, output_of(wrong)
