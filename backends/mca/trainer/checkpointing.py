"""``OUTPUT_DIR/checkpoint-N``: everything a Megatron run needs to continue as if never stopped.

A checkpoint holds, in one directory:

- model and optimizer state in Megatron's distributed format (every rank writes its shards). The
  optimizer is always saved ``fully_reshardable``, so a run can resume at another TP/PP/DP layout;
- ``trainer_state.json``: steps done, samples consumed, skipped steps, global batch size, layout;
- ``roll_resume.json``: the same position and the training set's fingerprint (``roll.resume_record``);
- ``rng/rank_R.pt``: each rank's Python / NumPy / torch / accelerator generators and Megatron's
  model-parallel RNG tracker, restored only when resuming at the same layout;
- ``mca_config.json``: the model config, so the directory also loads as a Megatron model (a full run);
- LoRA runs save only the adapters (and their optimizer state) and an ``adapter_config.json`` that marks
  the checkpoint as adapter-only; the base weights come from ``model_name_or_path`` again on resume.

The learning-rate schedule is a function of the step count (``optim.LRSchedule``), so the trainer
state restores it. Writes go to ``checkpoint-N.tmp``, are flushed to disk by every rank and renamed into
place by rank 0 after all finished (``roll.checkpoints.publishing``), so ``checkpoint-N`` always names a
complete checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import random
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from backends.mca.checkpoint import load_sharded, sharded_model_state_dict
from backends.mca.checkpoint_background import background_save_strategy
from backends.mca.checkpoint_io import in_process_save_strategy
from backends.mca.models.config import MCA_CONFIG_NAME
from backends.mca.models.unwrap import unwrap_model
from backends.mca.trainer.optim import use_fast_adam
from roll import background_save, checkpoints, redact, resume_record, unpickle
from roll.errors import ConfigError, ModelError
from roll.logging import log_rank0

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


@dataclass
class TrainerState:
    """The loop's position; saved as JSON next to the weights."""

    global_step: int = 0
    consumed_samples: int = 0
    skipped_steps: int = 0
    global_batch_size: int = 0
    layout: dict = field(default_factory=dict)
    """tp/pp/vpp/cp/ep/etp/dp of the run that wrote it (RNG states only fit the same layout)."""
    distributed_optimizer: bool = False
    """The optimizer's checkpoint format differs with use_distributed_optimizer."""
    lora: bool = False
    """Adapter-only checkpoint (the base weights come from model_name_or_path)."""


def save(output_dir: str, chunks: list[torch.nn.Module], optimizer, state: TrainerState, model_config,
         keep: int | None = None, arguments: dict | None = None, dataset=None,
         background: AsyncSaves | None = None) -> str:
    """Write ``output_dir/checkpoint-<step>`` (collective); delete the oldest beyond ``keep``.
    ``arguments``: the run's, written as training_args.json with secrets redacted (``roll.redact``);
    ``dataset``: the training set, recorded with the position for the resume check (``roll.resume_record``).
    ``background`` (``save_async``): the weights and optimizer state are written by a thread while training goes
    on (``checkpoint_background``; on a CPU run from the live tensors, which ``background.fence`` guards), and
    the checkpoint is published by ``background.poll`` / ``wait`` once every rank's writer finished; the
    returned path exists from then on."""
    from megatron.core import dist_checkpointing

    start = time.perf_counter()
    is_writer = dist.get_rank() == 0
    sharded = _sharded_state(chunks, optimizer, state.lora, is_loading=False)
    if background is None:
        with checkpoints.publishing(output_dir, state.global_step, is_writer=is_writer, keep=keep) as tmp:
            # in this process (no spawned manager, no forked writers), the files past the page cache
            dist_checkpointing.save(sharded, tmp, sharded_strategy=in_process_save_strategy(direct=True))
            _write_small_files(tmp, chunks, state, model_config, arguments, dataset)
        final = os.path.join(output_dir, f"{checkpoints.PREFIX}{state.global_step}")
        log_rank0(logger, "saved checkpoint %s in %.1fs", final, time.perf_counter() - start)
        return final
    background.wait()  # one save at a time
    tmp = checkpoints.open_staging(output_dir, state.global_step, is_writer=is_writer)
    strategy = background_save_strategy()
    request = dist_checkpointing.save(sharded, tmp, sharded_strategy=strategy, async_sharded_save=True)
    _write_small_files(tmp, chunks, state, model_config, arguments, dataset)
    final = background.schedule(request, output_dir, state.global_step, keep=keep, started=start,
                                live=strategy.live)
    log_rank0(logger, "writing checkpoint %s in the background (training waited %.1fs)", final,
              time.perf_counter() - start)
    return final


