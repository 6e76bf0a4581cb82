"""Checks roll-train runs before it trains (and before it launches any process): the mistakes that can be
found from files alone, in milliseconds, instead of N ranks later as a Megatron or safetensors traceback.

What is checked: output_dir (``roll.outputs``, ``roll.checkpoints.check_output_dir``; writable), nproc_per_node
against this machine (only when launching), the model directory (``roll.model_dir``: not an adapter directory,
config.json, remote code, weights files intact, tokenizer files), a DPO reference's vocabulary, the chat template stages sft/dpo
need, a resumed checkpoint against this run (backend, model, LoRA or full, global batch), the data files named
(they exist, of a type roll reads), every pickle that would be loaded (``roll.unpickle``), and last, the one check
that imports transformers (seconds): the model_type is one it knows. A typo is answered before that import.
Layout rules that need the model's config (heads / layers / experts divisible by TP / PP / EP) are part of
config validation (``RunConfig.validate``), so --print-config reports them too.
"""

from __future__ import annotations

import glob
import os

from roll.checkpoints import BATCH_RECORD, check_output_dir, resolve_resume, wants_resume
from roll.config.training import read_json_object
from roll.errors import ConfigError, ModelError
from roll.hf_config import has_hf_config, read_hf_config, text_config
from roll.model_dir import (DEMO_MODEL_DIR, DEMO_SFT_OUTPUT, TOKENIZER_FILES, check_model_dir,  # noqa: F401
                            check_model_dir_type, check_model_exists, check_model_paths, check_not_adapter,
                            check_reference_vocab,
                            check_remote_code, check_safetensors_file, check_tokenizer_files,
                            check_weight_files, weight_files)

ARCHITECTURE_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "intermediate_size", "vocab_size")
"""config.json keys a checkpoint and model_name_or_path must agree on (they fix the weight shapes)."""

_MCA_STATE = "trainer_state.json"
_MCA_CONFIG = "mca_config.json"
_ADAPTER_CONFIG = "adapter_config.json"


def check_before_training(config, *, launching: bool) -> None:
    """Every check of this module, cheapest first; ``launching``: this process starts the ranks."""
    training = config.training
    check_output_place(config)
    check_output_writable(training.output_dir)
    if launching:
        check_machine(training)
    model = config.model
    check_not_adapter(model.model_name_or_path)
    models = {"model_name_or_path": model.model_name_or_path}
    if model.tokenizer_name_or_path:
        check_model_exists(model.tokenizer_name_or_path, "tokenizer_name_or_path")
    if config.finetuning.stage in ("dpo", "kto") and config.finetuning.ref_model:
        models["ref_model"] = config.finetuning.ref_model
    for key, path in models.items():
        check_model_dir(path, trust_remote_code=model.trust_remote_code, use_mca=training.use_mca, key=key)
    check_reference_vocab(config)
    check_tokenizer_files(config.model)
    check_chat_template(config)
    check_resume(config)
    check_data_files(config)
    check_pickles(config)
    for path in models.values():  # last: transformers' list of model types costs seconds of imports
        check_model_dir_type(path, trust_remote_code=model.trust_remote_code, use_mca=training.use_mca)


# ---- output_dir ---------------------------------------------------------------------------------

def check_output_place(config) -> None:
    """output_dir is a place of its own (``roll.outputs``), holds no linked checkpoint, no trained model a
    fresh run would overwrite (``check_output_dir``) and no one else's files."""
    from roll import outputs

    training, model = config.training, config.model
    models = [path for path in (model.model_name_or_path, model.tokenizer_name_or_path,
                                config.finetuning.ref_model) if path]
    data = [part.strip() for spec in (config.data.dataset, config.data.eval_dataset)
            for part in (spec or "").split(",") if part.strip()]
    outputs.check_location(training.output_dir, model_dirs=models, data_paths=data)
    outputs.check_no_linked_checkpoints(training.output_dir)
    check_output_dir(training)
    if not (training.overwrite_output_dir or wants_resume(training.resume_from_checkpoint, training.output_dir)):
        outputs.check_contents(training.output_dir, outputs.run_identity(config))


# ---- output_dir ---------------------------------------------------------------------------------

def check_output_writable(output_dir: str) -> None:
    """output_dir is a directory this process can write, or can be created (nothing is created here)."""
    path = os.path.abspath(output_dir)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"output_dir={output_dir!r} is a file, not a directory: choose another output_dir.")
    parent = path
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(f"output_dir={output_dir!r} cannot be created: {parent!r} is a file. Choose "
                          "another output_dir.")
    if not os.access(parent, os.W_OK | os.X_OK):
        what = "is not writable" if parent == path else f"cannot be created ({parent!r} is not writable)"
        raise ConfigError(f"output_dir={output_dir!r} {what} by this user (or its file system is read-only): "
                          "choose an output_dir you can write.")


