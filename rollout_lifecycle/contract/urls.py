"""Engine URLs: what the library accepts as a server's address, and when two addresses reach
the same server (an engine's identity in the router, the claims and the seam).

Part of the contract layer: nothing is sent; a host name is resolved once per process (the
resolver of this machine, as the HTTP client's connect resolves it).
"""

from __future__ import annotations

import functools
import ipaddress
import re
import socket
from urllib.parse import urlsplit

from rollout_lifecycle.contract.exceptions import InvalidArgument

#: What a secret (a key, user info in a URL) is shown as in messages and logs.
MASK = "********"


def mask_userinfo(url: str) -> str:
    """``url`` with anything between ``//`` and ``@`` masked, for error messages."""
    scheme, sep, rest = url.partition("//")
    if not sep:
        return url
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        authority = f"{MASK}@{authority.rpartition('@')[2]}"
    return f"{scheme}{sep}{authority}{slash}{path}"


def validate_url(url: object) -> str:
    """The base URL without a trailing slash; refuses anything but ``http(s)://host[:port]/path``."""
    if not isinstance(url, str) or not url.strip():
        raise InvalidArgument(f"url must be a non-empty string, got {url!r}")
    shown = mask_userinfo(url)
    for i, char in enumerate(url):
        if char.isspace() or not char.isprintable():
            # (urlsplit drops a tab or newline without a word; the HTTP client refuses them)
            raise InvalidArgument(
                f"url {shown!r} holds whitespace or a control character ({char!r} at position "
                f"{i + 1}); give the server's URL alone, as http://HOST:PORT"
            )
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - parsing the port validates it
    except ValueError as exc:
        raise InvalidArgument(f"url {shown!r} is not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise InvalidArgument(f"url {shown!r} must start with http:// or https://")
    if "@" in parts.netloc:
        # A credential in the URL would reach logs, labels and reprs; keys go in admin_key/api_key.
        raise InvalidArgument(
            f"url {shown!r} must not carry user info; pass credentials as admin_key or api_key"
        )
    if not parts.hostname:
        raise InvalidArgument(f"url {shown!r} has no host")
    try:
        parts.hostname.encode("idna")
    except UnicodeError:
        raise InvalidArgument(
            f"url {shown!r}: {parts.hostname!r} is not a valid host name"
        ) from None
    if parts.query or parts.fragment:
        raise InvalidArgument(f"url {shown!r} must not have a query or fragment")
    return url.rstrip("/")


#: Host names that reach this machine's loopback interface, without asking a resolver.
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})
#: What every address of this machine is called in an engine's identity.
THIS_HOST = "this-host"
#: The characters of the numeric IPv4 forms ``inet_aton`` reads (``127.1``, ``2130706433``,
#: ``0x7f000001``, ``0177.0.0.1``): the resolver and so the HTTP client take them too.
_NUMERIC_V4 = re.compile(r"[0-9a-fx.]+")

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def _literal(host: str) -> Address | None:
    """``host`` as an IP address when it spells one (any numeric IPv4 form included)."""
    try:
        address: Address = ipaddress.ip_address(host)
    except ValueError:
        if not _NUMERIC_V4.fullmatch(host) or not host[0].isdigit():
            return None
        try:
            address = ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


@functools.lru_cache(maxsize=1024)
def _is_this_host(address: Address) -> bool:
    """Whether ``address`` is one of this machine's: loopback, unspecified (``0.0.0.0``, which
    a client's connect takes to this machine), or assigned to one of its interfaces (a socket
    can be bound to it)."""
    if address.is_loopback or address.is_unspecified:
        return True
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((str(address), 0))
        except OSError:
            return False
    return True


@functools.lru_cache(maxsize=1024)
def _resolved(name: str) -> tuple[Address, ...]:
    """The addresses a host name resolves to (empty when it does not resolve); looked up once
    per process."""
    try:
        found = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return ()
    out = {_literal(str(info[4][0]).partition("%")[0]) for info in found}
    return tuple(sorted((a for a in out if a is not None), key=lambda a: (a.version, a)))


def host_identity(host: str) -> str:
    """The machine ``host`` names, as an engine's identity spells it: ``this-host`` for every
    name and address of this machine (loopback, ``0.0.0.0``, its interfaces' addresses, its
    own host name), the canonical address for any other IP address in any spelling, the first
    address a host name resolves to (IPv4 first), or the lower-case name of one that does not
    resolve."""
    host = host.lower().rstrip(".")
    if host in _LOOPBACK_NAMES:
        return THIS_HOST
    address = _literal(host)
    addresses = (address,) if address is not None else _resolved(host)
    if any(_is_this_host(a) for a in addresses):
        return THIS_HOST
    return addresses[0].compressed if addresses else host


def url_identity(url: object) -> str:
    """The server a URL reaches, for telling engines apart: ``scheme://host:port/path`` with
    the host as ``host_identity`` names it (every spelling of this machine one host, IP
    addresses canonical, host names resolved) and the default port explicit. Raises
    ``InvalidArgument`` for what ``SGLangHTTPEngine`` would refuse.

    Two URLs with one identity reach one server. The converse does not hold (a port forward,
    a proxy): an engine's incarnation is what names its process once it has answered."""
    parts = urlsplit(validate_url(url))
    host = host_identity(parts.hostname or "")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{parts.scheme}://{host}:{port}{parts.path.rstrip('/')}"


__all__ = ["MASK", "THIS_HOST", "host_identity", "mask_userinfo", "url_identity", "validate_url"]
