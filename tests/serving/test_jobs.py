"""The job map readers (serving/jobs.py) on real `squeue --json` output of Slurm 22.05
(tests/fixtures/slurm), pod lists as the Kubernetes API returns them, and the job document."""

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from serving.jobs import (
    Job,
    JobMap,
    JobMapUnreadable,
    expand_hostlist,
    exposure,
    job_map_from_document,
    kubernetes_job_map,
    node_loads,
    read_job_document,
    slurm_job_map,
)

SQUEUE = Path(__file__).parents[1] / "fixtures" / "slurm" / "squeue-22.05.json"
STARTED = datetime.fromtimestamp(1795664127, UTC)  # the running jobs' start_time in the capture
H = timedelta(hours=1)


@pytest.mark.parametrize(
    ("expression", "names"),
    [
        ("gpu[001-003,007]", ["gpu001", "gpu002", "gpu003", "gpu007"]),
        ("gpu005", ["gpu005"]),
        ("gpu[001-002],cpu1", ["gpu001", "gpu002", "cpu1"]),
        ("rack[1-2]-n[08-09]", ["rack1-n08", "rack1-n09", "rack2-n08", "rack2-n09"]),
        ("", []),
    ],
)
def test_slurm_hostlists_expand_with_their_padding(expression, names):
    assert expand_hostlist(expression) == names


@pytest.mark.parametrize("bad", ["gpu[001-", "gpu[a-b]", "gpu]1["])
def test_a_broken_hostlist_is_refused_with_the_expression(bad):
    with pytest.raises(ValueError, match="hostlist"):
        expand_hostlist(bad)


def test_real_squeue_json_gives_the_running_jobs_with_their_gpus_per_node():
    jobs = slurm_job_map(SQUEUE.read_bytes()).by_id()
    # Completed, cancelled and pending jobs hold no node.
    assert sorted(jobs, key=int) == ["7", "8", "9", "10", "11"]
    assert jobs["7"].gpus_on == {"gpu001": 8, "gpu002": 8} and jobs["7"].gpus == 16
    assert jobs["8"].gpus_on == {"gpu003": 3}
    assert jobs["9"].gpus_on == {"gpu004": 0}  # a CPU-only job: no GPU at risk
    assert jobs["10"].gpus_on == {"gpu005": 2}  # --gpus=2 (per job)
    assert jobs["11"].gpus_on == {"gpu006": 4, "gpu007": 4}
    assert jobs["7"].start == STARTED and (jobs["7"].owner, jobs["7"].group) == ("root", "gpu")


def test_the_checkpoint_comment_and_the_time_limit_are_read():
    job_map = slurm_job_map(SQUEUE.read_bytes())
    jobs = job_map.by_id()
    assert jobs["7"].checkpoint_at == datetime(2026, 11, 26, 3, 0, tzinfo=UTC)
    assert jobs["7"].end_by is None  # no time limit
    assert jobs["8"].end_by == STARTED + timedelta(minutes=90)
    # "gpufail_checkpoint=yesterday" is not a time: the job is kept, its checkpoint assumed.
    assert jobs["10"].checkpoint_at is None
    assert job_map.notices == (
        "job 10: comment: 'yesterday' is not an ISO time such as 2026-01-05T10:00:00Z; the assumed checkpoint "
        "interval is used",
    )


def test_node_loads_give_blast_radius_and_work_at_risk():
    now = STARTED + 90 * timedelta(minutes=1)
    loads = node_loads(slurm_job_map(SQUEUE.read_bytes()), now, checkpoint_interval=H)
    # Job 7 (16 GPUs) checkpointed at 03:00, before it started at 03:35:27: the start counts.
    assert loads["gpu001"].blast_radius == 16 and loads["gpu001"].used_gpus == 8
    assert loads["gpu001"].work_at_risk == pytest.approx(16 * 1.5)
    assert loads["gpu001"].assumed == () and loads["gpu001"].hours_to_end == float("inf")
    # Job 8 (3 GPUs) reports nothing: a checkpoint every hour from its start, the last 30 min ago.
    assert loads["gpu003"].work_at_risk == pytest.approx(3 * 0.5) and loads["gpu003"].assumed == ("8",)
    assert loads["gpu003"].hours_to_end == pytest.approx(0.0)  # its 90-minute limit is up
    assert loads["gpu004"].blast_radius == 0 and loads["gpu004"].work_at_risk == 0.0
    assert "gpu008" not in loads  # idle


