"""Workarounds for running HF Trainer / TRL / DeepSpeed, on CPU (gloo) in particular.

Every version- or platform-specific fix of the standard backend lives here, numbered as in the
research notes (W1-W11; W12 and W13 are roll's own), so users and tests need no tricks of their own. Each says what it fixes
and when it can go, and checks (``_verified``) that the installed packages are the versions it was
verified with: outside that range it still runs, with one warning per package.
"""

from __future__ import annotations

import atexit
import functools
import importlib.metadata
import logging
import os
import sys
from collections.abc import Callable
from contextlib import contextmanager

from packaging.version import Version

from roll.launch import free_port, inside_launcher
from roll.listen import AGENT_STORE_ENV, bound_store
from roll.logging import warn_once

logger = logging.getLogger(__name__)

VERIFIED_VERSIONS = {
    "torch": ("2.13", "2.14"),          # W2, W13
    "transformers": ("5.23", "5.24"),   # W3, W4, W12
    "accelerate": ("1.15", "1.16"),     # W1, W6
    "deepspeed": ("0.19", "0.20"),      # W3, W5, W6, W7, W8, W9, W10
    "trl": ("1.16", "1.17"),            # W11
}
"""Per package, the [low, high) release range the workarounds below were verified on (constraints.txt pins)."""


def _verified(workaround: str, *packages: str) -> None:
    """Warn once per package that is installed outside ``VERIFIED_VERSIONS`` (the fix may be unneeded or insufficient)."""
    for name in packages:
        try:
            version = Version(importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            continue
        low, high = VERIFIED_VERSIONS[name]
        if not Version(low) <= version < Version(high):
            warn_once(logger, f"{name} {version} is outside the versions the standard backend's workarounds were "
                              f"verified with ([{low}, {high}), first needed by {workaround}); if training misbehaves, "
                              "install the versions in constraints.txt.")


def cpu_training_kwargs() -> dict:
    """W1: HF TrainingArguments kwargs that make accelerate use gloo when there is no accelerator.

    Without ``use_cpu=True`` accelerate finds no accelerator backend, reports world_size 1, and
    DeepSpeed then fails its batch-size check (``train_batch_size != micro * gas * world``).
    Needed as long as accelerate only starts MULTI_CPU with use_cpu (accelerate 1.15).
    """
    _verified("W1", "accelerate")
    from roll.platform import current_platform  # imports torch: not at config time (--help, --print-config)

    return {} if current_platform().is_accelerator else {"use_cpu": True}


_single_process_store: list = []
"""The loopback store of a launcher-less DeepSpeed run (W5)."""


def single_process_env() -> dict[str, str | None]:
    """W5: give a launcher-less process the env of a 1-rank group; return what to restore later.

    Plain ``python`` with a DeepSpeed config otherwise falls back to MPI discovery and fails with
    ``No module named 'mpi4py'``. DeepSpeed 0.19 behaviour; can go once DeepSpeed falls back to
    a 1-rank group by itself (tests/distributed/test_standard_single_process.py passes without it).
    """
    _verified("W5", "deepspeed")
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        return {}
    port = free_port()
    values = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), AGENT_STORE_ENV: "True"}
    previous = {key: os.environ.get(key) for key in values}
    # The rank would host the store on every interface; this process hosts it on loopback instead, the
    # rank's env:// rendezvous a client of it (kept for the life of the process group).
    _single_process_store[:] = [bound_store("127.0.0.1", port, world_size=1)]
    os.environ.update(values)
    return previous


def restore_env(previous: dict[str, str | None]) -> None:
    """Undo :func:`single_process_env` (so an in-process run leaves the environment as it found it)."""
    for key, value in previous.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def init_deepspeed_comm(timeout_seconds: float = 1800) -> None:
    """W3: initialise deepspeed.comm before any HF config exists.

    With ZeRO-3, a model loaded after ``TrainingArguments(deepspeed=...)`` goes through
    ``deepspeed.zero.Init``; if deepspeed.comm is not initialised yet it believes world_size=1
    and fails the batch-size check. Initialising first is harmless for ZeRO-0/1/2.
    Seen with transformers 5.23 / DeepSpeed 0.19; can go once building the arguments initialises
    deepspeed.comm itself (the 2-process ZeRO-3 tests pass without this call).
    """
    _verified("W3", "transformers", "deepspeed")
    import deepspeed

    from datetime import timedelta

    from roll.platform import current_platform

    deepspeed.init_distributed(dist_backend=current_platform().dist_backend, timeout=timedelta(seconds=timeout_seconds))
    unlink_shm_allreduce_buffer()


