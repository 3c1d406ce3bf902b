"""Engine URLs: what the library accepts as a server's address, and when two addresses reach
the same server (an engine's identity in the router, the claims and the seam).

Part of the contract layer: plain string work, nothing resolved, nothing sent.
"""

from __future__ import annotations

import ipaddress
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
    if parts.query or parts.fragment:
        raise InvalidArgument(f"url {shown!r} must not have a query or fragment")
    return url.rstrip("/")


#: Host names that reach this machine's loopback interface.
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


def url_identity(url: object) -> str:
    """The server a URL reaches, for telling engines apart: ``scheme://host:port/path`` with
    every name and address of this machine's loopback (``localhost``, ``127.0.0.1``, ``::1``,
    ``0.0.0.0``) as one host ``loopback``, IP addresses in canonical form, host names lower
    case and the default port explicit. No name is resolved (nothing is looked up); raises
    ``InvalidArgument`` for what ``SGLangHTTPEngine`` would refuse."""
    parts = urlsplit(validate_url(url))
    host = (parts.hostname or "").lower().rstrip(".")
    try:
        address: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(host)
    except ValueError:
        address = None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if host in _LOOPBACK_NAMES or (
        address is not None and (address.is_loopback or address.is_unspecified)
    ):
        host = "loopback"
    elif address is not None:
        host = address.compressed
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{parts.scheme}://{host}:{port}{parts.path.rstrip('/')}"
