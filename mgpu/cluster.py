"""`${mgpu.allocation_endpoint:PORT}`: the rendezvous of a job a cluster scheduler runs on
several nodes at once (Hydra's submitit launcher: `experiment=slurm`).

Such a job is one allocation: the scheduler starts `python -m mgpu`'s job function once on each
of its nodes (`tasks_per_node: 1`), and every node must name the same rendezvous endpoint. The
allocation's first host serves it, on PORT plus the job id modulo 1000, so that jobs of one
sweep sharing a host do not share a port. Outside a submitit job, or on one node, it is empty:
the rendezvous is this machine's, on a free port.
"""

from __future__ import annotations

import os

from omegaconf import OmegaConf


def allocation_endpoint(port: int) -> str:
    """host:port of the allocation's rendezvous, or "" where there is one node."""
    if not os.environ.get("SUBMITIT_EXECUTOR"):
        return ""
    import submitit  # only inside a submitit job, where it is installed

    allocation = submitit.JobEnvironment()
    if allocation.num_nodes < 2:
        return ""
    job_id = allocation.raw_job_id
    offset = int(job_id) % 1000 if job_id.isdigit() else 0
    return f"{allocation.hostnames[0]}:{int(port) + offset}"


OmegaConf.register_new_resolver("mgpu.allocation_endpoint", allocation_endpoint, replace=True)
