"""The server's listening socket, in a module that imports nothing heavy: `runtime serve`
binds it before importing torch and the engine, so a port in use fails in well under a second
instead of after several seconds of imports (and minutes of loading)."""

from __future__ import annotations

import socket


def listen_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads: a port in use must fail in a second,
    not after minutes of loading, warm-up and graph capture. Bound as uvicorn binds it (IPv6
    for a host with a colon, SO_REUSEADDR), and handed to it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(
            f"cannot listen on {host}:{port}: {e.strerror or e}; choose another --server-port "
            "(or --server-name), or stop the process that holds it"
        ) from e
    sock.set_inheritable(True)
    return sock
