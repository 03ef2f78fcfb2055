"""The CLI's side of the API: finds the service (``--url`` or ``STATE_DIR/service.json``) and its token
(``PIPEDREAM_POOL_TOKEN`` or ``STATE_DIR/token``)."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from ..errors import PoolError

__all__ = ["Client", "SERVICE_FILE", "TOKEN_FILE"]

SERVICE_FILE = "service.json"
TOKEN_FILE = "token"


class Client:
    def __init__(self, state_dir: Path, url: str | None = None, token: str | None = None) -> None:
        if url is None:
            try:
                url = json.loads((Path(state_dir) / SERVICE_FILE).read_text())["url"]
            except (OSError, ValueError, KeyError):
                raise PoolError(f"no pool service found in {state_dir} (start `pipedream-pool serve`, or give --url)") from None
        if token is None:
            token = os.environ.get("PIPEDREAM_POOL_TOKEN")
        if token is None:
            try:
                token = (Path(state_dir) / TOKEN_FILE).read_text().strip()
            except OSError:
                raise PoolError(f"no token: set PIPEDREAM_POOL_TOKEN or read access to {Path(state_dir) / TOKEN_FILE}") from None
        self.url = url.rstrip("/")
        self.token = token

    def request(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Authorization": f"Bearer {self.token}",
                                              "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            try:
                detail = json.loads(exc.read()).get("detail", exc.reason)
            except ValueError:
                detail = exc.reason
            raise PoolError(str(detail) if exc.code != 401 else f"401: {detail}") from None
        except urllib.error.URLError as exc:
            raise PoolError(f"cannot reach the pool service at {self.url}: {exc.reason}") from None
