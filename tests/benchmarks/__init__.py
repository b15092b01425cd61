"""Tests of the benchmarks (`benchmarks/`): that each runs and reports what it says; never their
figures."""
