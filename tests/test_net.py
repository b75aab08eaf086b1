"""``utils/net.py`` and its users: what a process advertises to peers on other hosts."""

from __future__ import annotations

import ipaddress
import os

import pytest

from specdraft.utils.net import interface_of, local_address_towards


def routed_address() -> str:
    address = local_address_towards("192.0.2.1")  # TEST-NET-1: a UDP connect sends nothing
    if ipaddress.ip_address(address).is_loopback:
        pytest.skip("this host has no route off loopback")
    return address


def test_loopback_is_reached_from_loopback():
    assert local_address_towards("127.0.0.1") == "127.0.0.1"
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("not-an-address") is None


def test_mooncake_clients_advertise_their_address_towards_the_master():
    from specdraft.integrations.mooncake.client import MooncakeClientConfig

    own = routed_address()
    assert MooncakeClientConfig(master=f"{own}:50051").local_hostname == own  # was 127.0.0.1: unreachable from peers
    assert MooncakeClientConfig(master="127.0.0.1:50051").local_hostname == "127.0.0.1"
    assert MooncakeClientConfig(master=f"{own}:50051", local_hostname="10.9.9.9").local_hostname == "10.9.9.9"


def test_gloo_uses_the_interface_that_reaches_the_rendezvous_host(monkeypatch):
    from specdraft.train import distributed

    own = routed_address()
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("MASTER_ADDR", own)
    distributed.gloo_interface()
    assert os.environ["GLOO_SOCKET_IFNAME"] == interface_of(own) != "lo"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "mine0")
    distributed.gloo_interface()
    assert os.environ["GLOO_SOCKET_IFNAME"] == "mine0"  # the user's choice wins
