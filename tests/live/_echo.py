"""A loopback echo service on threads of the test's own: the user's own TCP service that a recovery must
leave alone (its connections keep answering through every fault)."""

from __future__ import annotations

import socket
import threading


class EchoService:
    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        with conn:
            try:
                for data in iter(lambda: conn.recv(256), b""):
                    conn.sendall(data)
            except OSError:
                return

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=5)

    def close(self) -> None:
        self.server.close()
