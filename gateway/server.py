"""How the gateway is served: uvicorn with the connection limits, and a drain on SIGTERM.

:func:`uvicorn_config` is uvicorn's Config with gateway/connections.py's
h11 protocol (the cap, the header and body timeouts, JSON protocol errors)
bound to ``server.connections``; ``interlace serve`` and ``interlace mcp
serve --transport http`` both use it.  It also makes sure the process may
open the descriptors the cap allows (raising the soft ``RLIMIT_NOFILE``
towards the hard one, else lowering the cap) and rate-limits the log lines a
client can cause (gateway/log_limit.py).

:class:`GatewayServer` is uvicorn's Server with a shutdown that drains
(gateway/drain.py): on SIGTERM or SIGINT it closes the listeners (no new
connection is accepted), closes idle connections, gives the requests in
flight ``server.drain_s`` to finish and ends the rest properly, and only
then runs uvicorn's own shutdown (the app's lifespan stops the engines and
tool workers).  The signal is not re-raised afterwards, as uvicorn does by
default, so a drained gateway exits 0.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import resource
import signal
import threading
from typing import Any, Iterator, Optional

import uvicorn

from .config import ConnectionsConfig
from .connections import GatewayProtocol, Limits
from .drain import Drain
from .log_limit import limit_logs

log = logging.getLogger(__name__)

#: Descriptors kept for everything but client connections: model files, engine and tool
#: worker pipes, MCP servers, the listening sockets, logs.
RESERVED_FDS = 256

#: Seconds uvicorn's own shutdown waits after the drain (which has ended every request).
AFTER_DRAIN_S = 5


def allowed_connections(wanted: int, reserved: int = RESERVED_FDS) -> int:
    """``wanted`` connections, or fewer if the descriptor limit cannot be raised to hold them."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = wanted + reserved
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft != resource.RLIM_INFINITY and soft < need:
        fewer = max(1, soft - reserved)
        log.warning("server.connections.max_connections %d: the open-files limit is %d, so at most %d "
                    "connections are kept open", wanted, soft, fewer)
        return fewer
    return wanted


def uvicorn_config(app: Any, connections: ConnectionsConfig, **kwargs: Any) -> uvicorn.Config:
    """uvicorn's Config for ``app`` with ``connections``' limits (``kwargs``: host, port, log_level, ...)."""
    limits = Limits(allowed_connections(connections.max_connections), connections.header_timeout_s,
                    connections.body_timeout_s)
    # ws="none": no route takes a WebSocket, and an upgraded connection would leave the protocol (and the cap)
    config = uvicorn.Config(app, http=functools.partial(GatewayProtocol, limits=limits), ws="none",
                            timeout_keep_alive=connections.keep_alive_s, backlog=connections.backlog,
                            **kwargs)
    limit_logs()  # after uvicorn's Config: it (re)configures its loggers
    return config


class GatewayServer(uvicorn.Server):
    """uvicorn's Server whose shutdown drains the requests in flight (``drain``: the app's
    :class:`~interlace.gateway.drain.Drain`) for ``drain_s`` seconds."""

    def __init__(self, config: uvicorn.Config, drain: Optional[Drain], drain_s: float) -> None:
        super().__init__(config)
        self.drain, self.drain_s = drain, drain_s

    async def shutdown(self, sockets: Optional[list] = None) -> None:
        for server in self.servers:  # stop accepting at once
            server.close()
        for connection in list(self.server_state.connections):  # idle ones close, busy ones after their response
            connection.shutdown()
        if self.drain is not None:
            await self.drain.drain(self.drain_s, stop_waiting=lambda: self.force_exit)
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # type: ignore[override]
        """uvicorn's signal handling without re-raising the signal after the shutdown:
        a drained gateway exits 0.  A second SIGINT still forces the exit."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)


def serve(app: Any, connections: ConnectionsConfig, drain_s: float, *, host: str, port: int,
          log_level: str) -> None:
    """Serve the gateway ``app`` (create_app's, whose ``state.drain`` is drained on SIGTERM) until a signal."""
    config = uvicorn_config(app, connections, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=AFTER_DRAIN_S)
    GatewayServer(config, getattr(app.state, "drain", None), drain_s).run()
