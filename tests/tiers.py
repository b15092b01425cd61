"""The four tiers most tests publish with (enter, exit): watch 0.2/0.1, avoid 0.35/0.25,
drain_after_job 0.5/0.35, drain_now 0.8/0.6 — the example configuration's ladder."""

from serving.policy import Tier

FOUR_TIERS = (
    Tier("watch", 0.2, 0.1),
    Tier("avoid", 0.35, 0.25),
    Tier("drain_after_job", 0.5, 0.35),
    Tier("drain_now", 0.8, 0.6),
)
