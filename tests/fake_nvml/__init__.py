"""A fake libnvidia-ml.so.1 (fake_nvml.c), its build, and scenarios drawn from real captures.

Used by the NVML collector's tests and by its benchmark (`benchmarks.nvml_collector`)."""
