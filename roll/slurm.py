"""roll-train as a task of a SLURM job step: SLURM's variables mapped to the launcher's (docs/slurm.md).

``srun`` starts every task itself and sets ``SLURM_*`` variables, never torchrun's. Two forms are one run:

- **one task per rank** (``srun -n 8 roll-train R``): this process is one rank. RANK, WORLD_SIZE,
  LOCAL_RANK and LOCAL_WORLD_SIZE come from SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID and the
  step's tasks per node; MASTER_ADDR is the first host of the step's node list and MASTER_PORT is derived
  from the job id (``job_port``). roll-train does not start a launcher: it trains in this process.
- **one task per node** (``srun --ntasks-per-node=1 roll-train R nproc_per_node=G``): this process is one
  node of a multi-node run: nnodes, node_rank, master_addr and master_port come from SLURM_NNODES,
  SLURM_NODEID, the node list and the job id (the NNODES / NODE_RANK / MASTER_ADDR / MASTER_PORT fallbacks
  of ``roll.config.training``), and roll-train launches its G local ranks as it does on any node.

What the user set wins: torchrun's variables already in the environment (roll-train under a launcher, or a
wrapper that mapped them) turn the mapping off; recipe and command-line keys (master_addr, master_port,
nnodes, node_rank) and launcher variables already set are kept. A step of one task (``sbatch -n 1`` with a
plain ``roll-train``) and the batch shell itself (no step) are left as they are.
"""

from __future__ import annotations

import logging
import os
import re
import zlib
from collections.abc import MutableMapping
from dataclasses import dataclass

from roll.errors import ConfigError

logger = logging.getLogger(__name__)

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
"""Any of these set: a launcher (or the user) already placed this process; SLURM's are not read."""

PORT_BASE = 15000
PORT_SPAN = 20000
"""MASTER_PORT derived from the job id lies in [PORT_BASE, PORT_BASE + PORT_SPAN): above the well-known and
registered ports most clusters use, below Linux's ephemeral range (32768+ is reached only past 17767)."""


# ---- host lists ---------------------------------------------------------------------------------

def expand_hostlist(text: str, source: str = "SLURM_STEP_NODELIST") -> list[str]:
    """SLURM's compressed host list as host names, in SLURM's order: ``gpu[01-03,07]`` -> gpu01, gpu02,
    gpu03, gpu07 (zero padding kept); ``a-[1-2]b`` -> a-1b, a-2b; ``n[1-2]-[5-6]`` -> n1-5, n1-6, n2-5,
    n2-6; ``x1,y[3-4]`` -> x1, y3, y4 (commas inside brackets do not split hosts). A malformed list is a
    ConfigError naming ``source``."""
    hosts = []
    for item in _split_top_level(text, source):
        hosts.extend(_expand_item(item, text, source))
    if not hosts:
        raise ConfigError(f"{source}={text!r} names no host; run roll-train through srun (or unset "
                          f"{source}).")
    return hosts


