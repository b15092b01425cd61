"""The job map benchmark (benchmarks/jobs.py) runs, on a small fleet, and builds what it says."""

import json

from benchmarks.jobs import fleet_jobs, main, squeue_text
from serving.jobs import slurm_job_map


def test_the_generated_squeue_text_reads_as_the_jobs_it_was_built_from():
    names, records = fleet_jobs(nodes=200, jobs=500)
    job_map = slurm_job_map(squeue_text(records))
    assert len(job_map.jobs) == 500
    gang = [j for j in job_map.jobs if j.gpus >= 64 * 8]
    assert gang and set().union(*(j.gpus_on for j in gang)) == set(names[:100])  # half the fleet
    assert {j.gpus for j in job_map.jobs if j not in gang} == {0, 1}


def test_the_benchmark_reports_every_stage(tmp_path):
    out = tmp_path / "bench.json"
    main(["--nodes", "200", "--jobs", "500", "--repeat", "1", "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["jobs"] == 500 and 100 < result["busy_nodes"] <= 200  # the gang half and some small-job nodes
    assert set(result["seconds"]) == {"parse", "loads", "inputs", "decide", "total", "kubernetes"}
    assert sum(result["options"].values()) == 200
