"""A TCP forwarder that plays a Kubernetes Service in tests: each new connection goes to the
backend `backend_port` names when it is accepted (the Service's Ready endpoints); connections
already made stay where they are, as kube-proxy's do."""
from __future__ import annotations

import socket
import threading


class ServiceProxy:
    def __init__(self, backend_port: int):
        self.backend_port = backend_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "ServiceProxy":
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sockets, self._sockets = self._sockets, []
        for s in [self._listener, *sockets]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                backend = socket.create_connection(("127.0.0.1", self.backend_port))
            except OSError:
                client.close()  # no endpoint: the connection is refused, as a Service's would be
                continue
            with self._lock:
                if self._closed:
                    client.close()
                    backend.close()
                    return
                self._sockets += [client, backend]
            for source, sink in ((client, backend), (backend, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            try:
                sink.shutdown(socket.SHUT_WR)
            except OSError:
                pass
