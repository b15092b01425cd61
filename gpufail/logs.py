"""The log lines of the long-running commands (`collect`, `serve`, `nightly`): plain text for
people, or with `--log-format json` one JSON object per line for a log pipeline (Loki,
Elasticsearch, Cloud Logging) that would otherwise have to parse free text.

In JSON every line the command writes, on stdout or stderr, is one object with `time` (ISO 8601,
UTC), `level`, `logger` and `message`; a line that reports a result also carries its facts under
`facts` (the object `--json` prints), and an exception its traceback under `exc`. The server's
own loggers (uvicorn's and gpufail's) go through the same formatter.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import click

LOG_FORMATS = ("text", "json")
LOGGER = "gpufail"
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message",
    "asctime",
    "color_message",
}
"""Record attributes that are not extra fields (uvicorn adds `color_message`, its message with terminal colours)."""
_json_mode = False


class JsonFormatter(logging.Formatter):
    """One JSON object per record (module notes); a record's extra fields are kept."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        from gpufail.cli.options import jsonable

        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_") and key not in entry:
                entry[key] = jsonable(value)  # non-finite numbers as null: strict JSON
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, allow_nan=False)


def log_format_option(f: Any) -> Any:
    """`--log-format text|json` of the long-running commands."""
    return click.option(
        "--log-format",
        type=click.Choice(LOG_FORMATS),
        default="text",
        show_default=True,
        help="json: every line written is one JSON object (time, level, logger, message), for a log pipeline.",
    )(f)


def json_logs() -> bool:
    """Whether this process writes JSON log lines (`use_log_format("json")` was called)."""
    return _json_mode


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to the `sys.stderr` of the moment (a test runner swaps it per run)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


_previous_level: list[int] = []


def use_log_format(fmt: str) -> None:
    """In `json`: Python logging at INFO and above (and warnings) to stderr as JSON, and the
    command's own lines (`line_writer`) and its one-line error too. In `text` the logging is
    left as it is."""
    global _json_mode
    reset_log_format()
    if fmt != "json":
        return
    _json_mode = True
    handler = _StderrHandler()
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.addHandler(handler)
    _previous_level.append(root.level)
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)


def reset_log_format() -> None:
    """Back to text, as before `use_log_format` (each run of `gpufail.cli.main` starts here)."""
    global _json_mode
    _json_mode = False
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, _StderrHandler)]:
        root.removeHandler(handler)
    if _previous_level:
        root.setLevel(_previous_level.pop())
        logging.captureWarnings(False)


def line_writer(err: bool = False) -> Callable[[str], None]:
    """Where a long-running command's lines go: `click.echo` (stdout, or stderr with `err`) as
    text, or a log record of the `gpufail` logger as JSON."""
    if not _json_mode:
        return lambda line: click.echo(line, err=err)
    return lambda line: logging.getLogger(LOGGER).info(line)


def log_result(text: str, facts: dict[str, Any]) -> None:
    """A long-running command's result in JSON mode: its summary line with its facts."""
    logging.getLogger(LOGGER).info(text, extra={"facts": facts})


def log_error(message: str) -> None:
    """The command's one-line error as a JSON log record (level error)."""
    logging.getLogger(LOGGER).error(message)


def uvicorn_log_config(fmt: str) -> dict[str, Any] | None:
    """uvicorn's `log_config` for `fmt`: None keeps uvicorn's own text format."""
    if fmt != "json":
        return None
    formatter = {"()": f"{__name__}.JsonFormatter"}
    handler = {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": formatter},
        "handlers": {"default": handler},
        "loggers": {
            name: {"handlers": ["default"], "level": "INFO", "propagate": False}
            for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "gpufail")
        },
    }
