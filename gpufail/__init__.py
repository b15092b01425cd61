"""gpufail: predict GPU failures in training fleets (README.md)."""

import os

# Polars allocates with jemalloc, whose default sends every allocation over 8 MiB (a column of a
# million float64s) to an arena that hands the memory back to the kernel at once, so every new
# large column faults its pages in again. On a 2-day paper-fleet feature build, keeping them in
# the ordinary arenas (which return memory after a few seconds) took the wall time from 160-172 s
# to 137 s. It must be set before polars is first imported, so it lives here, where every
# `gpufail` command starts; a setting already in the environment wins.
os.environ.setdefault("_RJEM_MALLOC_CONF", "background_thread:true,oversize_threshold:0")
