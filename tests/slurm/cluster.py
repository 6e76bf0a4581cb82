"""A real SLURM cluster on this machine, loopback only, for the integration tests of tests/slurm.

Debian's packages (``apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge``), run as
root: one ``munged`` with its own key and socket, one ``slurmctld`` and two ``slurmd`` nodes on 127.0.0.1 with
ports of their own. The nodes are named ``$(hostname -s)`` and ``localhost`` because a job derives its
rendezvous address from its node list, so both names must resolve. Configuration, key, state, spool and
logs live in one temporary directory; nothing is written elsewhere and no system service is touched.

Every process of the cluster (daemons, ``slurmstepd``, job tasks, ``srun``/``sbatch`` clients started with
``SlurmCluster.env``) carries ``ROLL_SLURM_TEST_CLUSTER=<its directory>`` in its environment: ``stop`` kills
the daemons it started and then every process still carrying the marker, so a failed test leaves nothing
running. Measured facts behind the settings (SLURM 22.05): ``docs/testing.md#slurm-integration-tests``.
"""

from __future__ import annotations

import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from roll.launch import free_port
from tests.helpers import REPO, clean_env, wait_until

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
"""Debian's packages of the cluster (``.ci/run`` installs them)."""

MARKER_ENV = "ROLL_SLURM_TEST_CLUSTER"
START_TIMEOUT = 60.0
COMMAND_TIMEOUT = 30.0
CRED_EXPIRE = 10
"""A requeued job waits ``cred_expire + 1`` s before it may run again (SLURM's default 120 s; 5 is its minimum)."""
KILL_WAIT = 20
"""Seconds from the SIGTERM of a requeue / scancel to the SIGKILL (default 30): longer than one tiny step and a
checkpoint save on a loaded machine."""

_BINARIES = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "scontrol", "sinfo")
_SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/bin", "/sbin"])


class ClusterUnavailable(RuntimeError):
    """The cluster could not start here; the message says why (missing packages, not root, a daemon's log)."""


def missing_requirements() -> str | None:
    """Why a cluster cannot be started on this machine, or None when it can be tried."""
    missing = [name for name in _BINARIES if shutil.which(name, path=_SEARCH_PATH) is None]
    if missing:
        return (f"SLURM is not installed ({', '.join(missing)} not found): as root, `apt-get install -y "
                f"--no-install-recommends {' '.join(PACKAGES)}`")
    if os.geteuid() != 0:
        return "slurmd must run as root to start jobs: run the SLURM tests as root"
    return None


def node_names() -> tuple[str, str]:
    """The two node names, each resolving to a loopback address (``$(hostname -s)`` and ``localhost``)."""
    short = socket.gethostname().split(".")[0]
    if short == "localhost":
        raise ClusterUnavailable("this machine's host name is 'localhost': two nodes need two names")
    for name in (short, "localhost"):
        try:
            address = socket.gethostbyname(name)
        except OSError as exc:
            raise ClusterUnavailable(f"node name {name!r} does not resolve ({exc}): add it to /etc/hosts") from exc
        if not address.startswith("127."):
            raise ClusterUnavailable(f"node name {name!r} resolves to {address}, not a loopback address")
    return short, "localhost"


