"""The log lines of the long-running commands (`collect`, `serve`, `nightly`): plain text for
people, or with `--log-format json` one JSON object per line for a log pipeline (Loki,
Elasticsearch, Cloud Logging) that would otherwise have to parse free text.

In JSON every line the command writes, on stdout or stderr, is one object with `time` (ISO 8601,
UTC), `level`, `logger` and `message`; a line that reports a result also carries its facts under
`facts` (the object `--json` prints), and an exception its traceback under `exc`. The server's
own loggers (uvicorn's and gpufail's) go through the same formatter.
"""

from __future__ import annotations

import io
import json
import logging
import os
import sys
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import click

LOG_FORMATS = ("text", "json")
MLFLOW_CONFIGURE_LOGGING = "MLFLOW_CONFIGURE_LOGGING"
OWN_HANDLER_LOGGERS = ("mlflow",)
"""Libraries' loggers that write through a handler of their own (already imported, in a
process that runs more than one command)."""
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


_streams: list[Any] = []
"""While JSON logging is on: the process's real (stdout, stderr), which `_LinesToLog` replaced."""


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to the real stderr of the moment (a test runner swaps it per run; in JSON mode
    `sys.stderr` is a `_LinesToLog`)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return _streams[1] if _streams else sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


class _LinesToLog(io.TextIOBase):
    """`sys.stdout` or `sys.stderr` in JSON mode: each line a library prints (MLflow's
    "Successfully registered model ...") becomes a log record of the logger `name`."""

    def __init__(self, name: str, level: int, real: Any) -> None:
        self.logger, self.level, self.real = logging.getLogger(name), level, real
        self.pending = ""
        self.busy = threading.local()

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if getattr(self.busy, "on", False):  # logging reporting its own failure: no loop
            return int(self.real.write(text))
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            self._log(line)
        return len(text)

    def flush(self) -> None:
        if self.pending:
            line, self.pending = self.pending, ""
            self._log(line)
        self.real.flush()

    def fileno(self) -> int:
        return int(self.real.fileno())

    def _log(self, line: str) -> None:
        if not line.strip():
            return
        self.busy.on = True
        try:
            self.logger.log(self.level, line.rstrip())
        finally:
            self.busy.on = False


_previous_level: list[int] = []


def use_log_format(fmt: str) -> None:
    """In `json`: Python logging at INFO and above (and warnings) to stderr as JSON, and the
    command's own lines (`line_writer`), what libraries print and its one-line error too. In
    `text` the logging is left as it is."""
    global _json_mode
    reset_log_format()
    if fmt != "json":
        return
    _json_mode = True
    # MLflow gives its logger a text handler of its own when imported (and stops it
    # propagating), unless told not to: its lines then reach ours.
    os.environ.setdefault(MLFLOW_CONFIGURE_LOGGING, "false")
    for name in OWN_HANDLER_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
    _streams[:] = [sys.stdout, sys.stderr]
    sys.stdout = _LinesToLog("stdout", logging.INFO, _streams[0])
    sys.stderr = _LinesToLog("stderr", logging.WARNING, _streams[1])
    handler = _StderrHandler()
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.addHandler(handler)
    _previous_level.append(root.level)
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)


def reset_log_format() -> None:
    """Back to text, as before `use_log_format` (each run of `gpufail.cli.main` starts and ends
    here)."""
    global _json_mode
    _json_mode = False
    if _streams:
        for name, wrapper in (("stdout", sys.stdout), ("stderr", sys.stderr)):
            if isinstance(wrapper, _LinesToLog):
                wrapper.flush()
                setattr(sys, name, wrapper.real)
        _streams.clear()
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
    handler = {"()": f"{__name__}._StderrHandler", "formatter": "json"}
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
