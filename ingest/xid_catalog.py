"""NVIDIA's XID catalogue and gpufail's grouping of XID codes into classes.

Both are data files beside this module, not `if` chains: `xid_catalog.csv` is NVIDIA's
table (mnemonic, description, recommended action), `xid_classes.csv` says which class a code
belongs to and whether it ends a GPU's useful life by default. Which codes count as a failure
is configuration (`[labels] failure_xids`); `default_failure_xids()` is its documented default.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from functools import cache
from importlib import resources

XID_CLASSES = ("application", "memory", "nvlink", "bus", "gsp", "other")


@dataclass(frozen=True)
class XidInfo:
    code: int
    mnemonic: str
    description: str
    immediate_action: str
    xid_class: str
    is_failure: bool


def _read_csv(name: str) -> list[dict[str, str]]:
    text = resources.files("ingest").joinpath(name).read_text(encoding="utf-8")
    return list(csv.DictReader(text.splitlines()))


@cache
def xid_catalogue() -> dict[int, XidInfo]:
    """Every XID code NVIDIA documents, with gpufail's class (`other` when unclassified)."""
    classes = {int(r["xid"]): r for r in _read_csv("xid_classes.csv")}
    catalogue: dict[int, XidInfo] = {}
    for row in _read_csv("xid_catalog.csv"):
        if row["Type  (XID)"].strip() != "XID":
            continue
        code = int(row["Code"])
        cls = classes.get(code)
        catalogue[code] = XidInfo(
            code=code,
            mnemonic=row["Mnemonic"].strip(),
            description=row["Description"].strip(),
            immediate_action=row["Resolution Bucket  (Immediate Action)"].strip(),
            xid_class=cls["class"] if cls else "other",
            is_failure=cls is not None and cls["is_failure"] == "true",
        )
    return catalogue


def xid_class(code: int) -> str:
    """The class of an XID code; codes the catalogue does not know are `other`."""
    info = xid_catalogue().get(code)
    return info.xid_class if info else "other"


def xid_class_map() -> dict[int, str]:
    """Code -> class for every classified code (all others are `other`)."""
    return {code: info.xid_class for code, info in xid_catalogue().items() if info.xid_class != "other"}


def default_failure_xids() -> tuple[int, ...]:
    """XIDs that end a GPU's useful life unless the configuration says otherwise."""
    return tuple(sorted(code for code, info in xid_catalogue().items() if info.is_failure))
