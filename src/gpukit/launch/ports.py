"""TCP ports for the launchers' rendezvous: a free one, or a check that the one asked for is."""

from __future__ import annotations

import socket

from gpukit.errors import ConfigError


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def check_port(host: str, port: int) -> None:
    """Raise ConfigError when ``port`` on ``host`` is taken (a rendezvous would hang or fail)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as err:
            raise ConfigError(
                f"port {port} on {host} is already in use ({err.strerror}): pick another "
                "with --master-port, or leave it out to get a free one"
            ) from None
