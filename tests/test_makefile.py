"""The Makefile's targets do what README.md says they do (dry runs: nothing is started)."""

from __future__ import annotations

import os
import subprocess

from tests.conftest import ROOT


def test_make_ui_serves_the_store_of_the_directory_make_is_run_from(tmp_path):
    """README: "`make ui` serves the store in the working directory", where `python -m mgpu`
    run there writes it, also with `make -C <repo>` from another directory."""
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["PWD"] = str(tmp_path)
    recipe = subprocess.run(["make", "-n", "-s", "-C", str(ROOT), "ui"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=60, check=True).stdout
    assert f"sqlite:///{tmp_path}/mlflow.db" in recipe, recipe
