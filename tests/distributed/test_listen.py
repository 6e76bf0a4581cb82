"""Where a run listens (roll.listen): every socket a one-node run's processes listen on is bound to loopback.

PyTorch's own listeners bind to every interface (the rendezvous store on ``::``), reachable from the network
with no authentication; roll binds them to master_addr. The test watches the listening sockets of every
process of a real run (roll-train, the launcher, the ranks) while it trains.
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
import sys
import time

import pytest

from tests.helpers import REPO, clean_env

psutil = pytest.importorskip("psutil")

ROWS = [{"instruction": f"What is {a} plus {b}?", "input": "", "output": f"{a} plus {b} equals {a + b}."}
        for a in range(4) for b in range(4)]


def _listening(root: int) -> set[tuple[str, str, int]]:
    """(process name, address, port) of every listening TCP socket of ``root`` and its descendants."""
    found = set()
    try:
        procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    except psutil.Error:
        return found
    for proc in procs:
        try:
            cmd = " ".join(proc.cmdline()[1:4])
            found |= {(cmd, conn.laddr.ip, conn.laddr.port) for conn in proc.net_connections(kind="inet")
                      if conn.status == psutil.CONN_LISTEN}
        except psutil.Error:
            pass
    return found


def _run_watching(args: list[str], timeout: float) -> tuple[subprocess.CompletedProcess, set]:
    proc = subprocess.Popen([sys.executable, "-m", "roll.cli", *args], cwd=REPO, env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: set = set()
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            seen |= _listening(proc.pid)
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
        out, _ = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, ""), seen


@pytest.mark.parametrize("extra, rendezvous_by", [
    pytest.param(["nproc_per_node=2"], "-m roll.torchrun", id="torchrun-2"),
    pytest.param(["nproc_per_node=2", "deepspeed=recipes/deepspeed/ds_z2.json"], "-m roll.cli",
                 id="deepspeed-2"),
])
def test_a_run_listens_on_loopback_only(tiny_model_dir, tmp_path, extra, rendezvous_by):
    data = tmp_path / "sft.json"
    data.write_text(json.dumps(ROWS))
    args = [f"model_name_or_path={tiny_model_dir}", "stage=sft", f"dataset={data}",
            f"output_dir={tmp_path / 'out'}", "max_steps=4", "cutoff_len=64", "per_device_train_batch_size=1",
            "report_to=none", "save_strategy=no", *extra]
    proc, seen = _run_watching(args, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    exposed = [entry for entry in seen if not ipaddress.ip_address(entry[1].split("%")[0]).is_loopback]
    assert not exposed, f"listening beyond loopback: {exposed}"
    # The rendezvous store (in the launcher or in roll-train) and the ranks' gloo listeners were seen, so the
    # check above looked at a running job, not at an empty list.
    assert any(cmd.startswith(rendezvous_by) for cmd, _, _ in seen), seen
    assert len({port for cmd, _, port in seen if cmd.startswith("-u -m roll.cli")}) >= 2, seen


def test_collectives_are_pointed_at_master_addr_interface():
    from roll.listen import collective_env, interface_of

    loopback = interface_of("127.0.0.1")
    assert loopback is not None
    assert any(entry.address == "127.0.0.1" for entry in psutil.net_if_addrs()[loopback])
    assert collective_env("127.0.0.1", {}) == {"GLOO_SOCKET_IFNAME": loopback, "NCCL_SOCKET_IFNAME": loopback}
    # A user's own choice wins.
    assert collective_env("127.0.0.1", {"NCCL_SOCKET_IFNAME": "ib0"}) == {"GLOO_SOCKET_IFNAME": loopback}


def test_a_store_for_an_address_not_of_this_machine_falls_back_with_a_warning(caplog):
    from roll.listen import listening_socket

    assert listening_socket("192.0.2.1", 0) is None  # TEST-NET-1: never a local address
    assert "every interface" in caplog.text
    sock = listening_socket("127.0.0.1", 0)
    assert sock is not None and sock.getsockname()[0] == "127.0.0.1"
    sock.close()