def _write_small_files(tmp: str, chunks, state: TrainerState, model_config, arguments: dict | None,
                       dataset) -> None:
    """Everything of a checkpoint but the sharded weights and optimizer state: RNG (each rank), and on rank 0
    the trainer state, model config, arguments, resume record and (LoRA) adapter config."""
    os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
    torch.save(_rng_state(), os.path.join(tmp, "rng", f"rank_{dist.get_rank()}.pt"))
    if dist.get_rank() != 0:
        return
    with open(os.path.join(tmp, STATE_FILE), "w", encoding="utf-8") as fh:
        json.dump(dataclasses.asdict(state), fh, indent=2)
    model_config.save_pretrained(tmp)
    if arguments is not None:
        redact.save_arguments(arguments, tmp)
    if dataset is not None:
        resume_record.write(tmp, dataset, dataset_spec=(arguments or {}).get("data", {}).get("dataset"),
                            global_step=state.global_step, global_batch_size=state.global_batch_size,
                            skipped_steps=state.skipped_steps, consumed=state.consumed_samples)
    if state.lora:
        _write_adapter_config(chunks, tmp)


class AsyncSaves:
    """``save_async`` on the mca backend: each save's ``AsyncRequest`` (``checkpoint_background``) is written by a
    thread (``roll.background_save.BackgroundSaves``) and, once every rank's writer finished, finalized on the main
    thread: Megatron's metadata, then roll's publish (``roll.checkpoints.complete``). At most one save is pending;
    ``fence`` before every optimizer step (the writer may read the live weights and optimizer state)."""

    def __init__(self) -> None:
        self._saves = background_save.BackgroundSaves()

    def schedule(self, request, output_dir: str, step: int, keep: int | None, started: float, live: bool) -> str:
        """Start writing ``request`` (``dist_checkpointing.save(..., async_sharded_save=True)``'s); returns the path
        the checkpoint will have once published."""
        tmp = os.path.join(output_dir, f"{checkpoints.PREFIX}{step}.tmp")
        writes = [] if request.async_fn is None else [functools.partial(request.async_fn, *request.async_fn_args)]

        def finalize() -> None:
            for fn in request.finalize_fns:
                fn()
            checkpoints.fsync_tree(tmp)  # the metadata Megatron's finalize wrote

        self._saves.start(output_dir, step, writes, is_writer=dist.get_rank() == 0, keep=keep, started=started,
                          live=live, finalize=finalize)
        return os.path.join(output_dir, f"{checkpoints.PREFIX}{step}")

    def fence(self) -> None:
        """Before the optimizer changes the weights and its state in place: wait while the writer reads them."""
        self._saves.fence()

    def poll(self) -> None:
        """Collective, after every step: publish the pending checkpoint if every rank's writer finished."""
        self._saves.poll()

    def wait(self) -> None:
        """Collective: finish and publish the pending checkpoint (before a save, the export, the end)."""
        self._saves.wait()


