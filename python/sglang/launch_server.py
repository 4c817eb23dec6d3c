"""Start an HTTP server: ``python -m sglang.launch_server --model-path DIR [flags]``.

Flags are the fields of ``sglang.srt.server_args.ServerArgs`` (see docs/server.md). A bad flag
or model directory stops here with the message and exit status 2; a scheduler that cannot
start (the model does not load, the pools do not fit) exits with status 1.
"""

from __future__ import annotations

import logging
import sys


def main(argv: list[str] | None = None) -> int:
    from sglang.srt.managers.scheduler_process import configure_logging
    from sglang.srt.server_args import parse_args

    logger = logging.getLogger("sglang.launch_server")
    configure_logging("info")
    try:
        server_args = parse_args(argv)
        configure_logging(server_args.log_level)
        server_args.check_model()
    except ValueError as exc:
        logger.error("invalid arguments: %s", exc)
        return 2
    from sglang.srt.entrypoints.engine import EngineStartupError
    from sglang.srt.entrypoints.http_server import launch_server

    try:
        launch_server(server_args)
    except EngineStartupError as exc:
        logger.error("server failed to start: %s", exc)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
