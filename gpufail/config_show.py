"""What `gpufail config show` prints: every effective setting, where it came from, and the
secrets masked.

Settings never hold a secret themselves: tokens and the webhook secret live in environment
variables that settings name (`*_token_env`, `*_secret_env`); of those only whether they are set
is shown. Values that can carry a credential are masked too: every URL as
`ingest.urls.masked_url` shows it (its user part, query values and the path from its first
segment that is not a plain word: chat webhooks carry their key there, gateways in the query).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpufail.config import Settings, _Origins
from ingest.urls import MASK, masked_url

SECRET_NAME_PARTS = ("token", "secret", "password")
"""A key whose name holds one of these (without `_env`) is masked whole."""


@dataclass(frozen=True)
class EffectiveSetting:
    table: str
    key: str
    value: Any
    """JSON-ready, secrets masked."""
    source: str
    """`default`, `file PATH` or `environment NAME`."""
    note: str = ""
    """For a setting naming a secret's variable: whether that variable is set."""


def effective_settings(settings: Settings, origins: _Origins, environ: Mapping[str, str]) -> list[EffectiveSetting]:
    """Each [table] key of `settings`, in declaration order, masked."""
    out = []
    for table, section in settings.model_dump(mode="json").items():
        for key, value in section.items():
            if (table, key) in origins.env:
                source = f"environment {origins.env[(table, key)]}"
            elif (table, key) in origins.file_keys:
                source = f"file {origins.path}"
            else:
                source = "default"
            note = ""
            if _names_secret_variable(key) and isinstance(value, str):
                note = f"{value} is {'set (' + MASK + ')' if environ.get(value) else 'not set'}"
            out.append(EffectiveSetting(table, key, masked(table, key, value), source, note))
    return out


def _names_secret_variable(key: str) -> bool:
    return key.endswith("_env") and any(part in key for part in SECRET_NAME_PARTS)


def masked(table: str, key: str, value: Any) -> Any:
    """`value` with what could be a credential replaced by `MASK`."""
    if isinstance(value, str) and value:
        if any(part in key for part in SECRET_NAME_PARTS) and not key.endswith("_env"):
            return MASK
        if "://" in value:
            return masked_url(value)
    if isinstance(value, list):
        return [masked(table, key, v) for v in value]
    if isinstance(value, dict):
        return {k: masked(table, str(k), v) for k, v in value.items()}
    return value
