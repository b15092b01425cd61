"""Live collectors: one module per source (nvml, kernel_log, dcgm_exporter), one interface
(`ingest.collect.base.Collector`), run by `ingest.collect.daemon`."""
