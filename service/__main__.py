"""``python -m service --models DIR [--adapters DIR] [--host H] [--port P] ...``: run the server.

Every flag also reads from its ``TSERVE_*`` environment variable; a flag given wins. SIGTERM or
Ctrl-C stops accepting connections, lets in-flight requests finish for up to drain_timeout_s, answers
what is left with 503 (not_ready), stops the engine and exits with status 0. When start-up fails, e.g. no
configured model loads (the log names each and why), it exits with status 3 without ever reporting ready.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import signal
import sys
from collections.abc import Mapping, Sequence

import uvicorn
from starlette.types import ASGIApp

from service.api.connections import ConnectionLimits, guarded_protocol
from service.settings import Settings, SettingsError, setting_fields

# uvicorn's own deadline, a backstop after the engine's drain: at it, uvicorn cancels what is left (bare 500s).
BACKSTOP_S = 5.0


class DrainingServer(uvicorn.Server):
    """uvicorn, with the engine's drain started as soon as it stops accepting connections.

    uvicorn's shutdown waits for in-flight responses up to timeout_graceful_shutdown, cancels what is
    left (its clients get a bare text 500), and only then runs the lifespan shutdown, the engine's
    drain. Started here, the drain runs alongside: /ready turns 503, at drain_timeout_s the engine fails
    the requests still running with 503 not_ready (the one error shape), and those answers go out
    before uvicorn's deadline (drain_timeout_s + BACKSTOP_S).
    """

    def __init__(self, config: uvicorn.Config, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.drain_timeout_s = drain_timeout_s

    async def shutdown(self, sockets: list | None = None) -> None:
        engine = self.config.app.state.engine
        drain = asyncio.create_task(engine.stop(self.drain_timeout_s))
        try:
            await super().shutdown(sockets)
        finally:
            await drain


class NoQueryStrings(logging.Filter):
    """uvicorn's access log without query strings: no route takes one, and a key pasted into a URL
    (``?api_key=...``) must not end up in the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and len(record.args) == 5:  # client, method, path, version, status
            client, method, path, version, status = record.args
            record.args = (client, method, str(path).split("?", 1)[0], version, status)
        return True


def server_config(app: ASGIApp, settings: Settings) -> uvicorn.Config:
    """uvicorn's configuration for ``app`` under ``settings``: address, logging, shutdown deadline and the
    connection limits (the one place both ``python -m service`` and the in-process test server build it)."""
    limits = ConnectionLimits(
        header_timeout_s=settings.header_timeout_s,
        body_timeout_s=settings.body_timeout_s,
        max_connections=settings.max_connections,
    )
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=math.ceil(settings.drain_timeout_s + BACKSTOP_S),
        lifespan="on",
        http=guarded_protocol(limits),
    )


def build_parser(prog: str = "python -m service") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Serve Transformer models over HTTP.",
        epilog="Each flag defaults to its environment variable, then to the default shown.",
    )
    for f in setting_fields():
        flag = "--" + f.name.replace("_", "-")
        default = f.default_factory() if callable(f.default_factory) else f.default
        shown = ",".join(default) if isinstance(default, tuple) else default
        help_text = f"{f.metadata['help']} [env {f.metadata['env']}; default: {shown}]"
        if f.name in ("api_keys", "admin_keys"):
            help_text += " (prefer the environment variable: flags show up in ps)"
        parser.add_argument(
            flag,
            dest=f.name,
            type=f.metadata["parse"],
            default=argparse.SUPPRESS,
            metavar=f.name.upper(),
            help=help_text.replace("%", "%%"),
        )
    return parser


def parse_settings(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None,
                   prog: str = "python -m service") -> Settings:
    """Defaults < environment < flags."""
    args = vars(build_parser(prog).parse_args(argv))
    return Settings.from_env(environ, **args)


def main(argv: Sequence[str] | None = None, prog: str = "python -m service") -> int:
    """Serve the models ``argv`` (flags) and the environment say; the exit status (0 after a graceful stop, 2 for
    bad settings, 3 when start-up failed)."""
    try:
        settings = parse_settings(argv, prog=prog)
    except SettingsError as exc:
        sys.stderr.write(f"{prog}: {exc}\n")
        return 2
    if settings.models is None:
        sys.stderr.write(f"{prog}: --models (or TSERVE_MODELS) is required\n")
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from service.engine.threads import keep_serial

    keep_serial()  # model workers set their own threads (service.engine.threads)
    from service.api.app import create_app

    config = server_config(create_app(settings), settings)
    logging.getLogger("uvicorn.access").addFilter(NoQueryStrings())  # after Config, which configures logging
    # uvicorn re-raises a caught SIGTERM/SIGINT once it has shut down, under the handlers it found: with
    # Python's defaults that kills the process (status -15 after a clean drain). Handlers that do nothing
    # let run() return, so a graceful shutdown exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: None)
    server = DrainingServer(config, settings.drain_timeout_s)
    server.run()
    return 0 if server.started else 3  # 3: start-up failed (uvicorn's own status for it)


if __name__ == "__main__":
    sys.exit(main())