def load(ckpt_dir: str, chunks: list[torch.nn.Module], optimizer, expected: TrainerState) -> TrainerState:
    """Restore model, optimizer, trainer state (and RNG at the same layout) from ``ckpt_dir``.

    ``expected`` is this run's fresh state: its batch size and optimizer kind must match the checkpoint's.
    """
    state_file = os.path.join(ckpt_dir, STATE_FILE)
    if not (os.path.isfile(state_file) and os.path.isfile(os.path.join(ckpt_dir, MCA_CONFIG_NAME))):
        raise ConfigError(f"{ckpt_dir} is not a checkpoint of a Megatron (--use-mca) run (it lacks {STATE_FILE} or "
                          f"{MCA_CONFIG_NAME}). Point resume_from_checkpoint at an OUTPUT_DIR/checkpoint-N written "
                          "with --use-mca.")
    with open(state_file, encoding="utf-8") as fh:
        state = TrainerState(**json.load(fh))
    if state.global_batch_size != expected.global_batch_size:
        raise ConfigError(f"{ckpt_dir} was trained with a global batch of {state.global_batch_size} samples, this run "
                          f"uses {expected.global_batch_size} (per_device_train_batch_size * gradient_accumulation_steps"
                          " * data-parallel size); the sample order would not continue. Keep the global batch size.")
    if state.lora != expected.lora:
        kinds = {True: "a LoRA adapter-only checkpoint", False: "a full-model checkpoint"}
        raise ConfigError(f"{ckpt_dir} is {kinds[state.lora]} but this run has finetuning_type="
                          f"{'lora' if expected.lora else 'full'}; resume with the finetuning_type it was saved with.")
    if state.distributed_optimizer != expected.distributed_optimizer:
        raise ConfigError(f"{ckpt_dir} was saved with use_distributed_optimizer={state.distributed_optimizer}; resume "
                          f"with the same setting (the optimizer state is stored differently).")
    start = time.perf_counter()
    # Every step so far skipped (non-finite): the optimizer never stepped, so the checkpoint holds no Adam
    # state, and the uninterrupted run's optimizer would be as fresh as this one's.
    updated = state.global_step > state.skipped_steps
    sharded = _sharded_state(chunks, optimizer if updated else None, state.lora, is_loading=True)
    # Straight into the model's parameters (or adapters) and the optimizer's state tensors, one positioned read
    # each at the saved layout (``load_sharded``), not PyTorch's three copies and Megatron's gate/up concatenations.
    loaded, nbytes = load_sharded(sharded, ckpt_dir, "checkpoint" if updated else "checkpoint weights")
    for key, chunk in zip([key for key in sharded if key != "optimizer"], chunks):
        # unwrapped: Megatron's DDP / Float16Module do not return the load result. LoRA loads only the
        # adapters; the base stays as loaded from model_name_or_path.
        result = unwrap_model(chunk).load_state_dict(loaded[key], strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        if missing and not state.lora:
            raise ModelError(f"checkpoint {ckpt_dir} lacks {missing[:5]} for model chunk {key}.")
    if updated:
        with torch.no_grad():  # fp32 main params are views of leaf parameters
            optimizer.load_state_dict(loaded["optimizer"])
        use_fast_adam(optimizer)  # the load replaced the param groups, and with them the kernel flags
    if state.layout == expected.layout:
        _set_rng_state(unpickle.torch_load(os.path.join(ckpt_dir, "rng", f"rank_{dist.get_rank()}.pt")))
    else:
        log_rank0(logger, "resuming at another layout (%s, saved at %s): RNG states start fresh", expected.layout,
                  state.layout)
    elapsed = time.perf_counter() - start
    log_rank0(logger, "resumed from %s (step %d, %d samples consumed) in %.1fs (%.2f GB on this rank, %.2f GB/s)",
              ckpt_dir, state.global_step, state.consumed_samples, elapsed, nbytes / 1e9, nbytes / 1e9 / max(elapsed, 1e-9))
    return state


def _sharded_state(chunks: list[torch.nn.Module], optimizer, lora: bool, *, is_loading: bool) -> dict:
    """The model chunks' (or adapters') sharded state, and the optimizer's unless ``optimizer`` is None."""
    if is_loading and optimizer is not None:
        _materialize_optimizer_state(optimizer)
    if lora:
        from backends.mca.lora.checkpoint import adapter_sharded_state_dict

        state = adapter_sharded_state_dict(chunks)
    else:
        state = sharded_model_state_dict(chunks)
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading,
                                                          metadata=_OPTIMIZER_METADATA)
    return state


def _write_adapter_config(chunks: list[torch.nn.Module], ckpt_dir: str) -> None:
    """The PEFT adapter_config.json of the run's LoRA, marking ``ckpt_dir`` as adapter-only."""
    from backends.mca.lora.apply import lora_spec_of

    lora_spec_of(chunks).peft_config().save_pretrained(ckpt_dir)


def _materialize_optimizer_state(optimizer) -> None:
    """Give a not-yet-stepped distributed optimizer its Adam state before a load.

    Without TE/Apex, Megatron falls back to torch's AdamW, which creates its state (and ``step``)
    lazily; megatron-core 0.16.1's ``DistributedOptimizer.state_dict`` then asserts on the empty
    state when building the sharded dict to load into. Megatron's own dummy step fills it (the
    values are overwritten by the load).
    """
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(inner, "_init_optimizer_states_with_dummy_values") and not inner.optimizer.state:
            inner._init_optimizer_states_with_dummy_values()


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "numpy": [name, torch.from_numpy(keys.copy()), pos, has_gauss, cached],
             "torch": torch.get_rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy(), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