def slurm_conf(root: Path, nodes: tuple[str, str], ports: tuple[int, int, int], first_job_id: int) -> str:
    """slurm.conf of the test cluster: controller on ``nodes[0]``, one CPU per node, so ``-n 2`` spans both."""
    ctld_port, *node_ports = ports
    return "\n".join([
        "ClusterName=rolltest",
        f"SlurmctldHost={nodes[0]}(127.0.0.1)",
        f"SlurmctldPort={ctld_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={root}/munge/munge.socket,cred_expire={CRED_EXPIRE}",
        "CommunicationParameters=NoInAddrAny,NoCtldInAddrAny",  # loopback only, the controller too
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool/%n",
        f"SlurmctldPidFile={root}/run/slurmctld.pid",
        f"SlurmdPidFile={root}/run/slurmd-%n.pid",
        f"SlurmctldLogFile={root}/log/slurmctld.log",
        f"SlurmdLogFile={root}/log/slurmd-%n.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        # no cgroups: linuxproc works in any container, cgroup v1 or v2, with or without systemd
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "MpiDefault=none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "SchedulerType=sched/builtin",
        "SchedulerParameters=sched_interval=1",  # a requeued job runs as soon as its BeginTime passes
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        f"FirstJobId={first_job_id}",  # two test clusters on one machine never share a job id
        f"KillWait={KILL_WAIT}",
        "MailProg=/bin/true",
        "MinJobAge=600",  # finished jobs stay visible to `scontrol show job` (there is no accounting)
        "ReturnToService=2",
        "SlurmdTimeout=60",
        "MessageTimeout=30",
        "InactiveLimit=0",
        "PropagateResourceLimits=NONE",
        *(f"NodeName={name} NodeAddr=127.0.0.1 NodeHostname={name} Port={port} CPUs=1 State=UNKNOWN"
          for name, port in zip(nodes, node_ports)),
        "PartitionName=test Nodes=ALL Default=YES MaxTime=30 State=UP",
        "",
    ])