def test_a_jobs_exposure_gives_the_hours_to_its_next_checkpoint():
    now = STARTED + 5 * H + 20 * timedelta(minutes=1)
    # No report: hourly from the start, the last one 20 min ago, the next in 40.
    assumed = exposure(Job("1", {"n": 8}, start=STARTED), now, H)
    assert (assumed.gpus, assumed.interval, assumed.to_end) == (8, 1.0, float("inf"))
    assert (assumed.since, assumed.to_checkpoint) == pytest.approx((1 / 3, 2 / 3))
    # A report 20 min ago: its next one interval after it.
    reported = exposure(Job("2", {"n": 4}, start=STARTED, checkpoint_at=now - 20 * timedelta(minutes=1)), now, 2 * H)
    assert (reported.since, reported.to_checkpoint) == pytest.approx((1 / 3, 5 / 3))
    # A report older than the interval (the job checkpoints less often): within the next interval.
    late = exposure(Job("3", {"n": 4}, start=STARTED, checkpoint_at=STARTED, end_by=now + H / 2), now, H)
    assert (late.since, late.to_checkpoint, late.to_end) == pytest.approx((16 / 3, 1.0, 0.5))
    loads = node_loads(JobMap((Job("1", {"n": 8}, start=STARTED),)), now, H)
    assert loads["n"].exposures == (assumed,)


def test_a_reported_checkpoint_in_the_future_counts_as_now():
    job = Job("1", {"n": 8}, start=STARTED, checkpoint_at=STARTED + 5 * H)
    assert job.hours_since_checkpoint(STARTED + H, H) == (0.0, False)


def test_later_slurm_releases_number_and_state_shapes_are_read():
    record = {
        "job_id": 42,
        "job_state": ["RUNNING"],
        "nodes": "n[1-2]",
        "job_resources": {"nodes": {"allocation": [{"name": "n1"}, {"name": "n2"}]}},
        "gres_detail": [],
        "tres_alloc_str": "cpu=2,gres/gpu=16,node=2",
        "start_time": {"set": True, "infinite": False, "number": 1795664127},
        "time_limit": {"set": True, "infinite": True, "number": 0},
        "comment": {"job": "gpufail_checkpoint=2026-11-26T03:40:00Z"},
    }
    job = slurm_job_map(json.dumps({"jobs": [record]})).jobs[0]
    assert job.gpus_on == {"n1": 8, "n2": 8} and job.end_by is None and job.start == STARTED
    assert job.checkpoint_at == datetime(2026, 11, 26, 3, 40, tzinfo=UTC)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("squeue: error: Unable to contact slurm controller", "squeue --json: not JSON"),
        ('{"nodes": []}', "expected Slurm's"),
        ('{"jobs": [], "errors": ["Unable to contact slurm controller"]}', "reported"),
        ('{"jobs": [{"job_state": "RUNNING"}]}', "job record 0 is not a Slurm job"),
    ],
)
def test_unreadable_squeue_output_is_one_line_naming_it(text, message):
    with pytest.raises(JobMapUnreadable, match=message) as err:
        slurm_job_map(text)
    assert "\n" not in str(err.value)


def pod(name, node, gpus, *, namespace="ml", owner=None, labels=None, annotations=None, phase="Running", start=None):
    meta = {"name": name, "namespace": namespace, "labels": labels or {}, "annotations": annotations or {}}
    if owner:
        meta["ownerReferences"] = [{"kind": owner[0], "name": owner[1], "controller": True, "uid": "u"}]
    resources = {"limits": {"nvidia.com/gpu": str(gpus)}} if gpus else {}
    return {
        "metadata": meta,
        "spec": {"nodeName": node, "containers": [{"name": "c", "resources": resources}]},
        "status": {"phase": phase, "startTime": (start or STARTED).isoformat().replace("+00:00", "Z")},
    }


