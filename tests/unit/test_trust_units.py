"""roll.unpickle and roll.redact in-process: what the allow-list lets through, what it refuses and how it says
so, and which keys count as secrets (tests/reliability/test_trust.py runs the same through roll-train)."""

from __future__ import annotations

import collections
import datetime
import os
import pickle

import pytest
import torch

from roll import redact, unpickle
from tests.reliability import payloads


@pytest.fixture
def untrusted():
    unpickle.set_trusted(False)
    yield
    unpickle.set_trusted(False)


def test_tensors_and_plain_data_load(tmp_path, untrusted):
    path = str(tmp_path / "state.pt")
    state = {"w": torch.arange(4.0), "steps": [1, 2], "name": "adam", "groups": collections.OrderedDict(a=1)}
    torch.save(state, path)
    loaded = unpickle.torch_load(path)
    assert torch.equal(loaded["w"], state["w"]) and loaded["steps"] == [1, 2] and loaded["groups"] == {"a": 1}
    unpickle.check_folder(str(tmp_path))


@pytest.mark.parametrize("kind", ["torch", "pickle"])
def test_a_payload_is_refused_naming_the_file_and_what_it_calls(tmp_path, untrusted, kind):
    name = "state.pt" if kind == "torch" else ".metadata"
    path, marker = str(tmp_path / name), str(tmp_path / "ran")
    (payloads.plant_torch if kind == "torch" else payloads.plant_pickle)(path, marker)
    with pytest.raises(unpickle.UntrustedPickle) as refused:
        unpickle.check_folder(str(tmp_path))
    message = str(refused.value)
    assert message.startswith(f"refusing to load {path}: it is a pickle that names io.open"), message
    assert "trust_checkpoint_pickles: true" in message and "\n" not in message
    assert not os.path.exists(marker)


def test_the_opt_in_loads_what_the_allow_list_refuses(tmp_path, untrusted):
    path = str(tmp_path / "state.pt")
    torch.save({"saved_on": datetime.date(2026, 1, 1)}, path)
    with pytest.raises(unpickle.UntrustedPickle, match="names datetime.date"):
        unpickle.torch_load(path)
    unpickle.set_trusted(True)
    assert unpickle.torch_load(path) == {"saved_on": datetime.date(2026, 1, 1)}
    unpickle.check_folder(str(tmp_path))  # nothing to refuse once trusted


def test_a_damaged_file_is_named_not_trusted_or_refused(tmp_path, untrusted):
    path = tmp_path / "common.pt"
    path.write_bytes(b"not a pickle at all")
    with pytest.raises(unpickle.UntrustedPickle, match=r"cannot read .*common.pt: .*copy it again"):
        unpickle.check_folder(str(tmp_path))


def test_distributed_checkpoint_metadata_loads_through_the_restricted_unpickler(tmp_path, untrusted):
    """A real DCP ``.metadata`` (protocol 4+, dataclasses, enums, dtypes) round-trips; a relative refusal is
    re-anchored under its checkpoint directory."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(2, 3), "extra": b"bytes"}, checkpoint_id=str(tmp_path), no_dist=True)
    with open(tmp_path / ".metadata", "rb") as fh:
        metadata = unpickle.load_pickle(fh, str(tmp_path / ".metadata"))
    assert metadata.state_dict_metadata["w"].size == torch.Size([2, 3])
    refusal = unpickle.refusal("__0_0.distcp (entry extra)", pickle.UnpicklingError("GLOBAL os.system"))
    anchored = str(refusal.within(str(tmp_path)))
    assert anchored.startswith(f"refusing to load {tmp_path}/__0_0.distcp (entry extra)"), anchored


def test_training_args_bin_is_never_read(tmp_path):
    (tmp_path / "training_args.bin").write_bytes(b"anything")
    (tmp_path / "rng").mkdir()
    torch.save({}, tmp_path / "rng" / "rank_0.pt")
    assert unpickle.pickle_files(str(tmp_path)) == [str(tmp_path / "rng" / "rank_0.pt")]


@pytest.mark.parametrize("key, secret", [
    ("hub_token", True), ("token", True), ("wandb_api_key", True), ("db_password", True),
    ("client_secret", True), ("--hub-token", True), ("tokenizer_name_or_path", False),
    ("calculate_per_token_loss", False), ("moe_token_dispatcher_type", False), ("hub_model_id", False)])
def test_which_keys_are_secret(key, secret):
    assert redact.is_secret(key) is secret


def test_secret_arguments_leave_the_command_line(monkeypatch):
    value = "hf_abc123"
    argv = ["recipe.yaml", f"hub_token={value}", "--hub_token", value, "--lr", "1", f"--api_key={value}"]
    public, secret = redact.split_secrets(argv)
    assert public == ["recipe.yaml", "--lr", "1"]
    assert secret == [f"hub_token={value}"] * 2 + [f"api_key={value}"]
    assert value not in " ".join(redact.redact_argv(argv))
    assert redact.redact({"a": {"hub_token": value, "x": [{"password": "p"}]}, "token": None}) == {
        "a": {"hub_token": redact.REDACTED, "x": [{"password": redact.REDACTED}]}, "token": None}
    monkeypatch.setenv(redact.SECRETS_ENV, '["hub_token=hf_abc123"]')
    monkeypatch.delenv("ROLL_LAUNCHED", raising=False)
    assert redact.inherited_secrets() == []  # only a rank roll-train's launcher started reads them
    monkeypatch.setenv("ROLL_LAUNCHED", "1")
    assert redact.inherited_secrets() == ["hub_token=hf_abc123"]


def test_print_config_redacts_secrets(capsys):
    from roll.cli import main

    assert main(["stage=sft", "hub_token=hf_abc123", "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert "hf_abc123" not in printed and f"hub_token: {redact.REDACTED}" in printed


_DEEPSPEED_LAZILY = """
import io, sys
import torch
from roll import unpickle
torch.save({"w": torch.ones(1)}, sys.argv[1] + "/plain.pt")
unpickle.torch_load(sys.argv[1] + "/plain.pt")
assert "deepspeed" not in sys.modules, "reading a plain file imported DeepSpeed"
with open(sys.argv[1] + "/zero.pt", "rb") as fh:
    buffer = io.BytesIO(fh.read())
print(unpickle.torch_load(buffer, path="zero.pt")["stage"])
"""


def test_deepspeed_classes_are_allowed_only_when_a_file_names_them(tmp_path):
    """DeepSpeed is imported (3 s) for a file that names its classes, read again from the same buffer, and
    not for a Megatron or HF file that does not."""
    import subprocess
    import sys

    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.config import ZeroStageEnum

    torch.save({"stage": ZeroStageEnum(2)}, str(tmp_path / "zero.pt"))
    proc = subprocess.run([sys.executable, "-c", _DEEPSPEED_LAZILY, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0 and proc.stdout.strip() == "ZeroStageEnum.gradients", proc.stderr[-2000:]