# ---- data ---------------------------------------------------------------------------------------

def check_data_files(config) -> None:
    """``dataset`` (and ``eval_dataset``) name files, directories or registered names that exist here, of a type
    roll reads (``roll.data.loading``'s own resolution, which the ranks run again), unless the run loads rows
    prepared before: then the raw files may stay on the machine that prepared them."""
    from roll.data.loading import resolve_source, split_sources
    from roll.data.prepared import has_data

    data = config.data
    if data.tokenized_path and has_data(data.tokenized_path) and not data.overwrite_cache:
        return
    specs = [data.dataset] + ([data.eval_dataset] if (data.eval_dataset or "").strip() else [])
    for spec in specs:
        for part in split_sources(spec):
            resolve_source(part, data.dataset_dir)


# ---- the machine --------------------------------------------------------------------------------

def check_machine(training) -> None:
    """nproc_per_node must not exceed this node's accelerators (or, without one, its CPU cores)."""
    from roll.platform import current_platform

    platform = current_platform()
    if platform.is_accelerator:
        import torch

        count = getattr(torch, platform.device_type).device_count()
        what = f"{count} {platform.device_type.upper()} device(s) visible"
    else:
        count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        what = f"{count} CPU core(s) and no GPU"
    if training.nproc_per_node > count:
        raise ConfigError(f"nproc_per_node={training.nproc_per_node} but this machine has {what}: one "
                          f"process per device. Set nproc_per_node to at most {count} (and the parallel "
                          "sizes to match).")


# ---- chat template ------------------------------------------------------------------------------

def check_chat_template(config) -> None:
    """sft, dpo, kto and rm lay conversations out with a chat template: the tokenizer's own, or ``template:``.

    The library (``roll.data.load_tokenizer``) falls back to roll's 'default' template with a warning;
    roll-train refuses instead, since a model trained on a template it will not be prompted with is wasted.
    """
    if config.finetuning.stage not in ("sft", "dpo", "kto", "rm") or config.data.template is not None:
        return
    path = config.model.tokenizer_name_or_path or config.model.model_name_or_path
    if not path or not os.path.isdir(path):
        return
    if os.path.isfile(os.path.join(path, "chat_template.jinja")) or os.path.isfile(
            os.path.join(path, "chat_template.json")):
        return
    tokenizer_config = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(tokenizer_config) and read_json_object(tokenizer_config, tokenizer_config,
                                                            ModelError).get("chat_template"):
        return
    from roll.data.named_templates import TEMPLATES

    stage, names = config.finetuning.stage, ", ".join(TEMPLATES)
    raise ConfigError(f"the tokenizer in {path!r} has no chat template, which stage {stage} needs to lay out "
                      f"conversations. Set template: to one of {names} (the one the model will be prompted "
                      "with), or use a tokenizer that has a chat template.")


# ---- pickles (roll.unpickle) --------------------------------------------------------------------

def check_pickles(config) -> None:
    """Every pickle-based file in the model folders and the resumed checkpoint loads under roll's allow-list
    (nothing in them runs), unless trust_checkpoint_pickles: refused here, once, naming the file, instead of
    on every rank (the loads themselves are restricted too: roll.unpickle and the compat modules)."""
    from roll import unpickle

    if config.model.trust_checkpoint_pickles:
        return
    training = config.training
    resume = resolve_resume(training.resume_from_checkpoint, training.output_dir)
    folders = [config.model.model_name_or_path, resume]
    if config.finetuning.stage in ("dpo", "kto"):
        folders.append(config.finetuning.ref_model)
    for folder in filter(None, folders):
        unpickle.check_folder(folder)


# ---- resuming -----------------------------------------------------------------------------------

