"""backends.standard.elastic: what a DeepSpeed checkpoint's files say about its layout, when a resume
converts it to DeepSpeed's universal checkpoint (only at another data-parallel size), and the layouts it
refuses (exit 2). The real conversion and load run in tests/distributed/test_elastic_resume_dist.py."""

from __future__ import annotations

import pytest

from backends.standard import elastic
from backends.standard.ds_config import load_deepspeed_config
from roll.errors import ConfigError


def _checkpoint(root, files: list[str], tag: str = "global_step2") -> str:
    ckpt = root / "checkpoint-2"
    (ckpt / tag).mkdir(parents=True)
    (ckpt / "latest").write_text(tag)
    for name in files:
        (ckpt / tag / name).write_bytes(b"")
    return str(ckpt)


ZERO2_DP2 = ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
             "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
ZERO3_DP2 = ["zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt",
             "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
             "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"]


def _ds(stage: int, **zero) -> object:
    return load_deepspeed_config({"zero_optimization": {"stage": stage, **zero}})


@pytest.mark.parametrize("files,family,dp", [(ZERO2_DP2, "1-2", 2), (ZERO3_DP2, "3", 2),
                                             (["mp_rank_00_model_states.pt"], "0", 1)])
def test_saved_layout_reads_the_zero_family_and_the_partition_count(tmp_path, files, family, dp):
    expected = elastic.SavedLayout("global_step2", family, dp)
    assert elastic.saved_layout(_checkpoint(tmp_path, files)) == expected


def test_saved_layout_is_none_without_deepspeed_files_and_refuses_a_latest_outside(tmp_path):
    (tmp_path / "plain").mkdir()
    assert elastic.saved_layout(str(tmp_path / "plain")) is None
    ckpt = _checkpoint(tmp_path, ZERO2_DP2)
    (tmp_path / "checkpoint-2" / "latest").write_text("../elsewhere")
    with pytest.raises(ConfigError, match="is not a folder of the checkpoint"):
        elastic.saved_layout(ckpt)


def test_converts_only_when_the_data_parallel_size_changed(tmp_path, monkeypatch):
    converted = []
    monkeypatch.setattr(elastic, "convert_to_universal", lambda ckpt, saved: converted.append((ckpt, saved)))
    ckpt, ds = _checkpoint(tmp_path, ZERO2_DP2), _ds(2)
    assert elastic.prepare_resume(ds, ckpt, world_size=2, is_writer=True) is ds
    assert converted == []
    resumed = elastic.prepare_resume(ds, ckpt, world_size=1, is_writer=True)
    assert resumed.config["checkpoint"] == {"load_universal": True} and "checkpoint" not in ds.config
    assert resumed.config["zero_optimization"] == ds.config["zero_optimization"]
    assert converted == [(ckpt, elastic.SavedLayout("global_step2", "1-2", 2))]
    elastic.prepare_resume(ds, ckpt, world_size=4, is_writer=False)  # not the writer: it only loads
    assert len(converted) == 1
    assert elastic.prepare_resume(None, None, world_size=1, is_writer=True) is None
    assert elastic.prepare_resume(ds, None, world_size=1, is_writer=True) is ds


@pytest.mark.parametrize("files,ds,world,message", [
    (ZERO2_DP2, None, 2, r"under DeepSpeed \(ZeRO stage 1-2.*Resume with a deepspeed config .*ds_z2.json"),
    (None, _ds(2), 1, "written without DeepSpeed .*Resume without the deepspeed key"),
    (ZERO2_DP2, _ds(3), 2, "written under ZeRO stage 1-2, .* has stage 3.*ds_z2.json"),
    (ZERO3_DP2, _ds(1), 2, "written under ZeRO stage 3, .* has stage 1.*ds_z3.json"),
    (ZERO2_DP2, _ds(2, offload_optimizer={"device": "nvme", "nvme_path": "/nvme"}), 1,
     "ZeRO state of 2 ranks, this run has 1: with offload_optimizer on NVMe.*Resume on 2 processes"),
])
def test_refuses_what_cannot_load(tmp_path, files, ds, world, message):
    if files is None:
        (tmp_path / "checkpoint-2").mkdir()
        ckpt = str(tmp_path / "checkpoint-2")
    else:
        ckpt = _checkpoint(tmp_path, files)
    with pytest.raises(ConfigError, match=message):
        elastic.prepare_resume(ds, ckpt, world_size=world, is_writer=True)


def test_a_checkpoint_it_cannot_write_converts_only_if_converted_before(tmp_path, monkeypatch):
    monkeypatch.setattr(elastic, "_writable", lambda folder: False)
    monkeypatch.setattr(elastic, "convert_to_universal", lambda ckpt, saved: None)
    ckpt = _checkpoint(tmp_path, ZERO2_DP2)
    assert elastic.prepare_resume(_ds(2), ckpt, world_size=2, is_writer=True).config == _ds(2).config
    with pytest.raises(ConfigError, match="which this run cannot write. Copy the checkpoint into output_dir"):
        elastic.prepare_resume(_ds(2), ckpt, world_size=1, is_writer=True)
    (tmp_path / "checkpoint-2" / "latest_universal").write_text("global_step2_universal")
    assert elastic.prepare_resume(_ds(2), ckpt, world_size=1, is_writer=True).config["checkpoint"]


def test_nvme_offload_at_the_saved_size_and_stages_1_and_2_load_each_other(tmp_path):
    ckpt = _checkpoint(tmp_path, ZERO2_DP2)
    nvme = _ds(2, offload_optimizer={"device": "nvme", "nvme_path": "/nvme"})
    assert elastic.prepare_resume(nvme, ckpt, world_size=2, is_writer=True) is nvme
    assert elastic.prepare_resume(_ds(1), ckpt, world_size=2, is_writer=True).zero_stage == 1


def test_w9_deepspeeds_own_torch_loads_go_through_the_allow_list(tmp_path):
    """The conversion (ds_to_universal) and the universal load call ``torch.load(weights_only=False)``:
    inside ``restricted_torch_loads`` a payload is refused before it runs; plain states load; afterwards
    ``torch.load`` is torch's again."""
    import os

    import torch

    from backends.standard import _compat
    from roll import unpickle
    from tests.reliability import payloads

    planted, marker = str(tmp_path / "optim_states.pt"), str(tmp_path / "ran")
    plain = str(tmp_path / "fp32.pt")
    payloads.plant_torch(planted, marker)
    torch.save({"param": torch.ones(2), "cat_dim": 0}, plain)
    original = torch.load
    with _compat.restricted_torch_loads():
        with pytest.raises(unpickle.UntrustedPickle, match="names io.open"):
            torch.load(planted, map_location="cpu", weights_only=False)
        assert torch.equal(torch.load(plain, weights_only=False)["param"], torch.ones(2))
    assert not os.path.exists(marker) and torch.load is original
