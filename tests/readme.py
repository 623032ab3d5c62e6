"""What README.md promises, read out of its text: tests compare these with what the code does,
so an edit to either side that breaks the promise fails."""

from __future__ import annotations

import re

from tests.conftest import ROOT

README = ROOT / "README.md"


def section(title: str) -> str:
    """The text of the README section whose heading is `title`, up to the next heading."""
    text = README.read_text()
    match = re.search(rf"^#+ {re.escape(title)}\n(.*?)(?=^#+ |\Z)", text, re.M | re.S)
    assert match, f"README.md has no section '{title}'"
    return match[1]


def prometheus_series() -> set[str]:
    """The series the Prometheus section lists: the `mgpu_...` names of its first paragraph."""
    first_paragraph = section("Prometheus and Grafana").split("\n\n")[0]
    return set(re.findall(r"`(mgpu_[a-z_]+)", first_paragraph))
