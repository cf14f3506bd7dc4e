"""Which address and network interface KV senders and TP groups use.

Default: the node's IP as Ray sees it (`ray.util.get_node_ip_address()`) and the interface
that carries it, so decode ranks on other nodes can reach a prefill rank's store and gloo
pairs bind a routable device. Loopback only when configured (`host: 127.0.0.1`), e.g. tests
on one machine.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def interface_of(ip: str) -> str | None:
    """The name of the interface whose IPv4 address is `ip` (Linux), else None."""
    if ip in LOOPBACK_HOSTS or ipaddress.ip_address(socket.gethostbyname(ip)).is_loopback:
        return "lo"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                                  struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface
                continue
            if socket.inet_ntoa(raw[20:24]) == ip:
                return name
    return None


def node_ip() -> str:
    """This node's IP as Ray reports it (without Ray: the address of the default route)."""
    try:
        from ray.util import get_node_ip_address

        return get_node_ip_address()
    except Exception:  # Ray not initialised here: ask the kernel which source it would use
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect(("10.255.255.255", 1))  # no packet is sent for UDP connect
                return s.getsockname()[0]
            except OSError:
                return "127.0.0.1"


def resolve_kv_endpoint(host: str | None = None, interface: str | None = None
                        ) -> tuple[str, str]:
    """(host, interface) for this process: configured values win, else the node IP and the
    interface that carries it ('lo' only for a loopback host)."""
    host = host or node_ip()
    iface = interface or interface_of(host)
    if iface is None:
        raise RuntimeError(
            f"no network interface carries {host}; set kv_transfer.interface explicitly")
    return host, iface