SHM_BUFFER_PREFIX = "deepspeed_allreduce_buffer"
"""DeepSpeed's name for a rank's shared-memory all-reduce workspace on CPU (ops/csrc/cpu/comm/shm.cpp)."""


def unlink_shm_allreduce_buffer(shm_dir: str = "/dev/shm") -> None:
    """W8: remove this rank's DeepSpeed shared-memory all-reduce file once every rank has mapped it.

    On CPU, when all ranks share one machine, DeepSpeed's comm creates
    ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>`` (69 MB) per rank and
    maps every rank's file during ``init_distributed``, but never unlinks them: each 2-process run left
    138 MB in /dev/shm, which is RAM (a day of runs filled 14 GB on a 24 GB machine). Once every rank has
    returned from the initialisation (the barrier), the names are no longer needed: the mappings live on
    until the process exits, and a killed run leaves nothing behind. Seen with DeepSpeed 0.19.8; can go
    when DeepSpeed unlinks its buffers itself.
    """
    _verified("W8", "deepspeed")
    import torch.distributed as dist

    from roll.platform import current_platform

    if current_platform().is_accelerator or not (dist.is_available() and dist.is_initialized()):
        return
    name = "_".join([SHM_BUFFER_PREFIX, str(os.getuid()), os.environ.get("MASTER_ADDR", ""),
                     os.environ.get("MASTER_PORT", ""), str(dist.get_rank())])
    dist.barrier()  # every rank has mapped every rank's buffer (shm_initialize maps them all before returning)
    try:
        os.unlink(os.path.join(shm_dir, name))
    except FileNotFoundError:  # ranks on several machines: DeepSpeed made no shared-memory buffer
        pass


def drop_hf_deepspeed_config() -> None:
    """W4: forget the process-global HF DeepSpeed config.

    While a ZeRO-3 config is alive, every ``from_pretrained`` enters ``zero.Init`` collectives,
    so a rank-0-only load (merge, reload for export) deadlocks. Call before single-rank work.
    Needed as long as transformers keeps that config process-global (5.23 does).
    """
    _verified("W4", "transformers")
    try:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    except ImportError:  # pragma: no cover - transformers without the integration
        return
    unset_hf_deepspeed_config()


