"""Network options: what each sets, that the workers see exactly that, topology and sysctl."""

from __future__ import annotations

import logging
import os

import pytest

from mgpu.launch import launch
from mgpu.network import sysctl, topology
from mgpu.network.default import DefaultNetwork
from mgpu.network.topology import Topology
from mgpu.options import build
from tests.conftest import CONF, assert_refused, make_job

NETWORKS = sorted(p.stem for p in (CONF / "network").glob("*.yaml"))
REPORT_ENV = "task._target_=tests.report_env_task.ReportEnv"
# Constructor keys that are not environment variables.
NOT_VARIABLES = {"_target_", "bucket_cap_mb", "gradient_as_bucket_view", "env",
                 "topology_aware_order", "check_sysctl"}


def nvml_present() -> bool:
    try:
        topology.pynvml.nvmlInit()
    except topology.pynvml.NVMLError:
        return False
    topology.pynvml.nvmlShutdown()
    return True


@pytest.mark.parametrize("option", NETWORKS)
def test_each_option_sets_only_the_variables_its_config_names(option, tmp_path):
    node = make_job([f"network={option}"], tmp_path).network
    env = build(node).env()
    named = {k.upper() for k, v in node.items() if k not in NOT_VARIABLES and v is not None}
    assert set(env) == named | set(node["env"])
    assert all(isinstance(value, str) for value in env.values())


def test_options_set_what_their_fabric_needs(tmp_path):
    def env(option: str) -> dict[str, str]:
        return build(make_job([f"network={option}"], tmp_path).network).env()

    assert env("default") == {}
    assert env("nvlink") == {"NCCL_IB_DISABLE": "1", "NCCL_P2P_LEVEL": "NVL"}
    assert env("infiniband")["NCCL_IB_DISABLE"] == "0"
    assert env("infiniband")["NCCL_IB_GID_INDEX"] == "3"
    ethernet = env("ethernet")
    assert ethernet["NCCL_IB_DISABLE"] == "1" and ethernet["NCCL_SOCKET_IFNAME"] == "^lo,docker"
    assert int(ethernet["NCCL_SOCKET_NTHREADS"]) * int(ethernet["NCCL_NSOCKS_PERTHREAD"]) == 16


@pytest.mark.dist
def test_workers_see_their_jobs_settings_and_no_earlier_jobs(tmp_path):
    """Two jobs in one process, as in a sweep: the second must not inherit the first's settings."""
    before = {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "GLOO_"))}
    first = [REPORT_ENV, "network=ethernet", "network.bucket_cap_mb=5",
             "network.gradient_as_bucket_view=false", "+network.env.NCCL_DEBUG=WARN"]
    second = [REPORT_ENV, "network=default"]
    for overrides, expected_cap, view in ((first, 5, False), (second, 25, True)):
        job = make_job(overrides, tmp_path / overrides[1].replace("=", "-"))
        network = build(job.network)
        results = launch(job, None, network.prepare_node(tmp_path))
        assert set(results) == {0, 1}
        for report in results.values():
            assert report["env"] == {**before, **network.env()}
            assert report["bucket_bytes_cap"] == expected_cap * 1024 * 1024
            assert report["gradient_as_bucket_view"] is view
    assert results[0]["env"] == before  # network=default sets nothing
    assert {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "GLOO_"))} == before


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["+network.env.FOO=[1,2]"], "network.env.FOO=[1, 2]: environment values must be strings"),
        (["network=ethernet", "+network.env.NCCL_IB_DISABLE=0"],
         "network.env.NCCL_IB_DISABLE: also set by network.nccl_ib_disable"),
        (["network.nccl_socket_nthreads=32"], "network.nccl_socket_nthreads=32: must be in 1..16"),
        (["network=ethernet", "network.nccl_nsocks_perthread=32"],
         "network.nccl_nsocks_perthread=32: must be >= 1, and nccl_socket_nthreads x"),
        (["network.nccl_graph_file=/no/such/graph.xml"], "network.nccl_graph_file=/no/such/"),
        (["network.nccl_ib_gid_index=-1"], "network.nccl_ib_gid_index=-1: must be >= 0"),
        (["network.bucket_cap_mb=0"], "network.bucket_cap_mb=0"),
        (["network=nvlink", "launch.nnodes=2"], "network=nvlink is for one machine"),
        (["network=pcie", "launch.nnodes=2"], "network=pcie is for one machine"),
    ],
)
def test_bad_network_input_is_one_config_error(overrides, message, tmp_path):
    assert_refused(overrides, message, tmp_path)


