"""`python -m mgpu.export kubernetes [--image I] [--name N] [--gpus-per-node G] [--pvc C]
<overrides>`: the composed, checked job as a Kubeflow PyTorchJob manifest (YAML on stdout)."""

from __future__ import annotations

import argparse
import sys

import yaml
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from mgpu.__main__ import one_line
from mgpu.config import prepare
from mgpu.errors import ConfigError
from mgpu.export.kubernetes import pytorchjob
from mgpu.options import CONF


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m mgpu.export", description=__doc__)
    parser.add_argument("engine", choices=["kubernetes"])
    parser.add_argument("--image", default="mgpu:latest", help="container image with mgpu")
    parser.add_argument("--name", default="mgpu", help="the PyTorchJob's name (a DNS label)")
    parser.add_argument("--gpus-per-node", type=int, default=0,
                        help="GPUs each pod requests; launch.nproc_per_node=auto takes one "
                             "process per GPU (0: CPU pods)")
    parser.add_argument("--pvc", help="a PersistentVolumeClaim every pod mounts as its working "
                                      "dir, where outputs and checkpoints go")
    return parser.parse_known_args(argv)


def manifest(argv: list[str]) -> str:
    """The manifest as YAML; a config mistake raises ConfigError before anything is written.

    The job is composed and checked here as `python -m mgpu` would (on pods with
    --gpus-per-node GPUs); its output dir is the pods' own, so a placeholder stands in."""
    args, overrides = parse(argv)
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="config", overrides=[*overrides, "output_dir=."])
    job, _ = prepare(cfg, args.gpus_per_node, None)
    spec = pytorchjob(job, overrides, name=args.name, image=args.image,
                      gpus_per_node=args.gpus_per_node, pvc=args.pvc)
    return yaml.safe_dump(spec, sort_keys=False)


def main(argv: list[str]) -> int:
    """Print the manifest; a user mistake is one line, as `python -m mgpu` reports it."""
    try:
        print(manifest(argv), end="")
    except (ConfigError, HydraException, OmegaConfBaseException) as e:
        print(f"mgpu: config error: {one_line(e)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
