"""roll.slurm: SLURM's host lists and variables mapped to the launcher's, every precedence rule, and the
requeued job's resume default. Each expected value is written out by hand from SLURM's documented formats."""

from __future__ import annotations

import os

import pytest
import yaml

from roll import cli, slurm
from roll.config import parse_args
from roll.errors import ConfigError

JOB = {"SLURM_JOB_ID": "4321", "SLURM_STEP_ID": "0"}
PORT = 15000 + 4321 % 2000 * 10  # job_port's rule, by hand: 15000 + (job mod 2000) * 10 + step


@pytest.mark.parametrize("text, hosts", [
    ("localhost", ["localhost"]),
    ("gpu[01-04,07]", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]),
    ("a-[1-2]b", ["a-1b", "a-2b"]),
    ("x1,y[3-4],z[1,09-10]", ["x1", "y3", "y4", "z1", "z09", "z10"]),
    ("n[1-2]-[5-6]", ["n1-5", "n1-6", "n2-5", "n2-6"]),
    ("node[8]", ["node8"]),
])
def test_hostlists_expand_as_slurm_writes_them(text, hosts):
    assert slurm.expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["n[1-2", "n1-2]", "n[[1-2]]", "n[a-b]", "n[3-1]", "n[1-]", ","])
def test_a_malformed_hostlist_names_the_variable(text):
    with pytest.raises(ConfigError, match="SLURM_STEP_NODELIST") as err:
        slurm.expand_hostlist(text)
    assert "MASTER_ADDR" in str(err.value) or "no host" in str(err.value)


def test_tasks_per_node_lists_expand():
    assert slurm.expand_counts("2(x3),1") == [2, 2, 2, 1]
    assert slurm.expand_counts("4") == [4]


def test_the_port_follows_the_job_and_step():
    assert slurm.job_port("4321") == PORT and slurm.job_port("4321", "3") == PORT + 3
    assert slurm.job_port("4322") != slurm.job_port("4321")
    assert 15000 <= slurm.job_port("99999999", "9") < 35000


def _task(procid: int, localid: int, nodeid: int, ntasks: int = 4, nodes: str = "gpu[01-02]",
          per_node: str = "2(x2)", **extra: str) -> dict[str, str]:
    return {**JOB, "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(localid), "SLURM_NODEID": str(nodeid),
            "SLURM_STEP_NUM_TASKS": str(ntasks), "SLURM_STEP_NUM_NODES": "2", "SLURM_NNODES": "2",
            "SLURM_STEP_NODELIST": nodes, "SLURM_JOB_NODELIST": nodes, "SLURM_STEP_TASKS_PER_NODE": per_node,
            "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo", **extra}


def test_one_task_per_rank_gets_torchruns_variables():
    env = _task(procid=3, localid=1, nodeid=1)
    taken = slurm.adopt({}, env)
    want = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
            "MASTER_ADDR": "gpu01", "MASTER_PORT": str(PORT)}
    assert taken == want and {k: env[k] for k in want} == want


def test_what_the_user_set_wins():
    # torchrun's variables already set (a launcher placed this process): SLURM's are not read at all
    env = _task(procid=1, localid=1, nodeid=0, RANK="0", WORLD_SIZE="8", LOCAL_RANK="0")
    assert slurm.adopt({}, env) == {} and env["RANK"] == "0"
    # MASTER_ADDR / MASTER_PORT from the environment are kept; the recipe's keys win over both
    env = _task(procid=1, localid=1, nodeid=0, MASTER_ADDR="10.0.0.9", MASTER_PORT="2222")
    assert slurm.adopt({}, env)["MASTER_ADDR"] == "10.0.0.9" and env["MASTER_PORT"] == "2222"
    env = _task(procid=1, localid=1, nodeid=0, MASTER_ADDR="10.0.0.9", MASTER_PORT="2222")
    taken = slurm.adopt({"master_addr": "head", "master_port": 3333}, env)
    assert (taken["MASTER_ADDR"], taken["MASTER_PORT"]) == ("head", "3333")


def test_one_task_per_node_launches_its_ranks_as_one_node_of_the_job():
    env = _task(procid=1, localid=0, nodeid=1, ntasks=2, per_node="1(x2)")
    taken = slurm.adopt({"nproc_per_node": 4}, env)
    assert taken == {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "gpu01", "MASTER_PORT": str(PORT)}
    assert "RANK" not in env and "WORLD_SIZE" not in env  # roll-train launches its ranks itself
    env = _task(procid=1, localid=0, nodeid=1, ntasks=2, per_node="1(x2)", NODE_RANK="1", MASTER_PORT="2222")
    assert slurm.adopt({"nproc_per_node": 4}, env) == {"NNODES": "2", "MASTER_ADDR": "gpu01"}
    with pytest.raises(ConfigError, match="--ntasks-per-node=1"):  # two tasks per node, each launching 4
        slurm.adopt({"nproc_per_node": 4}, _task(procid=1, localid=1, nodeid=0))
    # a recipe written for 2 processes per node, under srun with 2 tasks per node: each task is a rank
    assert slurm.adopt({"nproc_per_node": 2}, _task(procid=1, localid=1, nodeid=0))["RANK"] == "1"


