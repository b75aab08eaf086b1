"""Addresses and sockets as a node of a cluster sees them.

``local_address_towards`` / ``interface_of``: which local address and interface reach a given host,
what a process on a multi-homed node must advertise to its peers (not the 127.0.0.1 its host name
often resolves to). ``listening_sockets`` reads ``/proc/net/tcp{,6}`` for the sockets a process
holds, so code that links a library which binds on its own (Mooncake's transfer engine) can say
what it exposes.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct

from specdraft.errors import SpecdraftError, setting

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


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def require_token_beyond_loopback(host: str, token: str | None) -> None:
    """A server bound beyond loopback (``--host``) is reachable from other machines: refuse it without ``--token``."""
    if not token and not is_loopback(host):
        raise SpecdraftError(
            f"{setting('host')} {host} is reachable from other machines: pass {setting('token')} SECRET (clients send "
            f"it as a bearer token) "
            "or bind 127.0.0.1"
        )


def _proc_address(hex_addr: str) -> tuple[str, int]:
    """``0100007F:1F90`` (/proc/net/tcp, host byte order per 32-bit word) -> ("127.0.0.1", 8080)."""
    addr, port = hex_addr.split(":")
    raw = bytes.fromhex(addr)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, words), int(port, 16)


def listening_sockets(pid: int | None = None) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state that process ``pid`` (default: this one) holds."""
    pid = os.getpid() if pid is None else pid
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/net/{table}") as listing:
                lines = listing.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A = TCP_LISTEN
                found.append(_proc_address(fields[1]))
    return sorted(set(found))


def wildcard_listeners(pid: int | None = None) -> list[int]:
    """Ports that process ``pid`` listens on for every interface (0.0.0.0 or ::)."""
    return sorted({port for addr, port in listening_sockets(pid) if ipaddress.ip_address(addr).is_unspecified})
