"""Training arguments: every Hugging Face ``TrainingArguments`` field, plus the backend switch and launch sizes.

The class subclasses a generated copy of HF's fields (``roll.config.hf_training``, kept equal to the
installed transformers by a test) so users keep every familiar key and its help text while --help,
--print-config and config mistakes import neither transformers nor torch. Its ``__post_init__`` only
validates: HF's own set-up (device and distributed initialisation, DeepSpeed plugin) would run at config
time. The standard backend builds the real HF object with :meth:`TrainingArguments.hf_kwargs`; the
Megatron backend reads the fields directly. Megatron's own settings are a separate group
(``roll.config.megatron.MegatronArguments``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import typing
from dataclasses import dataclass

from roll.config.hf_training import HFTrainingFields, SchedulerType
from roll.errors import ConfigError, RollError
from roll.outputs import output_dir_value

LAUNCH_ENV_FALLBACKS = {"nnodes": "NNODES", "node_rank": "NODE_RANK", "master_addr": "MASTER_ADDR",
                        "master_port": "MASTER_PORT"}
"""Keys read from these environment variables when neither the recipe nor the command line sets them
(the names torchrun, DeepSpeed and cluster schedulers' job scripts use)."""

SLURM_SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGHUP")
"""What slurm_signal may name: signals nothing else in roll-train, torchrun or DeepSpeed's launcher uses."""


def read_json_object(path: str, what: str, error: type[RollError] = ConfigError) -> dict:
    """The JSON object in an existing file; ``error`` naming ``what`` when it is not JSON or not an object."""
    try:
        with open(path, encoding="utf-8") as fh:
            content = json.load(fh)
    except json.JSONDecodeError as exc:
        raise error(f"{what} is not valid JSON: {exc}.") from None
    except RecursionError:
        raise error(f"{what} nests arrays/objects too deep to read; it is not a file roll or its libraries "
                    "wrote: replace it.") from None
    except UnicodeDecodeError as exc:
        raise error(f"{what} is not UTF-8 text ({exc.reason} at byte {exc.start}): replace it.") from None
    if not isinstance(content, dict):
        raise error(f"{what} must hold a JSON object, got {type(content).__name__}.")
    return content


def read_deepspeed_json(path: str) -> dict:
    """The DeepSpeed config file a recipe names, as a dict; a clear ConfigError when unusable."""
    if not os.path.isfile(path):
        raise ConfigError(f"deepspeed config file {path!r} does not exist. Use one of recipes/deepspeed/"
                          "ds_z0.json, ds_z2.json, ds_z3.json, ds_z3_offload.json or drop the 'deepspeed' key.")
    return read_json_object(path, f"deepspeed config {path!r}")


def _choice(value) -> str:
    """An HF choice field's text, whether it holds the enum or the string."""
    return str(getattr(value, "value", value))


@dataclass
class TrainingArguments(HFTrainingFields):
    output_dir: str = "outputs/roll"
    """Where checkpoints, logs and the final HF-format model are written: a folder of this run's own (not empty,
    /, the home directory, a system directory, nor the model's or a dataset's folder; ~ is expanded)."""

    use_mca: bool = False
    """Backend switch: true trains with Megatron-Core (mca), false with HF Trainer/TRL + DeepSpeed (standard)."""

    nproc_per_node: int = 1
    """Processes per node. >1 outside a launcher re-executes roll-train under torchrun or the deepspeed launcher."""

    nnodes: int = 1
    """Number of nodes in the job (env NNODES when not set). >1: run roll-train on every node with the same recipe,
    node_rank and master_addr; each starts its nproc_per_node local ranks and they join one job."""

    node_rank: int | None = None
    """This node's index in a multi-node job, 0..nnodes-1 (env NODE_RANK when not set); node 0 hosts the rendezvous."""

    master_addr: str | None = None
    """Address of node 0, reachable from every node (env MASTER_ADDR when not set). Needed when nnodes > 1;
    a single-node run uses 127.0.0.1."""

    master_port: int | None = None
    """Rendezvous TCP port on master_addr (env MASTER_PORT when not set). Default: 29500 when nnodes > 1 (as torchrun),
    a free local port on one node. Multi-node runs meet there through torchrun's rendezvous, or with a deepspeed
    config through the deepspeed launcher's per-node mode (--hostfile --no_ssh --node_rank)."""

    gpu_memory_gb: float = 80.0
    """Memory of one GPU in GiB that `roll-train RECIPE --plan` checks the per-rank plan against (80: an H100 80GB).
    Only the planner reads it; training uses whatever the device has."""

    save_hf_model: bool = True
    """Write the final model in Hugging Face format (safetensors + config + tokenizer) to output_dir."""

    overwrite_output_dir: bool = False
    """Allow a fresh run in an output_dir that already holds a trained model, checkpoints, files no roll run
    wrote or another recipe's run: its checkpoint-N directories are deleted at the start, the final model is
    replaced at the end. Off by default so no finished work is lost; resuming (resume_from_checkpoint) needs
    no overwrite, and a run of the same recipe (.roll_run.json) or logs alone (train_log.jsonl, loss.png,
    runs/ of a run that saved nothing) never block."""

    resume_from_checkpoint: str | None = None
    """Continue a run: true -> the latest complete OUTPUT_DIR/checkpoint-N (an error when there is none); a
    path -> that checkpoint; auto -> the latest checkpoint-N if there is one, else a fresh run (for requeued
    or preempted jobs that rerun one command); unset / false -> a fresh run."""

    save_on_preemption: bool = True
    """On SIGTERM / SIGINT every rank finishes its step, a checkpoint is written, and roll-train exits with
    code 75 (EXIT_PREEMPTED); resume_from_checkpoint: true then continues. False: stop without saving."""

    slurm_signal: str | None = None
    """The early-warning signal SLURM sends before the time limit (`#SBATCH --signal=B:USR1@300` with
    `exec srun` in the script, or `--signal=USR1@300`): USR1, USR2 or HUP. On it every rank saves a checkpoint
    after its step and trains on; with slurm_requeue it stops and requeues the job. Unset: no early warning
    (SIGTERM still saves and stops, save_on_preemption). docs/slurm.md."""

    slurm_requeue: bool = False
    """With slurm_signal: after the early warning's checkpoint, stop (exit 75) and requeue the job with
    `scontrol requeue $SLURM_JOB_ID` (the job needs --requeue); the requeued run resumes from that checkpoint
    (SLURM_RESTART_COUNT >= 1 makes resume_from_checkpoint default to auto)."""

    save_async: bool = True
    """Write checkpoints in the background: a writer thread writes the files while training goes on (the mca
    backend: Megatron's asynchronous dist-checkpointing plan, written by the thread). State on a GPU is copied
    to host memory first; state in host memory (a CPU run) is written as it is, and the next optimizer step
    waits until the writer has read it. checkpoint-N becomes the latest only once complete, so a kill mid-write
    resumes from the previous one. One save at a time: a save, the final export and the end of training first
    finish the pending one. Under DeepSpeed or FSDP (which write their own checkpoint files) saves stay
    synchronous. False: every save blocks training until it is on disk."""

    max_consecutive_skipped_steps: int = 10
    """A step whose loss or grad norm is not finite is skipped (no update) and counted; after this many skips in
    a row the run stops with exit code 3, naming the step and its samples. 0: never stop."""

    warmup_ratio: float = 0.0
    """LLaMA-Factory's (and transformers 4's) warmup key: warmup over this fraction of the run's steps,
    rounded up (0 <= ratio < 1). Transformers 5 reads a ``warmup_steps`` below 1 as that ratio, so the key
    is stored there; setting both is an error."""

    def __post_init__(self) -> None:  # noqa: D105 - deliberately not calling HF's (see module doc)
        self._take_warmup_ratio()
        positive = ("per_device_train_batch_size", "gradient_accumulation_steps", "nproc_per_node", "nnodes")
        self.output_dir = output_dir_value(self.output_dir)
        if not self.gpu_memory_gb > 0:
            raise ConfigError(f"gpu_memory_gb must be > 0 (GiB of one GPU), got {self.gpu_memory_gb}.")
        if self.max_consecutive_skipped_steps < 0:
            raise ConfigError(f"max_consecutive_skipped_steps must be >= 0 (0: never stop), got "
                              f"{self.max_consecutive_skipped_steps}.")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}.")
        self._check_launch_keys()
        self._check_slurm_keys()
        if self.learning_rate < 0:
            raise ConfigError(f"learning_rate must be >= 0, got {self.learning_rate}.")
        if self.max_steps == 0 or self.max_steps < -1:
            raise ConfigError(f"max_steps must be a positive step count or -1 (use num_train_epochs), got {self.max_steps}.")
        if self.max_steps == -1 and not self.num_train_epochs > 0:
            raise ConfigError(f"num_train_epochs must be > 0 when max_steps is -1 (its default), got "
                              f"{self.num_train_epochs}: nothing would be trained. Set num_train_epochs "
                              "(e.g. 1) or max_steps.")
        if self.bf16 and self.fp16:
            raise ConfigError("bf16 and fp16 are both true: choose one precision.")
        self._check_schedule_keys()
        if isinstance(self.deepspeed, str):
            read_deepspeed_json(self.deepspeed)

    def _take_warmup_ratio(self) -> None:
        if not self.warmup_ratio:
            return
        if not 0 < self.warmup_ratio < 1:
            raise ConfigError(f"warmup_ratio must be in [0, 1) (a fraction of the run's steps), "
                              f"got {self.warmup_ratio}.")
        if self.warmup_steps and self.warmup_steps != self.warmup_ratio:
            raise ConfigError(f"warmup_ratio ({self.warmup_ratio}) and warmup_steps ({self.warmup_steps}) are "
                              "both set: keep one (warmup_steps takes a step count, or below 1 a ratio).")
        self.warmup_steps = self.warmup_ratio

    def _check_schedule_keys(self) -> None:
        """Step intervals and the scheduler name (HF would reject them with a traceback at train time)."""
        for key, strategy in (("logging_steps", "logging_strategy"), ("save_steps", "save_strategy"),
                              ("eval_steps", "eval_strategy")):
            value, every = getattr(self, key), _choice(getattr(self, strategy))
            if every == "steps" and value is not None and not value > 0:
                raise ConfigError(f"{key} must be > 0 with {strategy}: steps (a step count, or below 1 a "
                                  f"fraction of the run), got {value}.")
        names = list(typing.get_args(SchedulerType))  # the snapshot's choices: no transformers import
        scheduler = _choice(self.lr_scheduler_type)
        if scheduler not in names:
            raise ConfigError(f"lr_scheduler_type {scheduler!r} is not a learning-rate schedule: choose one "
                              f"of {', '.join(names)}.")

    def _check_slurm_keys(self) -> None:
        if self.slurm_signal is not None:
            name = str(self.slurm_signal).strip().upper()
            name = name if name.startswith("SIG") else "SIG" + name
            if name not in SLURM_SIGNALS:
                names = ", ".join(s[3:] for s in SLURM_SIGNALS)
                raise ConfigError(f"slurm_signal must be one of {names} (the signal of #SBATCH "
                                  f"--signal=B:USR1@300), got {self.slurm_signal!r}: SIGTERM and SIGINT "
                                  "already save and stop (save_on_preemption).")
            self.slurm_signal = name[3:]
        if self.slurm_requeue and self.slurm_signal is None:
            raise ConfigError("slurm_requeue: true needs slurm_signal (e.g. USR1, with #SBATCH "
                              "--signal=B:USR1@300): the job requeues itself on that early warning.")

    @property
    def slurm_signum(self) -> int | None:
        """slurm_signal as a signal number (None when unset)."""
        import signal

        return int(getattr(signal, "SIG" + self.slurm_signal)) if self.slurm_signal else None

    def _check_launch_keys(self) -> None:
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"node_rank must be in 0..nnodes-1 = 0..{self.nnodes - 1}, got {self.node_rank}. "
                              "Give each node its own node_rank (0 on the node at master_addr); "
                              "without the key, roll reads the NODE_RANK environment variable.")
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise ConfigError(f"master_port must be a TCP port in 1..65535, got {self.master_port} (the key, else the MASTER_PORT environment variable).")
        if self.master_addr is not None and not self.master_addr.strip():
            raise ConfigError("master_addr is empty: give node 0's address (host name or IP) or drop the key.")

    @property
    def world_size_from_launch(self) -> int:
        """World size: the launcher's WORLD_SIZE when running under one, else nproc_per_node * nnodes."""
        if "WORLD_SIZE" in os.environ:
            return int(os.environ["WORLD_SIZE"])
        return self.nproc_per_node * self.nnodes

    def hf_kwargs(self) -> dict:
        """The HF ``TrainingArguments`` fields as constructor kwargs (for HF/TRL config classes): those the
        installed transformers has (the same set as the snapshot's, which a test checks)."""
        import transformers

        hf_fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments) if f.init}
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init and f.name in hf_fields}
