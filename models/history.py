"""What the comparison reads of every row of the data, not only of the test period's: the
failures the data knows (an alarm's long window is judged against failures after the test
period too, and the failure rate before it sets the expected K), the grid times, and each
GPU's node. It is small whatever the fleet (the positive rows, one time per grid time, one
node per GPU), so a store read a day at a time keeps it for the whole data: the history of
consecutive parts merges into the history of the whole (`History.merged`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from models.evaluate import failure_episodes
from models.frame import labels, require_columns, to_pandas

_POSITIVE_COLUMNS = ("ts", "gpu_uuid", "label", "time_to_failure_h")


@dataclass(frozen=True)
class History:
    positives: pd.DataFrame
    """ts, gpu_uuid, label (1) and, where known, time_to_failure_h of every positive row."""
    times: np.ndarray
    """Every grid time of the data (labelled or not), as UTC nanoseconds, sorted."""
    nodes: pd.Series | None
    """gpu_uuid -> node (its first row's), where the rows name the node."""

    @classmethod
    def of(cls, frame: Any) -> History:
        """The history of a feature frame (ts, gpu_uuid, label; time_to_failure_h and node
        where present)."""
        df = to_pandas(frame)
        require_columns(df, ["ts", "gpu_uuid", "label"], "history frame")
        positive = (labels(df) == 1).to_numpy()
        kept = [c for c in _POSITIVE_COLUMNS if c in df.columns]
        positives = df.loc[positive, kept].reset_index(drop=True)
        times = np.unique(_ns(df["ts"]))
        nodes = None
        if "node" in df.columns:
            pairs = df[["gpu_uuid", "node"]].drop_duplicates("gpu_uuid")
            nodes = pd.Series(pairs["node"].astype(str).to_numpy(), index=pairs["gpu_uuid"].astype(str).to_numpy())
        return cls(positives, times, nodes)

    @classmethod
    def merged(cls, parts: Sequence[History]) -> History:
        """The history of the data whose consecutive parts, in time order, are `parts`."""
        positives = pd.concat([p.positives for p in parts], ignore_index=True) if parts else pd.DataFrame()
        times = np.unique(np.concatenate([p.times for p in parts])) if parts else np.zeros(0, dtype=np.int64)
        named = [p.nodes for p in parts if p.nodes is not None]
        nodes = None
        if named:
            both = pd.concat(named)
            nodes = both[~both.index.duplicated(keep="first")]
        return cls(positives, times, nodes)

    def episodes(self) -> pd.DataFrame:
        """gpu_uuid, failure_ts of every failure episode the labelled rows show."""
        return failure_episodes(self._positive_frame(self.positives))

    @property
    def last(self) -> pd.Timestamp:
        """The data's last grid time."""
        return pd.Timestamp(int(self.times[-1]), tz="UTC")

    def expected_failures_per_day(self, before: pd.Timestamp) -> float:
        """Failure episodes per day shown by the rows before `before`, over the days those rows
        span (`models.evaluate.expected_failures_per_day` of those rows)."""
        times = self.times[self.times < before.value]
        ts = _ns(self.positives["ts"]) if len(self.positives) else np.zeros(0, dtype=np.int64)
        episodes = failure_episodes(self._positive_frame(self.positives.loc[ts < before.value]))
        days = max((times[-1] - times[0]) / pd.Timedelta(days=1).value, 1.0) if len(times) else 1.0
        return len(episodes) / days

    @staticmethod
    def _positive_frame(positives: pd.DataFrame) -> pd.DataFrame:
        if len(positives.columns):
            return positives
        return pd.DataFrame({"ts": pd.Series(dtype="datetime64[ns, UTC]"), "gpu_uuid": [], "label": []})


def _ns(ts: Any) -> np.ndarray:
    """UTC nanoseconds of a column of times (naive ones read as UTC)."""
    return pd.DatetimeIndex(pd.to_datetime(ts, utc=True)).as_unit("ns").asi8
