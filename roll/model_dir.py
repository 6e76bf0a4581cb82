"""Checks of a model directory from its files alone (``roll.preflight`` runs them before training; the
backends' loaders and roll-convert call some of them too): it exists on this machine (roll never downloads:
a Hub id or the demo's unbuilt model gets a message saying how to get it), it is a model and not an adapter,
its config.json, remote code, weight files and tokenizer files, and a DPO reference's vocabulary.
"""

from __future__ import annotations

import glob
import json
import os
import struct

from roll.config.training import read_json_object
from roll.errors import ConfigError, ModelError
from roll.hf_config import has_hf_config, read_hf_config, text_config

_MCA_CONFIG = "mca_config.json"
_ADAPTER_CONFIG = "adapter_config.json"


def check_model_dir(path: str | None, *, trust_remote_code: bool, use_mca: bool,
                    key: str = "model_name_or_path") -> None:
    """A local model directory (the value of ``key``) is complete and loadable without surprises, but for the one
    check that imports transformers (seconds: is config.json's model_type one it knows): ``check_model_dir_type``,
    which the caller runs after its other cheap checks."""
    check_model_exists(path, key)
    if not os.path.isdir(path):
        raise ModelError(f"{key}={path!r} is a file; give the directory that holds config.json.")
    if use_mca and os.path.isfile(os.path.join(path, _MCA_CONFIG)):
        return  # a roll Megatron checkpoint: its own loader checks it
    if not has_hf_config(path):
        raise ModelError(f"{key}={path!r} has no config.json: it is not a Hugging Face model "
                         "directory (a run's checkpoint-N is resumed with resume_from_checkpoint).")
    hf_config, where = read_hf_config(path), os.path.join(path, "config.json")
    check_auto_map(hf_config, where, trust_remote_code=trust_remote_code)
    check_weight_files(path, use_mca=use_mca, key=key)


def check_model_dir_type(path: str, *, trust_remote_code: bool, use_mca: bool) -> None:
    """``check_model_type`` of a directory ``check_model_dir`` passed."""
    if use_mca and os.path.isfile(os.path.join(path, _MCA_CONFIG)):
        return
    check_model_type(read_hf_config(path), os.path.join(path, "config.json"), trust_remote_code=trust_remote_code)


DEMO_MODEL_DIR = ".demo/tiny-qwen2"
"""Where the demo recipes expect the tiny model (``python scripts/make_tiny_model.py --out`` it)."""

DEMO_SFT_OUTPUT = "outputs/demo/tiny_sft/standard"
"""The tiny sft model ``make demo`` trains on the standard backend (recipes/demo/quick_sft.yaml; tiny_dpo, tiny_kto and
tiny_rm start from it)."""


def check_model_paths(config) -> None:
    """The model, tokenizer and (dpo) reference directories the run names exist on this machine: the
    check for commands that load only part of a model (--dry-run, roll-parity before its runs)."""
    model, finetuning = config.model, config.finetuning
    check_model_exists(model.model_name_or_path, "model_name_or_path")
    if model.tokenizer_name_or_path:
        check_model_exists(model.tokenizer_name_or_path, "tokenizer_name_or_path")
    if finetuning.stage in ("dpo", "kto") and finetuning.ref_model:
        check_model_exists(finetuning.ref_model, "ref_model")