def _split_top_level(text: str, source: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if depth not in (0, 1):
            raise _malformed(text, source, "unbalanced or nested brackets")
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise _malformed(text, source, "an unclosed bracket")
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_item(item: str, text: str, source: str) -> list[str]:
    """One host pattern, bracket groups expanded left to right (the first varies slowest)."""
    match = re.fullmatch(r"([^\[\]]*)\[([^\[\]]*)\](.*)", item)
    if match is None:
        if "[" in item or "]" in item:
            raise _malformed(text, source, f"bad brackets in {item!r}")
        return [item]
    prefix, ranges, rest = match.groups()
    tails = _expand_item(rest, text, source)
    return [prefix + number + tail for number in _numbers(ranges, text, source) for tail in tails]


def _numbers(ranges: str, text: str, source: str) -> list[str]:
    numbers = []
    for part in ranges.split(","):
        low, dash, high = part.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise _malformed(text, source, f"{part!r} is not a number or a range such as 01-04")
        if not dash:
            numbers.append(low)
            continue
        if int(high) < int(low):
            raise _malformed(text, source, f"the range {part!r} runs backwards")
        numbers.extend(str(n).zfill(len(low)) for n in range(int(low), int(high) + 1))
    return numbers


def _malformed(text: str, source: str, why: str) -> ConfigError:
    return ConfigError(f"{source}={text!r} is not a SLURM host list ({why}); set MASTER_ADDR (or the "
                       "master_addr key) to the first node's address to run without it.")


def expand_counts(text: str) -> list[int]:
    """SLURM's tasks-per-node list, one count per node: ``2(x3),1`` -> [2, 2, 2, 1]."""
    counts = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if match is None:
            raise ConfigError(f"SLURM_STEP_TASKS_PER_NODE={text!r} is not a SLURM task count list "
                              "(e.g. 2(x3),1).")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


# ---- the step this process is a task of ---------------------------------------------------------

@dataclass(frozen=True)
class SlurmTask:
    """This process's place in its SLURM job step."""

    job_id: str
    step_id: str
    rank: int
    """SLURM_PROCID: the task's index in the step."""
    ntasks: int
    local_rank: int
    """SLURM_LOCALID: the task's index on its node."""
    local_tasks: int
    """Tasks of the step on this node."""
    nnodes: int
    node_rank: int
    hosts: tuple[str, ...]
    """The step's nodes, expanded (node 0 first)."""

    @property
    def one_per_node(self) -> bool:
        return self.ntasks == self.nnodes


def read_task(environ: MutableMapping[str, str] | None = None) -> SlurmTask | None:
    """This process's task of a SLURM step with several tasks; None outside a step (the batch shell has
    SLURM_NTASKS and SLURM_PROCID but no SLURM_STEP_ID) or in a step of one task."""
    environ = os.environ if environ is None else environ  # now: datasets' map(num_proc) replaces os.environ
    ntasks = environ.get("SLURM_STEP_NUM_TASKS") or (environ.get("SLURM_NTASKS") if "SLURM_STEP_ID" in environ
                                                      else None)
    if not ntasks or "SLURM_PROCID" not in environ or _int(environ, "SLURM_STEP_NUM_TASKS", ntasks) <= 1:
        return None
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or ""
    source = "SLURM_STEP_NODELIST" if environ.get("SLURM_STEP_NODELIST") else "SLURM_JOB_NODELIST"
    hosts = tuple(expand_hostlist(nodelist, source)) if nodelist else ()
    nnodes = _int(environ, "SLURM_STEP_NUM_NODES", environ.get("SLURM_STEP_NUM_NODES")
                  or environ.get("SLURM_NNODES") or str(max(len(hosts), 1)))
    node_rank = _int(environ, "SLURM_NODEID", environ.get("SLURM_NODEID", "0"))
    per_node = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    counts = expand_counts(per_node) if per_node else []
    ntasks_int = _int(environ, "SLURM_STEP_NUM_TASKS", ntasks)
    local_tasks = counts[node_rank] if node_rank < len(counts) else max(1, ntasks_int // max(nnodes, 1))
    return SlurmTask(job_id=environ.get("SLURM_JOB_ID", ""), step_id=environ.get("SLURM_STEP_ID", "0"),
                     rank=_int(environ, "SLURM_PROCID", environ["SLURM_PROCID"]), ntasks=ntasks_int,
                     local_rank=_int(environ, "SLURM_LOCALID", environ.get("SLURM_LOCALID", "0")),
                     local_tasks=local_tasks, nnodes=nnodes, node_rank=node_rank, hosts=hosts)


def _int(environ, name: str, text: str) -> int:
    try:
        return int(str(text).strip())
    except ValueError:
        raise ConfigError(f"{name}={environ.get(name, text)!r} is not a number; SLURM sets it: unset it in "
                          "your script if you set it yourself.") from None


def job_port(job_id: str, step_id: str = "0") -> int:
    """MASTER_PORT of a job step: PORT_BASE + (job id mod 2000) * 10 + (step id mod 10), so two jobs (or two
    steps of one job) sharing a node meet on different ports and every task computes the same one."""
    job = int(job_id) if job_id.isdigit() else zlib.crc32(job_id.encode())
    step = int(step_id) if step_id.isdigit() else 0
    return PORT_BASE + (job % (PORT_SPAN // 10)) * 10 + step % 10


# ---- the mapping --------------------------------------------------------------------------------

def launch_env(task: SlurmTask, keys: dict, environ: MutableMapping[str, str]) -> dict[str, str]:
    """The variables to set for ``task``: torchrun's (one task per rank; nproc_per_node unset, or equal to the
    tasks on this node as in a recipe written for 8 GPUs under `srun --ntasks-per-node=8`) or roll's launch
    fallbacks (one task per node, nproc_per_node > 1). ``keys``: the recipe's and command line's
    nproc_per_node, master_addr and master_port (they win over SLURM and over the environment)."""
    nproc = int(keys.get("nproc_per_node") or 1)
    addr = keys.get("master_addr") or environ.get("MASTER_ADDR") or _first_host(task)
    port = str(keys.get("master_port") or environ.get("MASTER_PORT") or job_port(task.job_id, task.step_id))
    if nproc > 1 and nproc != task.local_tasks:  # equal: the recipe's processes per node are srun's tasks
        if task.local_tasks != 1:
            raise ConfigError(f"srun started {task.local_tasks} tasks on this node and nproc_per_node="
                              f"{nproc} asks each to launch {nproc} ranks: either one task per rank (`srun "
                              f"--ntasks-per-node={nproc} roll-train RECIPE`, no nproc_per_node) or one task "
                              f"per node (`srun --ntasks-per-node=1 roll-train RECIPE nproc_per_node="
                              f"{nproc}`).")
        wanted = {"NNODES": str(task.nnodes), "NODE_RANK": str(task.node_rank), "MASTER_ADDR": addr,
                  "MASTER_PORT": port}
        return {var: value for var, value in wanted.items() if not environ.get(var)}
    return {"RANK": str(task.rank), "WORLD_SIZE": str(task.ntasks), "LOCAL_RANK": str(task.local_rank),
            "LOCAL_WORLD_SIZE": str(task.local_tasks), "GROUP_RANK": str(task.node_rank),
            "MASTER_ADDR": addr, "MASTER_PORT": port}


def _first_host(task: SlurmTask) -> str:
    if not task.hosts:
        raise ConfigError("SLURM_STEP_NODELIST and SLURM_JOB_NODELIST are unset, so roll-train cannot tell "
                          "the first node's address: set MASTER_ADDR (or the master_addr key).")
    return task.hosts[0]


def adopt(keys: dict, environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Map SLURM's variables into ``environ`` when this process is a task of a multi-task step and no
    launcher placed it (see the module doc); returns what was set ({} when nothing). One log line (task 0)
    says what came from SLURM."""
    environ = os.environ if environ is None else environ  # now: datasets' map(num_proc) replaces os.environ
    if any(environ.get(var) for var in TORCHRUN_VARS):
        return {}
    task = read_task(environ)
    if task is None:
        return {}
    values = launch_env(task, keys, environ)
    environ.update(values)
    if "RANK" in values:
        from roll.listen import collective_env

        # gloo / NCCL on master_addr's interface, as roll-train's launcher sets them for its ranks
        environ.update(collective_env(values["MASTER_ADDR"], environ))
        form = f"one task per rank: this task is rank {task.rank} of {task.ntasks}"
    else:
        form = (f"one task per node: node {task.node_rank} of {task.nnodes} launches nproc_per_node="
                f"{keys.get('nproc_per_node')} ranks")
    level = logging.INFO if task.rank == 0 else logging.DEBUG
    logger.log(level, "SLURM job %s step %s (%d tasks on %d nodes), %s; from SLURM: %s", task.job_id or "?",
               task.step_id, task.ntasks, task.nnodes, form,
               ", ".join(f"{var}={value}" for var, value in values.items()) or "nothing (all set already)")
    return values


# ---- restarts -----------------------------------------------------------------------------------

def restart_count(environ: MutableMapping[str, str] | None = None) -> int:
    """SLURM_RESTART_COUNT: how often this job was requeued (0 on its first run or outside SLURM)."""
    environ = os.environ if environ is None else environ  # now: datasets' map(num_proc) replaces os.environ
    text = environ.get("SLURM_RESTART_COUNT", "").strip()
    return int(text) if text.isdigit() else 0


REQUEUE_TIMEOUT_S = 60.0
"""How long ``scontrol requeue`` may take (slurmctld answers in milliseconds unless it is down or busy)."""


def requeue(environ: MutableMapping[str, str] | None = None, timeout: float = REQUEUE_TIMEOUT_S) -> str:
    """Requeue this job (``scontrol requeue $SLURM_JOB_ID``): SLURM then stops every process of it and runs
    the same script again with SLURM_RESTART_COUNT + 1. Returns the sentence for the run's last message,
    saying what to do when it failed (the checkpoint is written either way)."""
    environ = os.environ if environ is None else environ  # now: datasets' map(num_proc) replaces os.environ
    import subprocess

    job = environ.get("SLURM_JOB_ID")
    if not job:
        return "not requeued: this is not a SLURM job (SLURM_JOB_ID is unset); run it again to resume."
    cmd = ["scontrol", "requeue", job]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        why = "scontrol is not on this node's PATH"
    except subprocess.TimeoutExpired:
        why = f"scontrol did not answer within {timeout:.0f} s"
    else:
        if done.returncode == 0:
            logger.warning("requeued SLURM job %s (scontrol requeue %s)", job, job)
            return f"SLURM job {job} requeued (scontrol requeue): its next run resumes from this checkpoint."
        detail = (done.stderr or done.stdout).strip().splitlines()
        why = f"`{' '.join(cmd)}` failed (exit {done.returncode}: {detail[0] if detail else 'no message'})"
    logger.error("could not requeue SLURM job %s: %s", job, why)
    return (f"NOT requeued: {why}. Submit the job with --requeue (a job without it answers 'Requested "
            f"operation is presently disabled'), or requeue it yourself: scontrol requeue {job}.")


def log_restart(restarts: int, output_dir: str, environ: MutableMapping[str, str] | None = None) -> None:
    """One line (global rank 0, not again in the ranks roll-train launched): the requeued job's resume."""
    environ = os.environ if environ is None else environ  # now: datasets' map(num_proc) replaces os.environ
    if environ.get("RANK", "0") != "0" or environ.get("ROLL_LAUNCHED"):
        return
    from roll.checkpoints import last_checkpoint

    latest = last_checkpoint(output_dir)
    where = f"resuming from {latest}" if latest else "no complete checkpoint yet, training from the start"
    logger.info("requeued SLURM job (SLURM_RESTART_COUNT=%d): resume_from_checkpoint defaults to auto: %s",
                restarts, where)


# ---- roll-train RECIPE --sbatch -----------------------------------------------------------------

_SLURM_PROVIDES = ("nnodes", "node_rank", "master_addr", "master_port")
"""Keys srun's variables give every task: left out of a printed script's command line."""


def sbatch_script(recipe: str | None, argv: list[str], nnodes: int, nproc_per_node: int,
                  explicit: frozenset[str] = frozenset()) -> str:
    """``roll-train RECIPE --sbatch``: an sbatch script (examples/slurm/train.sbatch's) that runs ``argv`` on
    ``nnodes`` nodes with one task per GPU (``nproc_per_node`` of them per node), the early warning saving a
    checkpoint and requeueing the job unless the command line or recipe set slurm_signal / slurm_requeue."""
    import shlex

    def launch_key(token: str) -> bool:
        key = token.lstrip("-").split("=", 1)[0].replace("-", "_")
        return key in _SLURM_PROVIDES or key == "sbatch"

    args, skip = [], False
    for token in argv:
        if skip:
            skip = False
            continue
        if launch_key(token):  # `--nnodes 2` takes the next token too
            skip = token.startswith("--") and "=" not in token and token.lstrip("-") != "sbatch"
            continue
        args.append(token)
    warning = ["slurm_signal=USR1", "slurm_requeue=true"]
    extra = [] if {"slurm_signal", "slurm_requeue"} & explicit else warning
    name = os.path.splitext(os.path.basename(recipe or "roll"))[0]
    command = " ".join(shlex.quote(token) for token in ["roll-train", *args, *extra])
    return f"""#!/bin/bash
# roll-train on SLURM (docs/slurm.md): {nnodes} node(s) x {nproc_per_node} task(s), one task per GPU, each
# task one rank. The same script serves the first run and every requeued one (SLURM_RESTART_COUNT >= 1
# resumes from the latest complete checkpoint in output_dir, which every node must see). sbatch THIS_FILE
#SBATCH --job-name={name}
#SBATCH --nodes={nnodes}
#SBATCH --ntasks-per-node={nproc_per_node}
#SBATCH --gpus-per-node={nproc_per_node}
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=roll-%x-%j.log

set -euo pipefail
# exec: srun takes the shell's place, so SLURM's signals to the batch shell reach every task through it
exec srun {command}
"""
