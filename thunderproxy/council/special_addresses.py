"""The IANA special-purpose address registries, as data: every block with its name, its RFC
and the registry's "Globally Reachable" column, so the council's address check decides the
same on every Python (``ipaddress``'s ``is_global`` and ``is_private`` follow tables that
changed between patch releases of one Python version).

Transcribed from https://www.iana.org/assignments/iana-ipv4-special-registry/ and
https://www.iana.org/assignments/iana-ipv6-special-registry/, plus the multicast blocks of the
IPv4 and IPv6 address-space registries, which the special-purpose registries leave out. When
IANA adds an entry, add it here and a case for it to ``tests/council/test_tools.py`` (a test there
checks that every entry has one).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

IPV4_REGISTRY = "IANA IPv4 Special-Purpose Address Registry"
IPV6_REGISTRY = "IANA IPv6 Special-Purpose Address Registry"


@dataclass(frozen=True)
class Entry:
    """One block of a registry. ``globally_reachable`` is the registry's column: None where it
    says N/A (6to4, Teredo, the deprecated blocks) or has no such column (multicast)."""

    block: IPNetwork
    name: str
    rfc: str
    globally_reachable: bool | None
    registry: str


def _registry(
    registry: str, rows: tuple[tuple[str, str, str, bool | None], ...]
) -> tuple[Entry, ...]:
    return tuple(
        Entry(ipaddress.ip_network(block), name, rfc, reachable, registry)
        for block, name, rfc, reachable in rows
    )


# Address block, name, RFC, Globally Reachable (None: N/A), in the registry's order.
IPV4_SPECIAL_PURPOSE = _registry(
    IPV4_REGISTRY,
    (
        ("0.0.0.0/8", '"This network"', "RFC 791, Section 3.2", False),
        ("0.0.0.0/32", '"This host on this network"', "RFC 1122, Section 3.2.1.3", False),
        ("10.0.0.0/8", "Private-Use", "RFC 1918", False),
        ("100.64.0.0/10", "Shared Address Space", "RFC 6598", False),
        ("127.0.0.0/8", "Loopback", "RFC 1122, Section 3.2.1.3", False),
        ("169.254.0.0/16", "Link Local", "RFC 3927", False),
        ("172.16.0.0/12", "Private-Use", "RFC 1918", False),
        ("192.0.0.0/24", "IETF Protocol Assignments", "RFC 6890, Section 2.1", False),
        ("192.0.0.0/29", "IPv4 Service Continuity Prefix", "RFC 7335", False),
        ("192.0.0.8/32", "IPv4 dummy address", "RFC 7600", False),
        ("192.0.0.9/32", "Port Control Protocol Anycast", "RFC 7723", True),
        ("192.0.0.10/32", "Traversal Using Relays around NAT Anycast", "RFC 8155", True),
        # One entry of the registry, two blocks.
        ("192.0.0.170/32", "NAT64/DNS64 Discovery", "RFC 8880, RFC 7050", False),
        ("192.0.0.171/32", "NAT64/DNS64 Discovery", "RFC 8880, RFC 7050", False),
        ("192.0.2.0/24", "Documentation (TEST-NET-1)", "RFC 5737", False),
        ("192.31.196.0/24", "AS112-v4", "RFC 7535", True),
        ("192.52.193.0/24", "AMT", "RFC 7450", True),
        ("192.88.99.0/24", "Deprecated (6to4 Relay Anycast)", "RFC 7526", None),
        ("192.88.99.2/32", "6a44-relay anycast address", "RFC 6751", False),
        ("192.168.0.0/16", "Private-Use", "RFC 1918", False),
        ("192.175.48.0/24", "Direct Delegation AS112 Service", "RFC 7534", True),
        ("198.18.0.0/15", "Benchmarking", "RFC 2544", False),
        ("198.51.100.0/24", "Documentation (TEST-NET-2)", "RFC 5737", False),
        ("203.0.113.0/24", "Documentation (TEST-NET-3)", "RFC 5737", False),
        ("240.0.0.0/4", "Reserved", "RFC 1112, Section 4", False),
        ("255.255.255.255/32", "Limited Broadcast", "RFC 8190, RFC 919", False),
    ),
)

IPV6_SPECIAL_PURPOSE = _registry(
    IPV6_REGISTRY,
    (
        ("::1/128", "Loopback Address", "RFC 4291", False),
        ("::/128", "Unspecified Address", "RFC 4291", False),
        ("::ffff:0:0/96", "IPv4-mapped Address", "RFC 4291", False),
        ("64:ff9b::/96", "IPv4-IPv6 Translat.", "RFC 6052", True),
        ("64:ff9b:1::/48", "IPv4-IPv6 Translat.", "RFC 8215", False),
        ("100::/64", "Discard-Only Address Block", "RFC 6666", False),
        ("100:0:0:1::/64", "Dummy IPv6 Prefix", "RFC 9780", False),
        ("2001::/23", "IETF Protocol Assignments", "RFC 2928", False),
        ("2001::/32", "TEREDO", "RFC 4380, RFC 8190", None),
        ("2001:1::1/128", "Port Control Protocol Anycast", "RFC 7723", True),
        ("2001:1::2/128", "Traversal Using Relays around NAT Anycast", "RFC 8155", True),
        ("2001:1::3/128", "DNS-SD Service Registration Protocol Anycast", "RFC 9665", True),
        ("2001:2::/48", "Benchmarking", "RFC 5180", False),
        ("2001:3::/32", "AMT", "RFC 7450", True),
        ("2001:4:112::/48", "AS112-v6", "RFC 7535", True),
        ("2001:10::/28", "Deprecated (previously ORCHID)", "RFC 4843", None),
        ("2001:20::/28", "ORCHIDv2", "RFC 7343", True),
        ("2001:30::/28", "Drone Remote ID Protocol Entity Tags (DETs) Prefix", "RFC 9374", True),
        ("2001:db8::/32", "Documentation", "RFC 3849", False),
        ("2002::/16", "6to4", "RFC 3056", None),
        ("2620:4f:8000::/48", "Direct Delegation AS112 Service", "RFC 7534", True),
        ("3fff::/20", "Documentation", "RFC 9637", False),
        ("5f00::/16", "Segment Routing (SRv6) SIDs", "RFC 9602", False),
        ("fc00::/7", "Unique-Local", "RFC 4193, RFC 8190", False),
        ("fe80::/10", "Link-Local Unicast", "RFC 4291", False),
    ),
)

#: Not in the special-purpose registries: the multicast space of the address-space registries.
MULTICAST = (
    Entry(
        ipaddress.ip_network("224.0.0.0/4"),
        "Multicast",
        "RFC 5771",
        None,
        "IPv4 Multicast Address Space Registry",
    ),
    Entry(
        ipaddress.ip_network("ff00::/8"),
        "Multicast",
        "RFC 4291",
        None,
        "IPv6 Multicast Address Space Registry",
    ),
)

ENTRIES: tuple[Entry, ...] = (*IPV4_SPECIAL_PURPOSE, *IPV6_SPECIAL_PURPOSE, *MULTICAST)


def entry_for(ip: IPAddress) -> Entry | None:
    """The most specific entry whose block holds ``ip`` (the registries nest: 192.0.0.9/32 is
    globally reachable inside 192.0.0.0/24, which is not), None for an ordinary address."""
    found: Entry | None = None
    for entry in ENTRIES:
        if ip in entry.block and (found is None or entry.block.prefixlen > found.block.prefixlen):
            found = entry
    return found
