"""A thread per connection, up to a bound: a ``socketserver`` mix-in shared by the probe's server and the page's.

Past the bound a connection gets ``busy_reply()`` and is closed at once, without a thread: thousands of idle
sockets must not become thousands of threads in the training process (or in ``probe ui``).
"""

from __future__ import annotations

import threading


class BoundedThreads:
    """Put before ``socketserver.ThreadingMixIn`` (or a class built on it) in the bases; call ``bound_threads(n)``
    before serving and define ``busy_reply()`` (the bytes a connection past the bound is sent)."""

    _slots: threading.BoundedSemaphore

    def bound_threads(self, n: int) -> None:
        self._slots = threading.BoundedSemaphore(n)

    def busy_reply(self) -> bytes:
        raise NotImplementedError

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            try:
                request.settimeout(0.5)
                request.sendall(self.busy_reply())
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()