def test_pods_are_grouped_into_jobs_by_label_jobset_owner_or_alone():
    pods = [
        pod(
            "w0",
            "gpu001",
            8,
            owner=("PyTorchJob", "llm"),
            annotations={"gpufail.io/checkpoint-at": "2026-11-26T04:00:00Z"},
        ),
        pod(
            "w1",
            "gpu002",
            8,
            owner=("PyTorchJob", "llm"),
            annotations={"gpufail.io/checkpoint-at": "2026-11-26T04:30:00Z"},
        ),
        pod("a-0", "gpu003", 4, owner=("Job", "js-a"), labels={"jobset.sigs.k8s.io/jobset-name": "js"}),
        pod("b-0", "gpu004", 4, owner=("Job", "js-b"), labels={"jobset.sigs.k8s.io/jobset-name": "js"}),
        pod("x", "gpu005", 2, labels={"gpufail.io/job": "exp-7"}),
        pod("solo", "gpu006", 1),
        pod("cpu", "gpu006", 0, owner=("Job", "etl")),  # no GPU: not a job of ours
        pod("queued", "gpu007", 8, phase="Pending"),
    ]
    jobs = kubernetes_job_map(pods).by_id()
    assert set(jobs) == {"ml/PyTorchJob/llm", "ml/JobSet/js", "ml/exp-7", "ml/Pod/solo"}
    llm = jobs["ml/PyTorchJob/llm"]
    assert llm.gpus_on == {"gpu001": 8, "gpu002": 8} and llm.pods == ("ml/w0", "ml/w1")
    assert llm.checkpoint_at == datetime(2026, 11, 26, 4, 30, tzinfo=UTC)  # the newest pod's
    assert jobs["ml/JobSet/js"].gpus == 8


def test_a_pod_deadline_is_the_jobs_end_and_requests_count_like_limits():
    p = pod("w", "gpu001", 0)
    p["spec"]["activeDeadlineSeconds"] = 3600
    p["spec"]["containers"][0]["resources"] = {"requests": {"nvidia.com/gpu": 2}}
    job = kubernetes_job_map([p]).jobs[0]
    assert job.gpus == 2 and job.end_by == STARTED + H


def test_a_bad_pod_annotation_is_a_notice_and_a_broken_pod_an_error():
    job_map = kubernetes_job_map([pod("w", "gpu001", 8, annotations={"gpufail.io/checkpoint-at": "soon"})])
    assert job_map.jobs[0].checkpoint_at is None
    assert "pod ml/w: annotation gpufail.io/checkpoint-at: 'soon' is not an ISO time" in job_map.notices[0]
    with pytest.raises(JobMapUnreadable, match="item 0 is not a pod"):
        kubernetes_job_map([{"spec": {}}])


def test_the_job_document_of_a_custom_scheduler(tmp_path):
    doc = {
        "jobs": [
            {
                "id": "run-1",
                "nodes": {"n1": 8, "n2": 8},
                "start": "2026-11-26T00:00:00Z",
                "checkpoint_at": "2026-11-26T02:00:00Z",
                "end_by": None,
                "owner": "alice",
            }
        ]
    }
    path = tmp_path / "jobs.json"
    path.write_text(json.dumps(doc))
    job_map = read_job_document(str(path), timeout=5)
    assert job_map == JobMap(
        (
            Job(
                "run-1",
                {"n1": 8, "n2": 8},
                start=datetime(2026, 11, 26, tzinfo=UTC),
                checkpoint_at=datetime(2026, 11, 26, 2, tzinfo=UTC),
                owner="alice",
            ),
        ),
        f"job map {path}",
    )


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ("[]", r'expected \{"jobs": \[...\]\}'),
        ('{"jobs": [{"id": "a"}]}', r"jobs\[0\] is not a job \(KeyError: 'nodes'\)"),
        ('{"jobs": [{"id": "a", "nodes": {"n": -1}}]}', "a negative GPU count"),
        ('{"jobs": [{"id": "a", "nodes": {"n": 1}, "start": "2026-11-26T00:00:00"}]}', "has no time zone"),
    ],
)
def test_a_bad_job_document_is_one_line_naming_the_job(doc, message):
    with pytest.raises(JobMapUnreadable, match=message):
        job_map_from_document(doc, "job map jobs.json")


def test_a_missing_job_document_says_so(tmp_path):
    with pytest.raises(JobMapUnreadable, match="cannot be read"):
        read_job_document(str(tmp_path / "none.json"), timeout=5)
    with pytest.raises(JobMapUnreadable, match="no answer"):
        read_job_document("http://127.0.0.1:9/jobs.json", timeout=2)