def reset_process_state() -> None:
    """W6: clear state that accelerate and DeepSpeed keep per process after a DeepSpeed run.

    ``Accelerator`` sets ``ACCELERATE_USE_DEEPSPEED=true`` for good and keeps its plugin in a
    singleton; deepspeed.comm keeps its backend. A later non-DeepSpeed trainer in the same
    process (tests, notebooks) would otherwise try to DeepSpeed-wrap its models.
    Seen with accelerate 1.15 / DeepSpeed 0.19; can go once that state ends with the trainer
    (tests/distributed/test_standard_single_process.py passes without it).
    """
    _verified("W6", "accelerate", "deepspeed")
    drop_hf_deepspeed_config()
    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
    try:
        import deepspeed.comm.comm as ds_comm
        from deepspeed.utils import groups as ds_groups
    except ImportError:
        pass
    else:
        ds_comm.cdb = None
        # DeepSpeed caches its world/data-parallel groups; after the process group is destroyed
        # they are dead handles and a second engine in this process fails "Group ... is not registered".
        release = getattr(ds_groups, "_release_process_group_references", None)  # deepspeed >= 0.19
        if release is not None:
            release(None)
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def destroy_process_group(*, barrier: bool) -> None:
    """W2 (first half): release the process group; after a successful run, barrier first.

    The barrier keeps a rank from leaving while others still finish (rank 0's export). After a
    failure it must be skipped: the failing rank would wait there for ranks still in a training
    step, so it never exits and the launcher, which stops the other ranks only when one exits,
    hangs until the collective timeout instead of reporting the failure.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()


def install_clean_exit(code: int = 0) -> None:
    """W2 (second half): end a launched worker with ``os._exit(0)`` at interpreter exit.

    Even after ``destroy_process_group`` leftover gloo threads make some ranks abort at
    interpreter shutdown ("terminate called without an active exception", SIGABRT), so the
    launcher reports failure for a run that succeeded (torch 2.13); can go once the 2-process
    tests in tests/distributed/test_standard_deepspeed.py exit 0 without it, run after run.
    Only installed in launched workers (``roll.launch.inside_launcher``: roll-train's launch,
    torchrun, or ``deepspeed --module roll.cli`` run by hand), and only after a successful run (a
    failing rank keeps its non-zero exit code; a planned stop exits with its ``code``). A script that goes on after the run and then dies
    of an exception still exits 1: Python records the exception in ``sys.last_value`` before
    atexit handlers run (a later ``sys.exit(n)`` is not seen: exit 0).

    atexit handlers registered earlier than this one are skipped (they run last-in first-out).
    HF's TensorBoard callback closes its writer at the end of training; its wandb callback does not
    finish the run (wandb does that in its own atexit handler), so an open wandb run is finished
    here.
    """
    if not inside_launcher():
        return
    _verified("W2", "torch")

    def _exit_now() -> None:
        failed = getattr(sys, "last_value", None) is not None  # its traceback is printed already
        wandb = sys.modules.get("wandb")
        if wandb is not None and getattr(wandb, "run", None) is not None:
            wandb.finish(exit_code=1 if failed else 0)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1 if failed else code)

    atexit.register(_exit_now)


def restrict_deepspeed_loads() -> None:
    """W7: DeepSpeed reads its checkpoint files (``global_stepN/mp_rank_00_model_states.pt``,
    ``*_optim_states.pt``) with ``torch.load(weights_only=False)``, so a checkpoint from elsewhere could run
    code on resume. Read them through ``roll.unpickle`` (tensors, plain data and DeepSpeed's own state classes
    unless ``trust_checkpoint_pickles``). Idempotent. Can go when DeepSpeed loads with weights_only and an
    allow-list (not as of 0.19.8)."""
    _verified("W7", "deepspeed")
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    from roll import unpickle

    if getattr(TorchCheckpointEngine.load, "roll_restricted", False):
        return

    def load(self, path: str, map_location=None):
        return unpickle.torch_load(path, map_location=map_location)

    load.roll_restricted = True
    TorchCheckpointEngine.load = load
    _restrict_universal_loads()


@contextmanager
def restricted_torch_loads():
    """W9: DeepSpeed's universal checkpoint (the conversion, ``deepspeed.checkpoint.ds_to_universal``, and
    the ZeRO optimizers' universal load) calls ``torch.load(weights_only=False)`` itself, past its checkpoint
    engine (W7). While this context is open ``torch.load`` is ``roll.unpickle``'s allow-listed load, for the
    whole process: it is opened only where nothing but DeepSpeed loads (the conversion before training; the
    ZeRO states' load inside the engine's resume). Can go when DeepSpeed loads with weights_only (not as of
    0.19.8)."""
    _verified("W9", "deepspeed")
    import torch

    from roll import unpickle

    original = torch.load

    def load(f, map_location=None, *, weights_only=None, **kwargs):
        return unpickle.torch_load(f, map_location=map_location, loader=original, **kwargs)

    torch.load = load
    try:
        yield
    finally:
        torch.load = original


def _restrict_universal_loads() -> None:
    """W9 for the engine: its ZeRO-state load (universal or not) runs inside ``restricted_torch_loads``."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    load_zero_checkpoint = DeepSpeedEngine._load_zero_checkpoint

    @functools.wraps(load_zero_checkpoint)
    def restricted(self, *args, **kwargs):
        with restricted_torch_loads():
            return load_zero_checkpoint(self, *args, **kwargs)

    DeepSpeedEngine._load_zero_checkpoint = restricted
    _separate_zero3_universal_steps()