def check_resume(config) -> None:
    """The checkpoint resume_from_checkpoint names fits this run: backend, model, LoRA/full, global batch."""
    training = config.training
    ckpt = resolve_resume(training.resume_from_checkpoint, training.output_dir)
    if ckpt is None:
        return
    is_mca_ckpt = os.path.isfile(os.path.join(ckpt, _MCA_CONFIG))
    if training.use_mca != is_mca_ckpt or not os.path.isfile(os.path.join(ckpt, _MCA_STATE)):
        written = "a --use-mca (Megatron) run" if is_mca_ckpt else "the standard backend"
        if not os.path.isfile(os.path.join(ckpt, _MCA_STATE)):
            written = "no roll run (it has no trainer_state.json)"
        raise ConfigError(f"resume_from_checkpoint={ckpt!r} was written by {written}; this run uses the "
                          f"{config.backend_name} backend. Resume with the backend that wrote it "
                          "(--use-mca or not), or start a fresh run without resume_from_checkpoint.")
    lora_ckpt = os.path.isfile(os.path.join(ckpt, _ADAPTER_CONFIG))
    lora_run = config.finetuning.finetuning_type == "lora"
    if lora_ckpt != lora_run:
        kind = "a LoRA adapter-only checkpoint" if lora_ckpt else "a full-model checkpoint"
        raise ConfigError(f"resume_from_checkpoint={ckpt!r} is {kind} but this run has finetuning_type="
                          f"{config.finetuning.finetuning_type}; resume with the finetuning_type it was "
                          "saved with.")
    _check_same_model(config, ckpt, is_mca_ckpt)
    state = read_json_object(os.path.join(ckpt, _MCA_STATE), f"{ckpt}/{_MCA_STATE}", ConfigError)
    _check_same_batch(config, ckpt, state, is_mca_ckpt)


def _check_same_model(config, ckpt: str, is_mca_ckpt: bool) -> None:
    model_dir = config.model.model_name_or_path
    if not has_hf_config(model_dir):
        return
    if is_mca_ckpt:
        mca_config = read_json_object(os.path.join(ckpt, _MCA_CONFIG), f"{ckpt}/{_MCA_CONFIG}")
        saved = mca_config.get("hf_config") or {}
    elif has_hf_config(ckpt):
        saved = read_hf_config(ckpt, f"{ckpt}/config.json", ConfigError)
    else:
        return  # a LoRA checkpoint of the standard backend holds adapters only
    saved, current = text_config(saved), text_config(read_hf_config(model_dir))
    differ = [f"{key} {saved.get(key)} there, {current.get(key)} here" for key in ARCHITECTURE_KEYS
              if key in saved and key in current and saved[key] != current[key]]
    if differ:
        raise ConfigError(f"resume_from_checkpoint={ckpt!r} is of another model than model_name_or_path="
                          f"{config.model.model_name_or_path!r} ({'; '.join(differ)}). Resume with the "
                          "model_name_or_path it was trained from, or start a fresh run.")


def _check_same_batch(config, ckpt: str, state: dict, is_mca_ckpt: bool) -> None:
    t = config.training
    if is_mca_ckpt:
        saved = state.get("global_batch_size")
        dp = config.layout.dp if config.layout is not None else t.world_size_from_launch
        now = t.per_device_train_batch_size * t.gradient_accumulation_steps * dp
        detail = (f"per_device_train_batch_size {t.per_device_train_batch_size} * "
                  f"gradient_accumulation_steps {t.gradient_accumulation_steps} * data-parallel size {dp}")
    elif os.path.isfile(os.path.join(ckpt, BATCH_RECORD)):  # what roll records next to HF's files
        record = read_json_object(os.path.join(ckpt, BATCH_RECORD), f"{ckpt}/{BATCH_RECORD}")
        saved = record.get("global_batch_size")
        world = t.world_size_from_launch
        now = t.per_device_train_batch_size * t.gradient_accumulation_steps * world
        detail = (f"per_device_train_batch_size {t.per_device_train_batch_size} * "
                  f"gradient_accumulation_steps {t.gradient_accumulation_steps} * {world} process(es)")
    else:
        # A checkpoint without roll's record: HF's trainer_state records the per-device batch, its
        # rng_state_R.pth files the world size (gradient_accumulation_steps is not known).
        ranks = len(glob.glob(os.path.join(ckpt, "rng_state_*.pth"))) or 1
        per_device = state.get("train_batch_size")
        saved = None if per_device is None else per_device * ranks
        now = t.per_device_train_batch_size * t.world_size_from_launch
        detail = (f"per_device_train_batch_size {t.per_device_train_batch_size} on "
                  f"{t.world_size_from_launch} process(es)")
    if saved is not None and saved != now:
        raise ConfigError(f"resume_from_checkpoint={ckpt!r} was trained with a global batch of {saved} "
                          f"samples per step (or micro-step), this run uses {now} ({detail}): the sample "
                          "order would not continue. Keep the batch sizes and the number of processes of the "
                          "run that wrote it, or start a fresh run.")