def check_model_exists(path: str | None, key: str = "model_name_or_path") -> None:
    """ModelError saying how to get the model when ``path`` (the value of ``key``) is not on this machine.

    roll reads models from local directories and never downloads one: a Hub id (``Qwen/Qwen2.5-7B``) in a
    recipe names the model to fetch, and without this check transformers would try the Hub and answer with
    a network or repo-id error.
    """
    if not path:
        raise ConfigError(f"{key} is not set: point it at a Hugging Face model directory (config.json + "
                          "safetensors), in the recipe or as key=value on the command line.")
    if os.path.exists(path):
        return
    where = os.path.normpath(path)
    if where == os.path.normpath(DEMO_SFT_OUTPUT):
        raise ModelError(f"{key}={path!r} does not exist yet: it is the tiny sft model `make demo` trains "
                         "(recipes/demo/quick_sft.yaml on the standard backend). Run `make demo` (or `python "
                         "scripts/demo.py`) first, or point it at another model directory.")
    if where.split(os.sep)[0] == os.path.normpath(DEMO_MODEL_DIR).split(os.sep)[0]:
        also = "; `make tiny-model` and `make demo` build it too" if where == os.path.normpath(DEMO_MODEL_DIR) else ""
        raise ModelError(f"{key}={path!r} does not exist yet: it is the demo's tiny model. Build it with "
                         f"`python scripts/make_tiny_model.py --out {path}` (seconds, no download{also}), then "
                         "run this command again.")
    if _looks_like_hub_id(path):
        use = f"pass {key} DIR" if key.startswith("-") else f"set {key}=DIR in the recipe or on the command line"
        raise ModelError(f"{key}={path!r} is not a directory on this machine, and roll never downloads a "
                         "model. If it is a Hub id, on a machine with network run `huggingface-cli download "
                         f"{path} --local-dir DIR` (copy DIR here if needed), then {use}.")
    what = "the tokenizer files" if key.startswith("tokenizer") else "config.json + safetensors"
    raise ModelError(f"{key}={path!r} does not exist. Point it at a local Hugging Face model directory "
                     f"({what}); `python scripts/make_tiny_model.py --out DIR` builds a tiny one to try "
                     "roll with.")


def _looks_like_hub_id(path: str) -> bool:
    """``org/name`` as the Hub spells it: one slash, neither part empty nor a relative-path marker."""
    parts = path.split("/")
    return len(parts) == 2 and all(parts) and not path.startswith((".", "~")) and ".." not in parts


def check_not_adapter(path: str | None, *, key: str = "model_name_or_path") -> None:
    """A PEFT adapter directory (adapter_config.json, adapter weights only) given as the model."""
    if not path or not os.path.isfile(os.path.join(path, _ADAPTER_CONFIG)):
        return
    names = map(os.path.basename, weight_files(path))
    full = [name for name in names if not name.startswith("adapter_model")]
    if full or glob.glob(os.path.join(path, "pytorch_model*.bin")):
        return  # full weights next to an adapter: a model
    adapter_config = os.path.join(path, _ADAPTER_CONFIG)
    base = read_json_object(adapter_config, adapter_config, ModelError).get("base_model_name_or_path")
    raise ModelError(f"{key}={path!r} is a LoRA adapter directory (adapter_config.json and adapter weights "
                     f"only), not a model: set {key} to the base model it was trained from ({base!r} "
                     "according to adapter_config.json). To train a model with the adapter merged in, use the "
                     "full model a LoRA run writes with export_merged: true (OUTPUT_DIR/merged).")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model",
                   "vocab.txt")
"""Any of these makes a directory a tokenizer transformers can load."""


def check_tokenizer_files(model) -> None:
    """The tokenizer directory (tokenizer_name_or_path, else the model's) holds tokenizer files."""
    key = "tokenizer_name_or_path" if model.tokenizer_name_or_path else "model_name_or_path"
    path = model.tokenizer_name_or_path or model.model_name_or_path
    if not path or not os.path.isdir(path):
        return
    if any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        return
    raise ModelError(f"{key}={path!r} has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}): copy them "
                     "from the model's original directory, or set tokenizer_name_or_path to the directory of the "
                     "tokenizer the model was trained with.")


def check_reference_vocab(config) -> None:
    """DPO and KTO compare the policy's and the reference's log-probabilities of the same token ids."""
    ref = config.finetuning.ref_model
    if config.finetuning.stage not in ("dpo", "kto") or not ref or config.finetuning.ref_free:
        return
    policy = config.model.model_name_or_path
    sizes = []
    for path in (policy, ref):
        if not has_hf_config(path):
            return
        sizes.append(text_config(read_hf_config(path)).get("vocab_size"))
    if None not in sizes and sizes[0] != sizes[1]:
        raise ConfigError(f"ref_model={ref!r} has vocab_size {sizes[1]}, model_name_or_path={policy!r} has "
                          f"{sizes[0]}: {config.finetuning.stage.upper()} compares both models' probabilities of the same token ids, so "
                          "the reference must share the policy's vocabulary. Set ref_model to the model the "
                          "policy starts from (or leave it unset: a frozen copy of the policy).")


