"""gpufail: predict GPU failures in training fleets (README.md)."""

import os


def polars_allocator_settings(cores: int) -> str:
    """The jemalloc settings (`_RJEM_MALLOC_CONF`) gpufail runs polars with, on `cores` cores.

    Polars' own defaults hand freed memory back to the kernel within ~1.5 s (dirty 500 ms, muzzy
    1000 ms) and every allocation over 8 MiB at once, so the feature build, which allocates and
    frees columns of millions of values all the time, spent up to half its CPU time faulting
    fresh pages in and zeroing them. Keeping freed pages 20 s cuts the page faults about threefold
    and the build's time by about a fifth, for a higher peak; one arena per core takes back most
    of that peak (the arenas reuse each other's pages less than threads do their own arena's) and,
    rather than jemalloc's four, keeps that reuse on bigger machines too (docs/decisions.md; the
    feature build's figures in docs/performance.md)."""
    return f"background_thread:true,oversize_threshold:0,dirty_decay_ms:20000,muzzy_decay_ms:0,narenas:{max(1, cores)}"


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# It must be set before polars is first imported (jemalloc reads it once, at its first
# allocation), so it lives here, where every `gpufail` command starts; a setting already in the
# environment wins.
os.environ.setdefault("_RJEM_MALLOC_CONF", polars_allocator_settings(_cores()))
