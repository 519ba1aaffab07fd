"""The Wyoming server announced over zeroconf (mDNS ``_wyoming._tcp``), as Home Assistant discovers it.

The service is announced once the server listens, and withdrawn (a goodbye packet) when it stops, so
Home Assistant neither tries a server still starting nor keeps one that is gone. It names the host's
addresses that the server listens on: the bind address itself, or, for a wildcard bind, every address
of the host except loopback. A server bound to loopback is announced on loopback only (Home Assistant
on the same host).

The name carries the host and the port. With ``--workers N`` every worker serves the port and tries to
announce the same service; mDNS probing finds the name taken by the first, and the others leave it at
that. Gateways on one host serve different ports, so each is announced under a name of its own.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from typing import Final

import ifaddr
from zeroconf import InterfaceChoice, IPVersion, NonUniqueNameException
from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

logger = logging.getLogger(__name__)

SERVICE_TYPE: Final = "_wyoming._tcp.local."
_WILDCARDS: Final = ("", "0.0.0.0", "::")


def service_name(port: int, hostname: str | None = None) -> str:
    """The instance name Home Assistant shows: unique per server on the network."""
    return f"tts-gateway on {hostname or socket.gethostname()}:{port}"


def announced_addresses(host: str) -> list[str]:
    """The IPv4 addresses a client reaches a server bound to ``host`` at (``::``: those of ``0.0.0.0``)."""
    if host in _WILDCARDS:
        found = [
            ip.ip
            for adapter in ifaddr.get_adapters()
            for ip in adapter.ips
            if isinstance(ip.ip, str) and not ipaddress.ip_address(ip.ip).is_loopback
        ]
        return sorted(set(found)) or ["127.0.0.1"]
    if ":" in host:
        raise ValueError(f"zeroconf announces IPv4 addresses; TTS_WYOMING_HOST {host!r} is IPv6 (bind 0.0.0.0)")
    return [socket.gethostbyname(host)]


def service_info(name: str, addresses: list[str], port: int) -> AsyncServiceInfo:
    return AsyncServiceInfo(
        SERVICE_TYPE,
        f"{name}.{SERVICE_TYPE}",
        parsed_addresses=addresses,
        port=port,
        server=f"{socket.gethostname()}.local.",
    )


class Announcement:
    """The zeroconf announcement of one server, from :meth:`start` to :meth:`stop`."""

    def __init__(self, host: str, port: int, name: str | None = None) -> None:
        self._addresses = announced_addresses(host)
        loopback = all(ipaddress.ip_address(address).is_loopback for address in self._addresses)
        self._interfaces = self._addresses if loopback else InterfaceChoice.All
        self._info = service_info(name or service_name(port), self._addresses, port)
        self._zeroconf: AsyncZeroconf | None = None

    @property
    def info(self) -> AsyncServiceInfo:
        return self._info

    async def start(self) -> None:
        self._zeroconf = AsyncZeroconf(interfaces=self._interfaces, ip_version=IPVersion.V4Only)
        try:
            await self._zeroconf.async_register_service(self._info)
        except NonUniqueNameException:
            logger.info("Wyoming service %r is already announced (by another worker)", self._info.name)
            return
        logger.info("Wyoming server announced over zeroconf as %r at %s", self._info.name, ", ".join(self._addresses))

    async def stop(self) -> None:
        if self._zeroconf is not None:
            await self._zeroconf.async_unregister_all_services()
            await self._zeroconf.async_close()
            self._zeroconf = None
