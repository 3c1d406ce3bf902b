"""Structured events: where the library's structlog events go.

When the application has configured structlog, events go through its configuration (and
``structlog.testing.capture_logs()`` sees them). When it has not, they go to the stdlib logger
``rollout_lifecycle`` as key=value lines, so an unconfigured trainer sees nothing below its
logging level instead of a flood on stdout.
"""

from __future__ import annotations

import logging
from typing import Any

import structlog

LOGGER_NAME = "rollout_lifecycle"

_fallback: Any = structlog.wrap_logger(
    logging.getLogger(LOGGER_NAME),
    processors=[
        structlog.stdlib.filter_by_level,
        structlog.stdlib.add_log_level,
        structlog.processors.TimeStamper(fmt="iso"),
        structlog.processors.KeyValueRenderer(key_order=["event"], sort_keys=True),
    ],
    wrapper_class=structlog.stdlib.BoundLogger,
)


def logger() -> Any:
    """The logger to emit an event on, following the application's structlog setup."""
    if structlog.is_configured():
        return structlog.get_logger(LOGGER_NAME)
    return _fallback
