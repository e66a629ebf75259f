"""A small HTTP/1.1 JSON client for probe servers over a unix socket or TCP (stdlib only)."""

from __future__ import annotations

import http.client
import json
import socket

from probe._errors import AuthError, EndpointError, ProbeError, error_from_dict

from ._endpoint import Target

__all__ = ["Client"]


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        s.connect(self._path)
        self.sock = s


class Client:
    def __init__(self, target: Target, timeout: float = 10.0):
        self.target = target
        self.timeout = timeout

    def _connection(self, timeout: float):
        t = self.target
        if t.entry.get("missing"):
            raise EndpointError(t.entry.get("hint", f"{t.label} has no probe server."))
        if t.socket:
            return _UnixConnection(t.socket, timeout)
        return http.client.HTTPConnection(t.host, t.port, timeout=timeout)

    def request(self, method: str, path: str, body: dict | None = None, timeout: float | None = None) -> dict:
        timeout = self.timeout if timeout is None else timeout
        t = self.target
        headers = {"Content-Type": "application/json", "Connection": "close"}
        if t.port is not None and not t.socket:
            if not t.token:
                raise AuthError(f"{t.label} listens on TCP and needs a token; pass --token or set PROBE_TOKEN.")
            headers["Authorization"] = f"Bearer {t.token}"
        payload = json.dumps(body).encode() if body is not None else None
        conn = self._connection(timeout)
        try:
            conn.request(method, path, body=payload, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        except FileNotFoundError:
            raise EndpointError(f"the socket of {t.label} is gone; the process probably exited (`probe list` shows live ones).") from None
        except ConnectionRefusedError:
            where = t.socket or f"{t.host}:{t.port}"
            raise EndpointError(f"connection refused by {where}; the probe is not listening there (check the port, or `probe list`).") from None
        except socket.timeout:
            raise EndpointError(f"{t.label} did not answer within {timeout:g} s; it may be hung with the GIL held (try `probe {t.pid or 'PID'} backtrace`, which falls back to py-spy, or raise --timeout).") from None
        except (OSError, http.client.HTTPException) as exc:
            raise EndpointError(f"could not talk to {t.label} ({exc}); check the endpoint with `probe list`.") from None
        finally:
            conn.close()
        try:
            doc = json.loads(data or b"{}")
        except ValueError:
            raise EndpointError(f"{t.label} did not answer like a probe (HTTP {resp.status}); check the endpoint.") from None
        if resp.status == 401:
            raise AuthError(doc.get("error") or "missing or wrong token; pass --token or set PROBE_TOKEN.")
        if resp.status >= 400 or (isinstance(doc, dict) and "error" in doc and "kind" in doc):
            raise error_from_dict(doc if isinstance(doc, dict) else {"error": str(doc)})
        if not isinstance(doc, dict):
            raise ProbeError(f"{t.label} sent an unexpected answer.")
        return doc

    def get(self, path: str, timeout: float | None = None, **params) -> dict:
        from urllib.parse import urlencode

        query = urlencode({k: v for k, v in params.items() if v is not None})
        return self.request("GET", f"{path}?{query}" if query else path, timeout=timeout)

    def post(self, path: str, body: dict, timeout: float | None = None) -> dict:
        return self.request("POST", path, body, timeout=timeout)
