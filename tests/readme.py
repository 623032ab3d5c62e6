"""What README.md promises, read out of its text: tests compare these with what the code does,
so an edit to either side that breaks the promise fails."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Command:
    """A command of a runnable README block, and the output lines the README quotes for it."""

    line: int  # where the block starts in README.md
    text: str
    quoted: tuple[str, ...]

    @property
    def exit_code(self) -> int:
        """What the quoted output promises: 2 for a config error, 1 for a failed run, else 0."""
        if any(q.startswith("mgpu: config error:") for q in self.quoted):
            return 2
        return 1 if any(q.startswith("mgpu: run failed:") for q in self.quoted) else 0


# A fenced block and the marker comment on the line before it, if any.
BLOCK = re.compile(r"^(?:<!-- (runnable|illustration[^>]*) -->\n)?```(\w*)\n(.*?)^```$",
                   re.M | re.S)


def blocks() -> list[tuple[int, str | None, str]]:
    """Every fenced block of README.md: (its line, its marker or None, its text)."""
    text = README.read_text()
    return [(text.count("\n", 0, m.start()) + 1, m[1], m[3]) for m in BLOCK.finditer(text)]


def commands() -> list[Command]:
    """The commands of every block marked runnable, in README order. A block is either shell
    lines (`# comments`, `\\` continuations) or a console transcript: `$ command` lines, each
    followed by the output the README quotes for it (`...` stands for lines left out)."""
    found = []
    for line, marker, body in blocks():
        if marker != "runnable":
            continue
        if body.startswith("$ "):
            for part in body.split("$ ")[1:]:
                text, *quoted = part.rstrip("\n").split("\n")
                found.append(Command(line, text, tuple(q for q in quoted if q != "...")))
            continue
        for logical in body.replace("\\\n", " ").splitlines():
            if shlex.split(logical, comments=True):
                found.append(Command(line, logical, ()))
    return found


def normalized(line: str) -> str:
    """An output line with what differs from run to run made generic: the run's output dir,
    the store, run ids, and the figures of the closing lines."""
    line = re.sub(r"\S*/outputs/\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d", "<outputs>", line.rstrip())
    line = re.sub(r"sqlite:///\S*mlflow\.db", "<store>", line)
    line = re.sub(r"\b[0-9a-f]{32}\b", "<run id>", line)
    if line.startswith(("mgpu: done.", "  MLflow:", "  open:")):
        line = re.sub(r"\d[\d,.]*", "<n>", line)
    return line
