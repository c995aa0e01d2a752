"""The app `tokendance serve` puts on its port before the model has loaded.

The port is bound at once, so a client or a load balancer learns in milliseconds that the server is
coming up instead of hanging on a closed port or a silent one: `/health` answers 503
{"status": "loading"} and every other route 503 with an OpenAI error body and `Retry-After`, until
the model is loaded and warmed up; from then on every request goes to the real app.
"""

from __future__ import annotations

import json
import threading
from typing import Callable

RETRY_AFTER_S = 5


class StartingApp:
    """An ASGI app that builds the real one (`build`, on a thread of its own when the server
    starts) and then hands it every request. The real app's engine loop is started and stopped
    here, since its own lifespan never runs under this wrapper. `failed(exc)` is called if `build`
    raises; `app` stays None then."""

    def __init__(self, build: Callable, failed: Callable[[BaseException], None]):
        self.build = build
        self.failed = failed
        self.app = None
        self._loader = threading.Thread(target=self._load, name="tokendance-load", daemon=True)

    def _load(self) -> None:
        try:
            app = self.build()
            app.state.engine_loop.start()
        except BaseException as exc:  # noqa: BLE001 - any failure stops the server, with its reason
            self.failed(exc)
            return
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif self.app is not None:
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            await self._unavailable(scope, send)

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._loader.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.app is not None:
                    self.app.state.engine_loop.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    @staticmethod
    async def _unavailable(scope, send) -> None:
        if scope["path"] == "/health":
            body = {"status": "loading"}
        else:
            body = {"error": {"message": "the model is still loading; retry shortly", "type": "server_error",
                              "param": None, "code": "model_loading"}}
        data = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                                (b"retry-after", str(RETRY_AFTER_S).encode())]})
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else data})
