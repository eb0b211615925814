"""A real S3 API on localhost for the tests: moto's server, and a TCP proxy in front of it that drops connections."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from helpers import free_port


@contextmanager
def s3_server() -> Iterator[str]:
    """moto's S3 server on a free localhost port, for as long as the block runs; yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


class CuttingProxy:
    """Relays TCP connections to `upstream_port`; the first `cuts` GETs whose request line holds `needle` get the
    response headers and part of the body, then the connection is closed, as a dropped network would."""

    def __init__(self, upstream_port: int, needle: bytes, cuts: int, body_bytes: int = 300) -> None:
        self.upstream_port, self.needle, self.cuts_left, self.body_bytes = upstream_port, needle, cuts, body_bytes
        self.cut = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            cutting = threading.Event()  # set while the response to a request to cut is relayed
            threading.Thread(target=self._requests, args=(client, upstream, cutting), daemon=True).start()
            threading.Thread(target=self._responses, args=(upstream, client, cutting), daemon=True).start()

    def _requests(self, client: socket.socket, upstream: socket.socket, cutting: threading.Event) -> None:
        with client, upstream:
            while data := _receive(client):
                if data.startswith(b"GET ") and self.needle in data.split(b"\r\n", 1)[0]:
                    with self._lock:
                        if self.cuts_left > 0:
                            self.cuts_left -= 1
                            cutting.set()
                try:
                    upstream.sendall(data)
                except OSError:
                    return

    def _responses(self, upstream: socket.socket, client: socket.socket, cutting: threading.Event) -> None:
        relayed = b""
        while data := _receive(upstream):
            if cutting.is_set():
                relayed += data
                if (headers_end := relayed.find(b"\r\n\r\n")) >= 0:
                    client.sendall(relayed[: headers_end + 4 + self.body_bytes])
                    with self._lock:
                        self.cut += 1
                    for end in (client, upstream):
                        with contextlib.suppress(OSError):
                            end.shutdown(socket.SHUT_RDWR)
                        end.close()
                    return
                continue
            try:
                client.sendall(data)
            except OSError:
                return


def _receive(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536)
    except OSError:
        return b""