def _separate_zero3_universal_steps() -> None:
    """W10: ZeRO-3's universal load gives every parameter group's Adam state the *same* ``step`` tensor
    (``load_hp_checkpoint_state_from_checkpoint_dir_stage3``), and torch's Adam increments it in place once
    per group: after the first resumed step the second group (biases and norms, no weight decay) counts 2
    steps a step, and its bias correction drifts (the loss 1.3e-5 off the uninterrupted run's at the second
    resumed step). Each group gets its own copy after the load. Seen with DeepSpeed 0.19.8; can go when the
    ZeRO-3 elastic resume test (tests/distributed/test_elastic_resume_dist.py) passes without it."""
    _verified("W10", "deepspeed")
    import torch
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    load = Stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3

    @functools.wraps(load)
    def load_with_own_steps(self, checkpoint_dir):
        load(self, checkpoint_dir)
        for flat in self.fp32_partitioned_groups_flat:
            state = self.optimizer.state.get(flat, {})
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()

    Stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3 = load_with_own_steps



@contextmanager
def kto_trainer_accepts_one_row(args):
    """W11: TRL 1.16's ``KTOTrainer.__init__`` refuses ``per_device_train_batch_size`` 1 for its own KL rows
    (formed by rotating each micro-batch, which at one row pairs a prompt with its own reply). roll's kto never
    runs TRL's KL path: at one row a micro-batch its rows are paired when tokenized (``kto_mismatched_rows:
    llamafactory``, as LLaMA-Factory pairs them; roll.config refuses one row otherwise) and roll.kto computes the
    loss. The trainer is built under the one ``loss_type`` TRL exempts from the check (``apo_zero_unpaired``,
    read only by that check and by TRL's own loss), which is then restored on ``args`` (the caller restores the
    trainer's copies). Can go when TRL no longer refuses it, or when roll stops subclassing KTOTrainer."""
    _verified("W11", "trl")
    loss_type = args.loss_type
    args.loss_type = "apo_zero_unpaired"
    try:
        yield
    finally:
        args.loss_type = loss_type


@contextmanager
def safetensors_written_past_the_gil():
    """W12: transformers 5.23's ``save_pretrained`` writes each shard with ``safetensors.torch.save_file``, which
    holds the GIL for the whole write (transformers says so beside the call) and writes through the page cache:
    from a background checkpoint thread (``save_async``) it stops the training thread's every operation for the
    write's duration. While this context is open the shards are written by ``roll.safetensors_file.write_direct``
    instead (the same bytes, past the page cache, copies and writes without the GIL). Opened only by the
    background writer around its ``save_pretrained``, one save at a time, while the main thread saves nothing.
    Can go when safetensors releases the GIL while it writes (not as of 0.8.0)."""
    _verified("W12", "transformers")
    from transformers import modeling_utils

    from roll.safetensors_file import write_direct

    original = modeling_utils.safe_save_file
    modeling_utils.safe_save_file = write_direct
    try:
        yield
    finally:
        modeling_utils.safe_save_file = original


def torch_save_records(obj, stream, before_storage: Callable[[Callable, str, object, int], None] | None = None) -> None:
    """W13: ``torch.save(obj, stream)`` without the CRC-32 of every record (reading each byte once more: 0.3 CPU s
    per GB; ``torch.load`` never checks it), calling ``before_storage(write_record, name, storage, nbytes)`` before
    each tensor storage's record is written, so that a writer may add records of its own first (roll pads so that a
    large tensor's bytes land where ``DirectFile`` writes them from the tensor's own memory). PyTorch has no hook
    between records: this is ``torch.save``'s zip path (``_save`` on a ``PyTorchFileWriter``, torch 2.13) with the
    writer's ``write_record`` seen through a proxy. Can go when ``torch.save`` takes a per-record placement."""
    _verified("W13", "torch")
    import pickle

    import torch
    from torch.serialization import DEFAULT_PROTOCOL, _get_storage_alignment, _save

    writer = torch._C.PyTorchFileWriter(stream, False, _get_storage_alignment())  # False: no CRC-32
    _save(obj, _RecordsSeen(writer, before_storage), pickle, DEFAULT_PROTOCOL, False)
    writer.write_end_of_file()
    stream.flush()


class _RecordsSeen:
    """A ``PyTorchFileWriter`` whose storage records are announced to ``before`` first (W13)."""

    def __init__(self, writer, before) -> None:
        self._writer, self._before = writer, before

    def write_record(self, name, data, size) -> None:
        if self._before is not None and not isinstance(data, (str, bytes)):
            self._before(self._writer.write_record, name, data, size)
        self._writer.write_record(name, data, size)

    def __getattr__(self, name):
        return getattr(self._writer, name)
