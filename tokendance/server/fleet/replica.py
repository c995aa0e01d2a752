"""A fleet's engine replica: an `LLM` and the single-process app, driven in-process over ASGI; the
names every replica answers with, and the failures that mean a replica is gone."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os

import ray
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from tokendance.server.fleet.routing import KeyLog, Route

log = logging.getLogger("tokendance.server")

REPLICA_HEADER = "x-tokendance-replica"  # which replica answered (every response carries it)
ROUND_GROUP_HEADER = "x-tokendance-round-group"  # "g/G": a split declared round's member ran in group g of G


class ReplicaGone(RuntimeError):
    """A replica's server did not answer (it died or is restarting): retry elsewhere."""

    def __init__(self, replica: str, reason: str):
        super().__init__(replica, reason)  # both in args: Ray pickles it back to the caller
        self.replica = replica

    def __str__(self) -> str:
        return f"replica {self.args[0]}: {self.args[1]}"


REPLICA_FAILURES = (ActorDiedError, ActorUnavailableError, RayActorError, ReplicaGone)


@serve.deployment(max_ongoing_requests=4096, health_check_period_s=2, health_check_timeout_s=30)
class EngineReplica:
    """One engine and the single-process app over it; `http` serves one request through it."""

    def __init__(self, llm_args: dict, server_config, warm_up: bool = True):
        from tokendance import LLM
        from tokendance.server.app import create_app

        self.name = serve.get_replica_context().replica_id.unique_id
        llm = LLM(**llm_args)
        if warm_up:
            llm.warm_up()
        server_config = dataclasses.replace(server_config, model_name=server_config.model_name or llm.engine.model_name)
        self.app = create_app(llm, server_config)
        self.loop = self.app.state.engine_loop
        self.loop.start()
        self.placed = KeyLog()  # round and agent keys routed here (a restarted endpoint reads them)

    def check_health(self) -> None:
        if not self.loop.is_alive:
            raise RuntimeError(f"the engine thread died: {self.loop.error}")

    async def http(self, method: str, path: str, query: bytes, headers: list, body: bytes, view=None,
                   route: Route | None = None):
        """The ASGI messages of the app's answer, as they come; the client leaving (the caller
        cancelling) reaches the app as a disconnect, which aborts the request's engine work."""
        sent, gone, messages = False, asyncio.Event(), asyncio.Queue()
        self.placed.note(route)

        async def receive():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query, "root_path": "",
                 "headers": [(bytes(k), bytes(v)) for k, v in headers], "client": ("127.0.0.1", 0),
                 "server": ("127.0.0.1", 0), "state": {}}
        async def run() -> None:
            try:
                await self.app(scope, receive, messages.put)
            finally:
                messages.put_nowait(None)  # the app is done (an answer it never finished raises below)

        task = asyncio.ensure_future(run())
        try:
            while True:
                message = await messages.get()
                if message is None:
                    task.result()
                    break
                if message["type"] == "http.response.start":
                    message = {**message, "headers": [*message.get("headers", []),
                                                      (REPLICA_HEADER.encode(), self.name.encode())]}
                yield message
                if message["type"] == "http.response.body" and not message.get("more_body", False):
                    break
        finally:
            gone.set()
            await asyncio.wait({task}, timeout=30)

    def pid(self, route: Route | None = None) -> dict:
        return {"replica": self.name, "pid": os.getpid(), "healthy": self.loop.is_alive, "engine": "tokendance",
                "node": ray.get_runtime_context().get_node_id()}

    def placements(self, route: Route | None = None) -> dict:
        return {"replica": self.name, "keys": self.placed.keys()}
