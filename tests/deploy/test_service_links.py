"""The kubelet's service-link variables (`enableServiceLinks`, on by default) in a gpufail pod:
a Service named gpufail-serve gives every later pod of the namespace GPUFAIL_SERVE_SERVICE_HOST,
GPUFAIL_SERVE_PORT, ... The configuration loader ignores them, so every command still starts,
and a mistyped override of the same shape is still refused."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from gpufail.config import load_settings
from ingest.store import Store
from tests.cli import gpufail
from tests.deploy.conftest import KUBERNETES
from tests.deploy.kubectl import render


def service_links(service: dict[str, Any], cluster_ip: str) -> dict[str, str]:
    """What the kubelet sets for one Service with a cluster IP (pkg/kubelet/envvars): the name
    upper-cased with `-` as `_`; its first port as the Service's, every port by number and
    protocol, the named ones by name."""
    name = service["metadata"]["name"].upper().replace("-", "_")
    ports = service["spec"]["ports"]
    first = ports[0]
    env = {
        f"{name}_SERVICE_HOST": cluster_ip,
        f"{name}_SERVICE_PORT": str(first["port"]),
        f"{name}_PORT": f"{first.get('protocol', 'TCP').lower()}://{cluster_ip}:{first['port']}",
    }
    for port in ports:
        protocol = port.get("protocol", "TCP")
        if port.get("name"):
            env[f"{name}_SERVICE_PORT_{port['name'].upper().replace('-', '_')}"] = str(port["port"])
        key = f"{name}_PORT_{port['port']}_{protocol}"
        env[key] = f"{protocol.lower()}://{cluster_ip}:{port['port']}"
        env[f"{key}_PROTO"] = protocol.lower()
        env[f"{key}_PORT"] = str(port["port"])
        env[f"{key}_ADDR"] = cluster_ip
    return env


@pytest.fixture(scope="module")
def kubelet_env() -> dict[str, str]:
    """The service links a pod of the example overlay's namespace gets: its Services with a
    cluster IP (the headless collector Service gives none), and a second Service of the kind a
    cluster adds beside them (two ports, one named with a dash, an IPv6 address)."""
    services = [o for o in render(KUBERNETES / "overlays" / "example") if o["kind"] == "Service"]
    env: dict[str, str] = {}
    for service in services:
        if service["spec"].get("clusterIP") != "None":
            env |= service_links(service, "10.96.4.17")
    canary = {
        "metadata": {"name": "gpufail-serve-canary"},
        "spec": {"ports": [{"name": "http-alt", "port": 8081}, {"name": "metrics", "port": 9410, "protocol": "UDP"}]},
    }
    env |= service_links(canary, "fd00:10:96::4a")
    assert "GPUFAIL_SERVE_SERVICE_HOST" in env and "GPUFAIL_SERVE_PORT_8080_TCP_ADDR" in env
    assert "GPUFAIL_COLLECT_SERVICE_HOST" not in env
    return env


def test_the_loader_ignores_service_links_with_a_debug_note(kubelet_env, caplog):
    with caplog.at_level(logging.DEBUG, logger="gpufail.config"):
        settings = load_settings(
            environ=kubelet_env | {"GPUFAIL_SERVE__PORT": "9090"}, cwd=Path("/nonexistent"), system=Path("/nonexistent")
        )
    assert settings.serve.port == 9090
    noted = {r.getMessage().split(":")[0].removeprefix("environment variable ") for r in caplog.records}
    assert noted == set(kubelet_env)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("GPUFAIL_SERVE_PORT", "8080"),  # GPUFAIL_SERVE__PORT meant; the kubelet's is tcp://IP:PORT
        ("GPUFAIL_SERVE_SERVICE_HOST", "serve.example.com"),  # the kubelet's is an address
        ("GPUFAIL_STORE_ROOT", "/data"),
    ],
)
def test_a_mistyped_override_of_the_same_shape_is_still_refused(name, value):
    result = gpufail("config", "show", env={name: value})
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"gpufail: error: environment variable {name}: expected GPUFAIL_<TABLE>__<KEY>, e.g. GPUFAIL_LABELS__HORIZON"
    )


def test_config_show_runs_and_lists_none_of_them(kubelet_env):
    result = gpufail("config", "show", "--json", env=kubelet_env)
    assert result.returncode == 0, result.stderr
    assert not any(name in result.stdout for name in kubelet_env)


def test_collect_runs_with_service_links(kubelet_env, tmp_path):
    log = tmp_path / "kern.log"
    log.write_text(
        "2026-01-01T00:00:00+00:00 gpu-node-017 kernel: NVRM: Xid (PCI:0000:18:00): 79, pid=1, name=python3, "
        "GPU has fallen off the bus.\n"
    )
    root = tmp_path / "data"
    env = kubelet_env | {
        "GPUFAIL_COLLECT__KERNEL_LOG_SOURCE": "files",
        "GPUFAIL_COLLECT__KERNEL_LOG_PATHS": json.dumps([str(log)]),
        "GPUFAIL_COLLECT__NODE": "gpu-node-017",
        "GPUFAIL_COLLECT__LISTEN": "",
    }
    result = gpufail("collect", "--data", str(root), "--source", "kernel-log", "--once", env=env)
    assert result.returncode == 0, result.stderr
    assert Store.open(str(root)).dates("xid_events")


def test_serve_reaches_its_own_configuration_check(kubelet_env, tmp_path):
    """`gpufail serve` gets past the loader to the checks of its settings: a read token is
    required and none is set."""
    env = kubelet_env | {"GPUFAIL_SERVE__READ_REQUIRES_TOKEN": "true"}
    result = gpufail("serve", "--data", str(tmp_path), env=env)
    assert result.returncode == 2
    assert "[serve] read_requires_token is true, but neither GPUFAIL_SERVE_READ_TOKEN" in result.stderr


def test_nightly_reaches_its_data_root(kubelet_env, tmp_path):
    """`gpufail nightly` loads its settings and stops only at the empty data root."""
    root = tmp_path / "data"
    Store.create(str(root))
    result = gpufail("nightly", "--data", str(root), "--quiet", env=kubelet_env)
    assert result.returncode != 0
    assert "no telemetry; collect or simulate data before running the nightly job" in result.stderr
    assert "environment variable" not in result.stderr
