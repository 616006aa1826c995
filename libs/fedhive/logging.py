"""structlog set-up: JSON lines for services, a readable console for the CLI.

Call `configure()` once from a composition root; modules get loggers with
`structlog.get_logger()` and bind `service`, `job_id`, `site`, `task_id` where known.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog


def configure(service: str, *, level: str = "INFO", json: bool = True) -> Any:
    """Route structlog (and stdlib logging of libraries such as pika) to stderr.

    Returns a logger bound with `service`.
    """
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Any = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            *shared,
            structlog.processors.format_exc_info
            if json
            else structlog.processors.ExceptionPrettyPrinter(),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    # Libraries log through stdlib; keep them quiet unless they warn.
    logging.basicConfig(
        stream=sys.stderr, level=logging.WARNING, format="%(name)s %(levelname)s %(message)s"
    )
    return structlog.get_logger().bind(service=service)
