"""The composed job as a Kubeflow `PyTorchJob` (kubeflow.org/v1, the training operator).

One pod per node: the Master pod and `launch.nnodes - 1` Worker pods, each running
`torchrun -m mgpu <overrides>` with `launch.nproc_per_node` processes. The operator gives every
pod MASTER_ADDR and MASTER_PORT (the Master pod's service), which Kubernetes expands in the
command: torchrun's c10d rendezvous meets there, and mgpu runs as under torchrun anywhere
(global rank 0 owns the MLflow run). Outputs go to the working dir, which `pvc` puts on a
volume every pod shares; `tracking.uri` must name a store the pods reach.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from mgpu.elastic import parse_nnodes
from mgpu.errors import ConfigError
from mgpu.job import Job

API_VERSION = "kubeflow.org/v1"
CONTAINER = "pytorch"  # the container name the operator looks for
MOUNT = "/mnt/mgpu"
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def pytorchjob(
    job: Job, overrides: list[str], *, name: str, image: str, gpus_per_node: int = 0,
    pvc: str | None = None,
) -> dict[str, Any]:
    """The manifest of `job` (composed from `overrides`, which each pod composes again)."""
    if not DNS_LABEL.fullmatch(name):
        raise ConfigError(f"--name={name}: use lower-case letters, digits and '-' (a DNS label)")
    min_nodes, max_nodes = parse_nnodes(job.launch.nnodes)
    if min_nodes != max_nodes:
        raise ConfigError(
            f"launch.nnodes={job.launch.nnodes}: an elastic job is not exported to Kubernetes; "
            f"use a fixed launch.nnodes")
    nproc = job.launch.nproc_per_node
    command = [
        "torchrun", f"--nnodes={min_nodes}", f"--nproc_per_node={nproc}",
        "--rdzv_backend=c10d", "--rdzv_endpoint=$(MASTER_ADDR):$(MASTER_PORT)",
        "-m", "mgpu", *overrides,
    ]
    container: dict[str, Any] = {"name": CONTAINER, "image": image, "command": command}
    if gpus_per_node:
        container["resources"] = {"limits": {"nvidia.com/gpu": gpus_per_node}}
    pod: dict[str, Any] = {"containers": [container]}
    if pvc:
        container["workingDir"] = MOUNT
        container["volumeMounts"] = [{"name": "outputs", "mountPath": MOUNT}]
        pod["volumes"] = [{"name": "outputs", "persistentVolumeClaim": {"claimName": pvc}}]
    replicas = {"Master": 1, "Worker": min_nodes - 1}
    # A copy per role: one shared object would be written as a YAML anchor and alias.
    return {
        "apiVersion": API_VERSION,
        "kind": "PyTorchJob",
        "metadata": {"name": name},
        "spec": {
            "pytorchReplicaSpecs": {
                role: {"replicas": count, "restartPolicy": "OnFailure",
                       "template": {"spec": copy.deepcopy(pod)}}
                for role, count in replicas.items() if count
            },
        },
    }