def test_one_task_or_the_batch_shell_is_left_as_today():
    one = _task(procid=0, localid=0, nodeid=0, ntasks=1, nodes="n1", per_node="1")
    assert slurm.adopt({}, one) == {} and "RANK" not in one
    batch = {**JOB, "SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_JOB_NODELIST": "n[1-2]"}
    del batch["SLURM_STEP_ID"]  # the batch script of `sbatch -n 2`: no step
    assert slurm.adopt({}, batch) == {} and slurm.adopt({}, {}) == {}
    # an older srun without SLURM_STEP_NUM_TASKS: SLURM_NTASKS inside a step
    older = {**JOB, "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NODEID": "0",
             "SLURM_JOB_NODELIST": "localhost", "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    assert slurm.adopt({}, older)["WORLD_SIZE"] == "2"


@pytest.fixture
def environ_restored():
    saved = dict(os.environ)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "NNODES", "NODE_RANK", "SLURM_RESTART_COUNT"):
        os.environ.pop(var, None)
    yield os.environ
    os.environ.clear()
    os.environ.update(saved)


def test_roll_train_under_srun_resolves_the_whole_step(environ_restored, capsys):
    """``srun -n 2 roll-train R --use-mca tensor_model_parallel_size=2`` is one run of world size 2 (today
    each task alone: tp(2) * ... != world_size(1)); ``--ntasks-per-node=1`` with nproc_per_node=2 is node 1
    of 2 nodes."""
    environ_restored.update(_task(procid=1, localid=1, nodeid=0, ntasks=2, nodes="localhost", per_node="2"))
    argv = ["recipes/demo/tiny_sft.yaml", "--use-mca", "tensor_model_parallel_size=2", "--print-config"]
    assert cli.main(argv) == 0
    assert yaml.safe_load(capsys.readouterr().out)["layout"]["world_size"] == 2
    environ_restored.update(_task(procid=1, localid=0, nodeid=1, ntasks=2, nodes="n[1-2]", per_node="1(x2)"))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        environ_restored.pop(var)
    assert cli.main(["recipes/demo/tiny_sft.yaml", "nproc_per_node=2", "--print-config"]) == 0
    training = yaml.safe_load(capsys.readouterr().out)["training"]
    assert (training["nnodes"], training["node_rank"], training["master_addr"]) == (2, 1, "n1")
    assert training["master_port"] == PORT


def test_a_requeued_job_resumes_by_default(environ_restored):
    recipe = "recipes/demo/tiny_sft.yaml"
    assert parse_args([recipe])[1].training.resume_from_checkpoint is None
    environ_restored["SLURM_RESTART_COUNT"] = "1"
    assert parse_args([recipe])[1].training.resume_from_checkpoint == "auto"
    explicit = parse_args([recipe, "resume_from_checkpoint=false"])[1].training  # the user's key wins
    assert explicit.resume_from_checkpoint == "false"
    environ_restored["SLURM_RESTART_COUNT"] = "0"
    assert parse_args([recipe])[1].training.resume_from_checkpoint is None


def test_sbatch_prints_a_script_for_the_command(environ_restored, capsys, tmp_path):
    argv = ["recipes/demo/tiny_sft.yaml", "nproc_per_node=2", "--nnodes", "3", "--sbatch",
            "master_port=29400", "learning_rate=1e-4", "--use-mca"]
    assert cli.main(argv) == 0
    script = capsys.readouterr().out
    for line in ("#SBATCH --nodes=3", "#SBATCH --ntasks-per-node=2", "#SBATCH --gpus-per-node=2",
                 "#SBATCH --signal=B:USR1@300", "#SBATCH --requeue", "#SBATCH --open-mode=append",
                 "exec srun roll-train recipes/demo/tiny_sft.yaml nproc_per_node=2 learning_rate=1e-4 "
                 "--use-mca slurm_signal=USR1 slurm_requeue=true"):
        assert line + "\n" in script, script
    (tmp_path / "job.sh").write_text(script)
    import subprocess

    assert subprocess.run(["bash", "-n", str(tmp_path / "job.sh")], timeout=30).returncode == 0
    assert cli.main(["recipes/demo/tiny_sft.yaml", "--sbatch", "slurm_signal=USR2"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("exec srun roll-train recipes/demo/tiny_sft.yaml "
                                                     "slurm_signal=USR2")


def test_the_mapping_reaches_the_current_os_environ(environ_restored, monkeypatch):
    """datasets' ``map(num_proc=...)`` (5.2) ends by assigning a copy to ``os.environ``: a default argument
    bound to the old object at import sent the mapping nowhere (``roll-train`` then ran as world size 1 when
    a LLaMA-Factory recipe's dry run had tokenized in the same process before)."""
    # what datasets does (with a copy of os.environ; a plain dict here, so nothing reaches the real environment)
    monkeypatch.setattr(os, "environ", dict(os.environ))
    os.environ.update(_task(procid=1, localid=1, nodeid=0, ntasks=2, nodes="localhost", per_node="2"))
    assert slurm.read_task() is not None
    assert slurm.adopt({})["WORLD_SIZE"] == "2" and os.environ["WORLD_SIZE"] == "2"
