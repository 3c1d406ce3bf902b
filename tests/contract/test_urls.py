"""Engine URLs (``contract/urls``): what is accepted, and which spellings reach one server."""

from __future__ import annotations

import fcntl
import socket
import struct

import pytest

from rollout_lifecycle import InvalidArgument
from rollout_lifecycle.contract.urls import THIS_HOST, host_identity, url_identity, validate_url

#: ioctl SIOCGIFADDR: an interface's IPv4 address (Linux).
_SIOCGIFADDR = 0x8915


def interface_addresses() -> list[str]:
    """The IPv4 addresses of this machine's interfaces other than loopback (a node's IP)."""
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(
                    probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode())
                )
            except OSError:
                continue  # no IPv4 address
            address = socket.inet_ntoa(packed[20:24])
            if not address.startswith("127."):
                found.append(address)
    return found


#: Spellings of 127.0.0.1 a fleet may use for an engine served there: this host's name, the
#: resolver's short and numeric forms, and a node's IP (its interfaces' addresses).
OTHER_SPELLINGS = [
    socket.gethostname(),
    "127.1",
    "2130706433",
    "0x7f000001",
    *interface_addresses(),
]


SPELLINGS_OF_THIS_HOST = [
    "127.0.0.1",
    "localhost",
    "LOCALHOST.",
    "127.1",  # the resolver's short forms, which the HTTP client's connect takes too
    "2130706433",
    "0x7f000001",
    "0177.0.0.1",
    "127.0.0.2",
    "[::1]",
    "[::ffff:127.0.0.1]",
    "0.0.0.0",
    socket.gethostname(),
    *interface_addresses(),
]


@pytest.mark.parametrize("host", SPELLINGS_OF_THIS_HOST)
def test_every_spelling_of_this_machine_is_one_host(host: str) -> None:
    assert url_identity(f"http://{host}:30000/") == f"http://{THIS_HOST}:30000"
    assert url_identity(f"http://{host}:30000") == url_identity("http://127.0.0.1:30000")


def test_a_node_ip_of_this_machine_is_this_host() -> None:
    nodes = interface_addresses()
    if not nodes:
        pytest.skip("this machine has no interface address other than loopback")
    assert host_identity(nodes[0]) == THIS_HOST


@pytest.mark.parametrize(
    ("url", "identity"),
    [
        ("http://10.1.2.3:30000", "http://10.1.2.3:30000"),
        ("http://10.1.2.3", "http://10.1.2.3:80"),
        ("https://10.1.2.3", "https://10.1.2.3:443"),
        ("http://[::ffff:10.1.2.3]:5", "http://10.1.2.3:5"),
        ("http://167838211:5", "http://10.1.2.3:5"),  # 10.1.2.3 as one number
        ("http://[2001:DB8::1]:5", "http://2001:db8::1:5"),
        ("http://no-such-host.invalid:5/v1/", "http://no-such-host.invalid:5/v1"),
    ],
)
def test_other_hosts_keep_a_canonical_name(url: str, identity: str) -> None:
    assert url_identity(url) == identity


def test_other_hosts_and_other_ports_are_other_servers() -> None:
    assert url_identity("http://10.1.2.3:30000") != url_identity("http://10.1.2.4:30000")
    assert url_identity("http://127.0.0.1:30000") != url_identity("http://127.0.0.1:30001")
    assert url_identity("http://127.0.0.1:30000") != url_identity("https://127.0.0.1:30000")


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:30000\n",  # what $(cat file) keeps of a file with CRLF
        "http://127.0.0.1:30000\r",
        " http://127.0.0.1:30000",
        "http://127.0.0.1:3\n0000",
        "http://127.0.0.1:30000/a b",
        "http://127.0.0.1:30000/\x00",
    ],
)
def test_a_url_holding_whitespace_or_a_control_character_is_refused_naming_where(
    url: str,
) -> None:
    with pytest.raises(InvalidArgument, match=r"whitespace or a control character .* at position"):
        validate_url(url)
    with pytest.raises(InvalidArgument):
        url_identity(url)