def write_sysctl(root, values: dict[str, str]) -> None:
    for name, value in values.items():
        path = root / name.replace(".", "/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(value + "\n")


def test_sysctl_check_warns_with_the_command_and_writes_nothing(tmp_path):
    low = {"net.core.rmem_max": "212992", "net.core.wmem_max": "16777216",
           "net.ipv4.tcp_rmem": "4096 131072 6291456", "net.ipv4.tcp_wmem": "4096 16384 33554432"}
    write_sysctl(tmp_path, low)
    warnings = sysctl.check(tmp_path)
    assert warnings == [
        "net.core.rmem_max=212992 is below 16777216 for multi-node training; "
        'to raise it: sudo sysctl -w net.core.rmem_max="16777216"',
        "net.ipv4.tcp_rmem=4096 131072 6291456 is below 16777216 for multi-node training; "
        'to raise it: sudo sysctl -w net.ipv4.tcp_rmem="4096 131072 16777216"',
    ]
    for name, value in low.items():  # read only
        assert (tmp_path / name.replace(".", "/")).read_text() == value + "\n"
    (tmp_path / "net/core/wmem_max").unlink()
    assert sysctl.check(tmp_path)[1].startswith("cannot read net.core.wmem_max")


@pytest.mark.skipif(not os.path.isdir("/proc/sys/net/core"), reason="needs Linux /proc/sys")
def test_sysctl_check_reads_this_machine():
    assert not [w for w in sysctl.check() if w.startswith("cannot read")]


@pytest.mark.skipif(nvml_present(), reason="checks the behaviour without NVML")
def test_without_nvml_topology_is_one_log_line_and_nothing_else(tmp_path, caplog):
    network = DefaultNetwork(topology_aware_order=True, env={"NCCL_DEBUG": "WARN"})
    with caplog.at_level(logging.DEBUG):
        env = network.prepare_node(tmp_path)
    assert env == {"NCCL_DEBUG": "WARN"}
    [record] = caplog.records
    assert record.getMessage().startswith("network: no NVML")
    assert not (tmp_path / topology.TOPOLOGY_FILE).exists()


def two_pairs() -> Topology:
    """GPUs 0-2 and 1-3 joined by 4 NVLinks, 2-1 and 3-0 by 2, 0-1 and 2-3 only across CPUs."""
    links = [["X", "SYS", "NV4", "NV2"],
             ["SYS", "X", "NV2", "NV4"],
             ["NV4", "NV2", "X", "SYS"],
             ["NV2", "NV4", "SYS", "X"]]
    return Topology([f"gpu{i}" for i in range(4)], [f"GPU-{i}" for i in range(4)], links)


def test_ring_order_puts_nvlink_peers_side_by_side():
    found = two_pairs()
    assert found.ring_quality([0, 1, 2, 3]) == (10, 10 + 102 + 10 + 102)
    assert found.ring_order() == [0, 2, 1, 3]  # NV4, NV2, NV4, NV2 around the ring
    table = found.table()
    assert table.splitlines()[1].split() == ["GPU0", "X", "SYS", "NV4", "NV2"]
    assert "ring order: 0,2,1,3" in table


def test_ring_order_beyond_exact_search_follows_the_fast_links():
    hidden = [0, 7, 3, 9, 1, 5, 8, 2, 6, 4]  # NVLink only between neighbours of this ring
    n = len(hidden)
    links = [["X" if i == j else "PHB" for j in range(n)] for i in range(n)]
    for a, b in zip(hidden, hidden[1:] + hidden[:1], strict=True):
        links[a][b] = links[b][a] = "NV1"
    found = Topology([f"gpu{i}" for i in range(n)], [f"GPU-{i}" for i in range(n)], links)
    order = found.ring_order()
    assert sorted(order) == list(range(n))
    assert found.ring_quality(order) == found.ring_quality(hidden)


def test_device_order_respects_a_users_choice(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert topology.device_order(two_pairs()) == {"CUDA_VISIBLE_DEVICES": "GPU-0,GPU-2,GPU-1,GPU-3"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    assert topology.device_order(two_pairs()) == {}


@pytest.mark.gpu
@pytest.mark.skipif(not nvml_present(), reason="needs NVML (a GPU driver)")
def test_topology_reads_this_machines_gpus(tmp_path):
    found = topology.read_topology()
    n = len(found.names)
    assert n >= 1 and len(found.links) == n and all(len(row) == n for row in found.links)
    assert all(found.links[i][i] == "X" for i in range(n))
    assert sorted(found.ring_order()) == list(range(n))
    env = DefaultNetwork(topology_aware_order=True).prepare_node(tmp_path)
    assert (tmp_path / topology.TOPOLOGY_FILE).read_text() == found.table()
    if "CUDA_VISIBLE_DEVICES" not in os.environ:
        assert sorted(env["CUDA_VISIBLE_DEVICES"].split(",")) == sorted(found.uuids)
