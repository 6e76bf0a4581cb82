"""Where a run listens: the rendezvous store and the collectives bind to one address, not every interface.

PyTorch's TCPStore server listens on ``::`` (every interface, no authentication) whatever address it is
given, and gloo picks the address the machine's hostname resolves to. A store reachable from the network lets
anyone who can reach the port read and write the job's rendezvous keys. So roll:

- opens the store's listening socket itself, bound to ``master_addr`` (127.0.0.1 on one node, node 0's
  address across nodes), and hands it to TCPStore (``master_listen_fd``): under torchrun by replacing the
  store its static rendezvous creates (``roll.torchrun``); under the DeepSpeed launcher by hosting the store
  in roll-train itself, the ranks connecting as clients (``TORCHELASTIC_USE_AGENT_STORE``);
- points gloo and NCCL at the interface that holds that address (``GLOO_SOCKET_IFNAME``,
  ``NCCL_SOCKET_IFNAME``), unless the user set them.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from datetime import timedelta

logger = logging.getLogger(__name__)

AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
"""With "True", every rank's env:// rendezvous is a client of a store someone else hosts (PyTorch's name)."""

INTERFACE_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(resolve(host)).is_loopback
    except ValueError:
        return False


def resolve(host: str) -> str:
    """``host`` as an IP address (the first one it resolves to); unchanged when it does not resolve."""
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError:
        return host


def listening_socket(host: str, port: int) -> socket.socket | None:
    """A TCP socket listening on ``host:port`` only; None (with a warning) when ``host`` is not an address
    of this machine, so the caller falls back to PyTorch's own (every-interface) listener."""
    address = resolve(host)
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        logger.warning("cannot listen on %s:%d only (%s); the rendezvous store listens on every interface",
                       host, port, exc.strerror or exc)
        return None
    return sock


def bound_store(host: str, port: int, *, world_size: int | None = None, is_master: bool = True,
                timeout: timedelta = timedelta(minutes=30), multi_tenant: bool = True,
                wait_for_workers: bool = False):
    """A TCPStore whose server (``is_master``) listens on ``host:port`` only; a client otherwise."""
    from torch.distributed import TCPStore

    sock = listening_socket(host, port) if is_master else None
    extra = {} if sock is None else {"master_listen_fd": sock.detach(), "use_libuv": True}
    return TCPStore(host, port, world_size, is_master, timeout, wait_for_workers=wait_for_workers,
                    multi_tenant=multi_tenant, **extra)


def interface_of(host: str) -> str | None:
    """The name of this machine's network interface that reaches ``host`` (the loopback one for 127.0.0.1)."""
    address = resolve(host)
    if not is_loopback(address):
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:  # no packet is sent: only the route
                probe.connect((address, 9))
                address = probe.getsockname()[0]
        except OSError:
            return None
    try:
        import psutil
    except ImportError:
        return None
    for name, addresses in psutil.net_if_addrs().items():
        if any(entry.address.split("%")[0] == address for entry in addresses):
            return name
    return None


def collective_env(master_addr: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` for ``master_addr``'s interface, except those the user
    set (``environ``, default os.environ)."""
    environ = os.environ if environ is None else environ
    wanted = [key for key in INTERFACE_ENV if not environ.get(key)]
    name = interface_of(master_addr) if wanted else None
    if name is None:
        if wanted:
            logger.warning("found no network interface for master_addr %s; gloo and NCCL choose their own "
                           "(set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to pin them)", master_addr)
        return {}
    return {key: name for key in wanted}


def patch_torchrun_store() -> None:
    """Make torchrun's static rendezvous (single node, or ``--nnodes`` with ``--master_addr``) listen on
    master_addr only. PyTorch 2.13 creates ``TCPStore(master_addr, port, ...)``, which listens on every
    interface; it can go once TCPStore binds to the host it is given."""
    from torch.distributed.elastic.rendezvous import static_tcp_rendezvous

    if getattr(static_tcp_rendezvous.TCPStore, "_roll_bound", False):
        return

    def store(host, port, world_size=None, is_master=False, timeout=timedelta(minutes=5), multi_tenant=False,
              **kwargs):
        if kwargs or not is_master:
            from torch.distributed import TCPStore

            return TCPStore(host, port, world_size, is_master, timeout, multi_tenant=multi_tenant, **kwargs)
        return bound_store(host, port, world_size=world_size, timeout=timeout, multi_tenant=multi_tenant,
                           wait_for_workers=True)

    store._roll_bound = True
    static_tcp_rendezvous.TCPStore = store