def check_remote_code(hf_config: dict, where: str, *, trust_remote_code: bool) -> None:
    """A config that needs the model's own Python code (``auto_map``, or a model_type transformers lacks)."""
    check_auto_map(hf_config, where, trust_remote_code=trust_remote_code)
    check_model_type(hf_config, where, trust_remote_code=trust_remote_code)


def check_auto_map(hf_config: dict, where: str, *, trust_remote_code: bool) -> None:
    """A config whose ``auto_map`` names the model's own Python code, unless trust_remote_code."""
    if hf_config.get("auto_map") and not trust_remote_code:
        names = sorted(hf_config["auto_map"])
        raise ModelError(f"{where} ships its own Python code (auto_map: {names}), which roll does "
                         "not run by default: set trust_remote_code: true if you trust this code.")


def check_model_type(hf_config: dict, where: str, *, trust_remote_code: bool) -> None:
    """A config without ``auto_map`` whose model_type the installed transformers does not know (this imports
    transformers and torch: seconds)."""
    if hf_config.get("auto_map"):
        return  # the model's own code defines it (check_auto_map)
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    model_type = hf_config.get("model_type")
    if model_type not in CONFIG_MAPPING_NAMES:
        remote = "" if trust_remote_code else (
            ", or, for a model that ships its code (auto_map in config.json), set trust_remote_code: true if "
            "you trust this code")
        raise ModelError(f"{where}: model_type {model_type!r} is an architecture transformers "
                         f"{transformers.__version__} does not know (architectures "
                         f"{hf_config.get('architectures')}). Use a supported model or a newer "
                         f"transformers{remote}.")


def weight_files(model_dir: str) -> list[str]:
    """The safetensors files of a model directory (those its index names, else every *.safetensors)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = read_json_object(index, index, ModelError).get("weight_map") or {}
        return [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
    return sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))


def check_weight_files(model_dir: str, *, use_mca: bool, key: str = "model_name_or_path") -> None:
    """Weights exist and every safetensors file is as long as its header says (a copy cut short is the
    common case); pickled ``*.bin`` weights only on the standard backend, which loads them weights_only."""
    files = weight_files(model_dir)
    if not files:
        has_bin = bool(glob.glob(os.path.join(model_dir, "pytorch_model*.bin")))
        if has_bin and not use_mca:
            return  # transformers loads these with torch.load(weights_only=True)
        detail = ("has only pickled .bin weights, which the mca backend does not read" if has_bin
                  else "has no model.safetensors")
        raise ModelError(f"{key}={model_dir!r} {detail}: re-save the model with "
                         "save_pretrained(DIR, safe_serialization=True) or point at a complete model "
                         "directory.")
    for path in files:
        check_safetensors_file(path)


def check_safetensors_file(path: str) -> None:
    """ModelError when ``path`` is missing, not safetensors, or shorter than its header describes."""
    if not os.path.isfile(path):
        raise ModelError(f"{path} is missing (model.safetensors.index.json names it): copy the whole model "
                         "again.")
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        head = fh.read(8)
        header_len = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < header_len <= size - 8:
            raise ModelError(f"{path} is not a safetensors file or is truncated ({size} bytes): copy the "
                             "model again or re-save it with save_pretrained(DIR, safe_serialization=True).")
        try:
            header = json.loads(fh.read(header_len))
        except ValueError:
            raise ModelError(f"{path} has a corrupt safetensors header: copy the model again.") from None
    end = max((entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"),
              default=0)
    expected = 8 + header_len + end
    if size < expected:
        raise ModelError(f"{path} is truncated: {size} bytes, its header describes {expected}. Copy the "
                         "model again (an interrupted download or copy leaves such a file).")
