"""The predictions dataset: one snapshot per (grid time, model version), and the one rule by
which every reader picks the snapshot to use.

A snapshot is one Parquet file under `predictions/date=YYYY-MM-DD/` (the UTC date of its grid
time) holding every scored GPU at one grid time from one model version (`serving.score`'s
`PREDICTION_SCHEMA`), with `SNAPSHOT_METADATA` in its schema metadata: grid time, model
version and the time it was written. Scoring the same grid time with the same model version
again replaces the snapshot, it never adds to it: the new file and the removal of the earlier
files of the same key are one commit of the store's journal `predictions` (`ingest.journal`),
so a reader sees the earlier snapshot or the new one, never both, whatever point a scoring is
killed at. Scorings of one data root take turns (the journal's lock).

**The newest snapshot** (`newest_snapshot`) is the one with the latest grid time; among
snapshots of that grid time (several model versions), the one written last (`written_at`),
then the greater file name. Files written before snapshots existed carry no metadata: their
key is read from their rows (the latest `ts`, the model version) and they count as written
before any snapshot that has it. Of the file, the rows at its grid time are read (a scoring of
a frame in which a GPU stopped reporting kept that GPU's older row).

A snapshot is checked before it is returned (`check_predictions`): the schema, at least one
row, one grid time and one model version, ids present (cluster, node, GPU uuid and index),
each GPU once, `risk` and `node_risk` finite and within [0, 1]. What fails is refused with one
line naming the file and what was wrong, before anything acts on it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import UTC, date, datetime
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from ingest.errors import InputError, StoreError
from ingest.store import Store, unreadable_message
from serving.prediction_schema import OPTIONAL_FIELDS, PREDICTION_SCHEMA

if TYPE_CHECKING:
    import pandas as pd

DATASET = "predictions"
SNAPSHOT_METADATA = b"gpufail.snapshot"
"""Schema metadata key of a snapshot file: JSON with `ts`, `model_version` and `written_at`."""

LOCK_WAIT_S = 60.0
"""How long a scoring waits for another scoring of the data root to write its snapshot."""
_IDS = ("cluster", "node", "gpu_uuid")
_PROBABILITIES = ("risk", "node_risk")


@dataclass(frozen=True)
class SnapshotKey:
    """What identifies a predictions file: its grid time and model version, and for picking the
    newest, when and where it was written."""

    path: str
    ts: datetime
    model_version: str
    written_at: str
    """ISO time the snapshot was written ('' for a file written before snapshots)."""

    @property
    def order(self) -> tuple[datetime, str, str]:
        return (self.ts, self.written_at, self.path)


@dataclass(frozen=True)
class Snapshot:
    key: SnapshotKey
    frame: pd.DataFrame
    """The checked predictions: `PREDICTION_SCHEMA`'s columns (and the optional columns the file
    has: `serving.prediction_schema`), in the file's row order."""

    @property
    def path(self) -> str:
        return self.key.path


def write_snapshot(store: Store, predictions: pd.DataFrame, *, now: datetime | None = None) -> tuple[str, int]:
    """Write `predictions` (`serving.score.score_latest`'s output: one grid time, one model
    version) as the snapshot of its key, replacing an earlier one. Returns the file written and
    how many earlier files of the same key it replaced."""
    from serving.score import prediction_table

    table = prediction_table(predictions)
    check_predictions(table, "predictions to write")
    ts = _utc(predictions["ts"].iloc[0])
    version = str(predictions["model_version"].iloc[0])
    written_at = (now or datetime.now(UTC)).isoformat()
    meta = {"ts": ts.isoformat(), "model_version": version, "written_at": written_at}
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), SNAPSHOT_METADATA: json.dumps(meta)})
    with store.journal(DATASET, [DATASET], wait_s=LOCK_WAIT_S, holder="`gpufail score` of this data root") as journal:
        staged = journal.staging().write_owned(DATASET, ts.date(), table)
        earlier = [
            key.path
            for key in _keys_of_day(store, ts.date(), skip_unreadable=True)
            if (key.ts, key.model_version) == (ts, version)
        ]
        (path,) = journal.commit(staged=[staged], replaces=earlier)
    return path, len(earlier)


