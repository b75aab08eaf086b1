"""Which local address and interface reach a given host: what a process on a multi-homed node
must advertise to its peers (not the 127.0.0.1 its host name often resolves to)."""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def local_address_towards(host: str, port: int = 9) -> str:
    """This host's source address on the route to ``host`` (a UDP ``connect`` sends no packet)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except socket.gaierror:
        return "127.0.0.1"
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect(address)
        except OSError:  # no route: nothing better to offer than loopback
            return "127.0.0.1"
        return s.getsockname()[0]


def interface_of(address: str) -> str | None:
    """The name of the interface that holds IPv4 ``address`` (``None`` if none does, or not Linux)."""
    try:
        if ipaddress.ip_address(address).version != 4:
            return None
    except ValueError:
        return None
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
        if socket.inet_ntoa(raw[20:24]) == address:
            return name
    return None
