"""Cluster presets, without a cluster: what a SLURM allocation's environment resolves to, and
the objective a sweeper gets."""

from __future__ import annotations

from mgpu.cluster import allocation_endpoint
from tests.conftest import assert_refused, compose_config


def test_a_multi_node_allocation_meets_at_its_first_host(monkeypatch):
    """Every node of a SLURM allocation names the same endpoint: its first host, on a port
    offset by the job id so that jobs sharing a host do not share it."""
    for name, value in {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "123456",
                        "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]"}.items():
        monkeypatch.setenv(name, value)
    assert allocation_endpoint(29500) == "gpu07:29956"
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "1")
    assert allocation_endpoint(29500) == ""  # one node: this machine's rendezvous


def test_outside_an_allocation_the_endpoint_is_this_machines(monkeypatch):
    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    assert allocation_endpoint(29500) == ""


def test_objective_direction_is_maximize_or_minimize(tmp_path):
    assert_refused(["tracking.objective.direction=down"],
                   "tracking.objective.direction=down: use maximize or minimize", tmp_path)


def test_optuna_preset_goes_the_objectives_way():
    for direction in ("maximize", "minimize"):
        cfg = compose_config(["experiment=optuna", f"tracking.objective.direction={direction}"],
                             hydra=True)
        assert cfg.hydra.sweeper.direction == direction