def newest_snapshot(store: Store) -> Snapshot | None:
    """The newest snapshot (see the module docstring), checked; None when there is none.
    Reads only the newest date that has a file."""
    found = newest_snapshot_table(store)
    return None if found is None else Snapshot(found[0], found[1].to_pandas())


def newest_snapshot_table(store: Store) -> tuple[SnapshotKey, pa.Table] | None:
    """`newest_snapshot` as an Arrow table (checked, in the prediction schema), for readers
    that need no pandas (`gpufail at-risk`)."""
    for day in reversed(store.dates(DATASET)):
        keys = _keys_of_day(store, day, skip_unreadable=False)
        if keys:
            key = max(keys, key=lambda k: k.order)
            table = _read_table(store, key.path)
            ts = table.schema.field("ts") if "ts" in table.column_names else None
            if (
                ts is not None
                and pa.types.is_timestamp(ts.type)
                and table["ts"].null_count == 0
                and len(set(time_integers(table["ts"]))) > 1
            ):
                # As before snapshots: a GPU that stopped reporting kept its last, older row in a
                # scoring; only the rows of the grid time are the fleet at that time.
                import pyarrow.compute as pc

                table = table.filter(pc.equal(pc.max(table["ts"]), table["ts"]))
            return key, checked_predictions(table, key.path)
    return None


def check_predictions(table: pa.Table, where: str) -> pd.DataFrame:
    """The predictions of `table` as a pandas frame in the prediction schema, or `InputError`
    naming `where` and every problem found (see the module docstring)."""
    return checked_predictions(table, where).to_pandas()


def checked_predictions(table: pa.Table, where: str) -> pa.Table:
    """`check_predictions` as an Arrow table."""
    table = _conform(table, where)
    problems = []
    if table.num_rows == 0:
        problems.append("no rows (expected one per scored GPU)")
    for name in ("ts", *_IDS, "gpu_index", "risk", "node_risk", "model_version"):
        nulls = table[name].null_count
        if nulls:
            problems.append(f"{nulls} null {name!r} value{'s' if nulls > 1 else ''}")
    # Checked on the columns' Python values: pyarrow's compute module, or a column converted to
    # numpy (which imports pandas), would cost `gpufail at-risk` more than the checks themselves.
    # Nulls are counted above; the checks below skip them.
    for name in _IDS:
        empty = table[name].to_pylist().count("")
        if empty:
            problems.append(f"{empty} empty {name!r} value{'s' if empty > 1 else ''}")
    negative = sum(1 for v in table["gpu_index"].to_pylist() if v is not None and v < 0)
    if negative:
        problems.append(f"{negative} negative 'gpu_index' value{'s' if negative > 1 else ''}")
    gpus = table["gpu_uuid"].to_pylist()
    for name in _PROBABILITIES:
        values = table[name].to_pylist()
        # NaN fails both comparisons.
        bad = [i for i, v in enumerate(values) if v is not None and not 0.0 <= v <= 1.0]
        if bad:
            problems.append(
                f"{len(bad)} {name!r} value{'s' if len(bad) > 1 else ''} not a probability in [0, 1] "
                f"(e.g. {_number(values[bad[0]])} for GPU {gpus[bad[0]]})"
            )
    for name, column in (("ts", time_integers(table["ts"])), ("model_version", table["model_version"].to_pylist())):
        distinct = len(set(column) - {None})
        if distinct > 1:
            problems.append(f"{distinct} distinct {name!r} values (a snapshot holds one grid time of one model)")
    listed = [g for g in gpus if g is not None]
    duplicated = len(listed) - len(set(listed))
    if duplicated > 0:
        problems.append(f"{duplicated} GPU{'s' if duplicated > 1 else ''} listed more than once")
    if problems:
        raise InputError(f"{where}: not usable predictions: {'; '.join(problems)}")
    return table


