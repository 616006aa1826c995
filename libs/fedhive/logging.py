"""structlog set-up: JSON lines for services, a readable console for the CLI.

Call `configure()` once from a composition root; modules get loggers with
`structlog.get_logger()` and bind `service`, `job_id`, `site`, `task_id` where known.

Libraries (pika, boto3, grpc, urllib3) log through stdlib `logging`: their lines (warnings and
up) go through the same renderer, as JSON objects with `logger`, `service`, the process's own
context (a server or client job's `job_id`, `site`) and whatever the thread bound with
`structlog.contextvars` (the client job's worker binds `task_id` while it runs a task), so a
log reader never meets plain text among the JSON.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any, TextIO

import structlog


def configure(service: str, *, level: str = "INFO", json: bool = True,
              context: Mapping[str, Any] | None = None, stream: TextIO | None = None) -> Any:
    """Route structlog and stdlib logging (libraries, WARNING and up) to `stream` (stderr).

    `context` (e.g. a job's `job_id` and `site`) is added to library lines; returns a logger
    bound with `service` and `context`.
    """
    process = {"service": service, **(context or {})}
    out = sys.stderr if stream is None else stream
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Any = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    exceptions: Any = (structlog.processors.format_exc_info if json
                       else structlog.processors.ExceptionPrettyPrinter())
    structlog.configure(
        processors=[*shared, exceptions, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        logger_factory=structlog.PrintLoggerFactory(out),
        cache_logger_on_first_use=True,
    )

    def add_process(_: Any, __: str, event: MutableMapping[str, Any]) -> Mapping[str, Any]:
        return {**process, **event}

    handler = logging.StreamHandler(out)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name, add_process,
                           structlog.stdlib.ExtraAdder()],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, exceptions,
                    renderer]))
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(logging.WARNING)  # libraries stay quiet unless they warn
    return structlog.get_logger().bind(**process)


def file_logger(stream: TextIO, **context: Any) -> Any:
    """A logger writing to `stream` what the configured ones write (same processors and
    level), bound with `context`: one process's parts logging apart (`fedhive simulate`'s
    server job and sites, each into a file where a deployment keeps its log)."""
    config = structlog.get_config()
    return structlog.wrap_logger(structlog.PrintLogger(stream),
                                 processors=config["processors"],
                                 wrapper_class=config["wrapper_class"]).bind(**context)