@dataclass
class SlurmCluster:
    """A running test cluster; ``env()`` is the environment its client commands and jobs need."""

    root: Path
    nodes: tuple[str, str]
    daemons: list[subprocess.Popen] = field(default_factory=list)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    def env(self, **extra: str) -> dict[str, str]:
        path = os.pathsep.join([os.path.dirname(os.path.abspath(sys.executable)), _SEARCH_PATH])
        return clean_env(SLURM_CONF=str(self.conf), PATH=path, **{MARKER_ENV: str(self.root)}, **extra)

    def command(self, *args: str, timeout: float = COMMAND_TIMEOUT) -> subprocess.CompletedProcess:
        """A SLURM client command (scontrol, sinfo, sbatch, ...) against this cluster, run from the repo root."""
        return subprocess.run(list(args), cwd=REPO, env=self.env(), capture_output=True, text=True,
                              timeout=timeout)

    def srun(self, *args: str, timeout: float) -> subprocess.CompletedProcess:
        """``srun ARGS`` (a job of its own) from the repo root; past ``timeout`` its job is cancelled and the
        test fails."""
        cmd = ["srun", "--job-name=roll-srun", f"--time={max(1, int(timeout // 60) + 1)}", *args]
        proc = subprocess.Popen(cmd, cwd=REPO, env=self.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.command("scancel", "--name=roll-srun")
            proc.kill()
            stdout, stderr = proc.communicate(timeout=COMMAND_TIMEOUT)
            raise AssertionError(f"{shlex.join(cmd)} ran past {timeout} s:\n{stdout[-3000:]}\n{stderr[-3000:]}")
        return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)

    def sbatch(self, *args: str) -> str:
        """Submit a batch job; its id."""
        proc = self.command("sbatch", "--parsable", *args)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Restarts, ExitCode, ...); {} once it is gone."""
        proc = self.command("scontrol", "show", "job", "--oneliner", job_id)
        if proc.returncode != 0:
            return {}
        return dict(item.split("=", 1) for item in proc.stdout.split() if "=" in item)

    def wait_job(self, job_id: str, predicate, timeout: float) -> dict[str, str]:
        """Poll the job until ``predicate(fields)`` holds; fail the test with its state and the logs after
        ``timeout`` s."""
        seen: dict[str, str] = {}

        def holds() -> bool:
            seen.clear()
            seen.update(self.job(job_id))
            return bool(seen) and predicate(seen)

        if not wait_until(holds, timeout, interval=0.5):
            raise AssertionError(f"job {job_id} after {timeout} s: {seen}\n{self.logs()}")
        return dict(seen)

    def logs(self, tail: int = 1500) -> str:
        """The end of every daemon log, for failure messages."""
        parts = []
        for path in sorted((self.root / "log").iterdir()):
            parts.append(f"--- {path.name} ---\n{path.read_text(errors='replace')[-tail:]}")
        return "\n".join(parts)

    def stop(self) -> None:
        """Kill the daemons, then every process that still carries this cluster's marker (job steps and
        tasks, srun clients), waiting for each; never raises."""
        for proc in reversed(self.daemons):  # slurmd before slurmctld, munged last
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.daemons):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        leftovers = marked_processes(str(self.root))
        for proc in leftovers:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(leftovers, timeout=10)


def marked_processes(root: str) -> list[psutil.Process]:
    """Every process (not this one) whose environment carries ``ROLL_SLURM_TEST_CLUSTER=root``."""
    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            if proc.environ().get(MARKER_ENV) == root:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def start_cluster(root: Path) -> SlurmCluster:
    """Start munged, slurmctld and two slurmd under ``root`` and wait until both nodes are idle.
    ClusterUnavailable (with the daemons' logs) when that does not happen within START_TIMEOUT."""
    reason = missing_requirements()
    if reason:
        raise ClusterUnavailable(reason)
    cluster = SlurmCluster(root=root, nodes=node_names())
    try:
        _start_daemons(cluster)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _start_daemons(cluster: SlurmCluster) -> None:
    root = cluster.root
    for sub in ("munge", "state", "run", "log", *(f"spool/{name}" for name in cluster.nodes)):
        (root / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(root / "munge", 0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o400)
    ports = (free_port(), free_port(), free_port())
    cluster.conf.write_text(slurm_conf(root, cluster.nodes, ports, random.randrange(1000, 4_000_000, 1000)))
    munge = root / "munge"
    _daemon(cluster, "munged", "--foreground", "--force", f"--key-file={key}", f"--socket={munge}/munge.socket",
            f"--pid-file={munge}/munged.pid", f"--log-file={root}/log/munged.log", f"--seed-file={munge}/seed")
    if not wait_until(lambda: (munge / "munge.socket").exists(), START_TIMEOUT, 0.1):
        raise ClusterUnavailable(f"munged did not start:\n{cluster.logs()}")
    _daemon(cluster, "slurmctld", "-D", "-i", "-f", str(cluster.conf))
    for name in cluster.nodes:
        _daemon(cluster, "slurmd", "-D", "-N", name, "-f", str(cluster.conf))

    def idle() -> bool:
        for proc in cluster.daemons:
            if proc.poll() is not None:
                raise ClusterUnavailable(f"{shlex.join(proc.args)} exited {proc.returncode}:\n{cluster.logs()}")
        out = cluster.command("sinfo", "--noheader", "--Node", "--format=%N %T")
        states = dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)
        return out.returncode == 0 and all(states.get(name) == "idle" for name in cluster.nodes)

    if not wait_until(idle, START_TIMEOUT, 0.5):
        state = cluster.command("sinfo", "--Node", "--long").stdout
        raise ClusterUnavailable(f"the nodes did not become idle in {START_TIMEOUT} s:\n{state}\n{cluster.logs()}")


def _daemon(cluster: SlurmCluster, name: str, *args: str) -> None:
    binary = shutil.which(name, path=_SEARCH_PATH)
    with open(cluster.root / "log" / f"{len(cluster.daemons)}-{name}.out", "ab") as log:
        cluster.daemons.append(subprocess.Popen([binary, *args], cwd=cluster.root, env=cluster.env(),
                                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                                start_new_session=True, preexec_fn=_die_with_pytest))


def _die_with_pytest() -> None:
    """In a daemon, before exec: SIGTERM when the test process dies (Linux), should it be killed before its
    teardown runs (a CI timeout)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1) -> None:
    """``wait_until`` that fails the test naming what it waited for."""
    start = time.monotonic()
    if not wait_until(predicate, timeout, interval):
        raise AssertionError(f"{what}: not after {time.monotonic() - start:.0f} s")