def _conform(table: pa.Table, where: str) -> pa.Table:
    expected = list(PREDICTION_SCHEMA)
    expected.extend(f for f in OPTIONAL_FIELDS if f.name in table.column_names)
    missing = [f.name for f in expected if f.name not in table.column_names]
    if missing:
        raise InputError(
            f"{where}: not usable predictions: missing column{'s' if len(missing) > 1 else ''} {missing} "
            f"(expected {PREDICTION_SCHEMA.names})"
        )
    columns = []
    for field in expected:
        column = table[field.name]
        if not column.type.equals(field.type):
            try:
                column = column.cast(field.type, safe=True)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                raise InputError(
                    f"{where}: not usable predictions: column {field.name!r} is {column.type}, expected {field.type}"
                ) from None
        columns.append(column)
    return pa.Table.from_arrays(columns, schema=pa.schema(expected))


def time_integers(column: pa.ChunkedArray) -> list[int | None]:
    """A timestamp column's values as integers of its unit (microseconds in the prediction
    schema): pyarrow's conversion of the times themselves imports pandas."""
    return [v for chunk in column.chunks for v in chunk.view(pa.int64()).to_pylist()]


def _number(value: float) -> str:
    return str(value) if not math.isfinite(value) else f"{value:g}"


def _keys_of_day(store: Store, day: date, *, skip_unreadable: bool) -> list[SnapshotKey]:
    keys = []
    for path in store.files(DATASET, day, day):
        try:
            keys.append(_key(store, path))
        except (InputError, StoreError):
            if not skip_unreadable:
                raise
    return keys


def _key(store: Store, path: str) -> SnapshotKey:
    store.verify(path)
    try:
        with store.open_file(path) as fh:
            parquet = pq.ParquetFile(fh)
            meta = (parquet.schema_arrow.metadata or {}).get(SNAPSHOT_METADATA)
            if meta is not None:
                found = json.loads(meta)
                return SnapshotKey(path, _utc(found["ts"]), str(found["model_version"]), str(found["written_at"]))
            names = parquet.schema_arrow.names
            if "ts" not in names or "model_version" not in names:
                raise InputError(
                    f"{path}: not usable predictions: no 'ts' or 'model_version' column (expected {PREDICTION_SCHEMA.names})"
                )
            # Written before snapshots: a whole scoring of one grid time, its key in its rows.
            rows = parquet.read(columns=["ts", "model_version"])
    except (pa.ArrowException, OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(unreadable_message(path, f"{type(exc).__name__}: {exc}")) from None
    if rows.num_rows == 0 or rows["ts"].null_count == rows.num_rows:
        raise InputError(f"{path}: not usable predictions: no rows (expected one per scored GPU)")
    versions = sorted({str(v) for v in rows["model_version"].to_pylist()})
    import pyarrow.compute as pc  # files written before snapshots only

    return SnapshotKey(path, _utc(pc.max(rows["ts"]).as_py()), ",".join(versions), "")


def _read_table(store: Store, path: str) -> pa.Table:
    store.verify(path)
    try:
        with store.open_file(path) as fh:
            # One file: ParquetFile, not read_table (whose dataset layer imports pandas).
            return pq.ParquetFile(fh).read()
    except (pa.ArrowException, OSError) as exc:
        raise InputError(unreadable_message(path, f"{type(exc).__name__}: {exc}")) from None


def _utc(value: Any) -> datetime:
    """A time (ISO text, datetime, pandas or numpy time) as an aware UTC datetime."""
    if isinstance(value, str):
        moment = datetime.fromisoformat(value)
    elif isinstance(value, datetime):
        moment = value.to_pydatetime() if hasattr(value, "to_pydatetime") else value
    else:
        import pandas as pd

        moment = pd.Timestamp(value).to_pydatetime()
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
