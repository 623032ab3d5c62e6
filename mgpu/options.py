"""The options in conf/ and the classes their `_target_`s name.

`_target_` is the registry: an option is a YAML file in conf/<group>/ naming its class, and a
user's own class plugs in the same way. These lookups turn a class back into the option name a
user writes (for messages) and list a group's options (for the support matrix). `build` is the
one way an option is made from its node.
"""

from __future__ import annotations

import copy
import functools
import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from mgpu.errors import ConfigError
from mgpu.job import GROUPS

CONF = Path(__file__).resolve().parents[1] / "conf"


def import_target(path: str) -> Any:
    """The class or function a `_target_` string names."""
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"_target_={path}: cannot import it ({e})") from None


def build(node: dict[str, Any], **runtime_args: Any) -> Any:
    """The object a group node describes: its `_target_` called with the node's arguments and
    the `runtime_args` only a worker knows (a model's input shape). A run's options are made
    through `Options`, once per process; the support matrix makes conf/'s."""
    kwargs = {k: v for k, v in node.items() if k != "_target_"}
    return import_target(node["_target_"])(**kwargs, **runtime_args)


def conf_nodes(group: str) -> dict[str, dict]:
    """{option name: its YAML as a dict} for every file in conf/<group>/ with a `_target_`."""
    return copy.deepcopy(_load_group(group))


@functools.cache
def _load_group(group: str) -> dict[str, dict]:
    nodes = {}
    for path in sorted((CONF / group).glob("*.yaml")):
        node = OmegaConf.to_container(OmegaConf.load(path))
        if node.get("_target_"):
            nodes[path.stem] = node
    return nodes


def option_name(group: str, target: str) -> str:
    """How a user selects `target`: `group=<option>` where conf/ has it, else by its _target_."""
    name = next((n for n, node in conf_nodes(group).items() if node["_target_"] == target), None)
    return f"{group}={name}" if name else f"{group}._target_={target}"


@dataclass(frozen=True)
class Options:
    """The job's group options, built once per process by `Options.of`: in the parent, so
    each option's own checks run before launch, and in each worker, to train with. The model
    is built last, by `model(...)`, once the data has told its input shape."""

    strategy: Any
    precision: Any
    compression: Any
    network: Any
    balance: Any
    data: Any
    optim: Any
    task: Any
    model_node: dict[str, Any]
    #: What strategy=auto planned before it was replaced by its choice (None: not planned).
    planned: Any = None

    @classmethod
    def of(cls, nodes: Mapping[str, Any]) -> Options:
        """Every group option of `nodes` (a job's group nodes by group name: the checked
        values in `prepare`, `job.groups()` after), built through `build`."""
        built = {g: build(nodes[g]) for g in GROUPS if g != "model"}
        return cls(**built, model_node=nodes["model"])

    def model(self, **runtime_args: Any) -> Any:
        """The configured model, with the arguments only a worker knows (`input_shape`,
        `num_classes`)."""
        return build(self.model_node, **runtime_args)
