"""`python -m mgpu.export kubernetes`: the composed job as a Kubeflow PyTorchJob, checked
against the operator's CRD schema (a trimmed copy, tests/pytorchjob_schema.json), not a cluster."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from mgpu.errors import ConfigError
from mgpu.export.__main__ import main, manifest

SCHEMA = json.loads((Path(__file__).parent / "pytorchjob_schema.json").read_text())


def validate(spec: dict) -> None:
    jsonschema.validate(spec, SCHEMA, cls=jsonschema.Draft7Validator)


def test_a_two_node_job_is_a_valid_pytorchjob_of_one_master_and_one_worker(tmp_path,
                                                                           monkeypatch):
    monkeypatch.chdir(tmp_path)
    overrides = ["launch.nnodes=2", "strategy=fsdp", "optim.lr=3e-3", "tracking.uri=http://mlflow:5000"]
    text = manifest(["kubernetes", "--image", "reg/mgpu:1", "--name", "lr-3e-3",
                     "--gpus-per-node", "8", "--pvc", "shared", *overrides])
    spec = yaml.safe_load(text)
    validate(spec)
    assert "&id" not in text  # plain YAML: no anchors for kubectl or a reader to follow
    assert (spec["apiVersion"], spec["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    replicas = spec["spec"]["pytorchReplicaSpecs"]
    assert {role: r["replicas"] for role, r in replicas.items()} == {"Master": 1, "Worker": 1}
    for replica in replicas.values():
        [container] = replica["template"]["spec"]["containers"]
        assert container["image"] == "reg/mgpu:1"
        assert container["resources"] == {"limits": {"nvidia.com/gpu": 8}}
        command = container["command"]
        # nproc_per_node=auto: one process per GPU of the pod
        assert command[:3] == ["torchrun", "--nnodes=2", "--nproc_per_node=8"]
        assert command[-len(overrides) - 2:] == ["-m", "mgpu", *overrides]
        assert container["workingDir"] == container["volumeMounts"][0]["mountPath"]
        claim = replica["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]
        assert claim == {"claimName": "shared"}


def test_one_node_is_a_master_alone(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = yaml.safe_load(manifest(["kubernetes", "strategy=ddp"]))
    validate(spec)
    [(role, replica)] = spec["spec"]["pytorchReplicaSpecs"].items()
    assert (role, replica["replicas"]) == ("Master", 1)
    [container] = replica["template"]["spec"]["containers"]
    assert "--nproc_per_node=2" in container["command"] and "resources" not in container


@pytest.mark.parametrize("break_it", [
    lambda s: s["spec"].update(pytorchReplicaSpec=s["spec"].pop("pytorchReplicaSpecs")),
    lambda s: s["spec"]["pytorchReplicaSpecs"]["Master"].update(replicas="1"),
    lambda s: s["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    .pop("name"),
    lambda s: s["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    .update(resources={"limits": {"nvidia.com/gpu": "eight"}}),
])
def test_the_schema_refuses_a_broken_manifest(break_it, tmp_path, monkeypatch):
    """The check can fail: a misspelt field, a wrong type, a missing name, a bad quantity."""
    monkeypatch.chdir(tmp_path)
    spec = yaml.safe_load(manifest(["kubernetes", "--gpus-per-node", "1"]))
    broken = copy.deepcopy(spec)
    break_it(broken)
    with pytest.raises(jsonschema.ValidationError):
        validate(broken)


def test_a_config_mistake_is_one_line_and_no_manifest(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["kubernetes", "launch.nnodes=1:2"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == ("mgpu: config error: launch.nnodes=1:2: an elastic job is not exported to "
                   "Kubernetes; use a fixed launch.nnodes\n")
    assert main(["kubernetes", "strategy.bucket_cap=3"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("mgpu: config error: ") and "strategy.bucket_cap" in line, line
    with pytest.raises(ConfigError, match="--name=Bad_Name"):
        manifest(["kubernetes", "--name", "Bad_Name"])
