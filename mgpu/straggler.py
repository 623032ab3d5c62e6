"""Simulated stragglers (root section `straggler`): slow ranks you can reproduce on any machine.

A slowdown factor f makes a rank's compute take f times as long: each step the rank sleeps
(f - 1) x its own measured compute time of the previous step. `jitter_s` adds a random delay
per step and rank, exponentially distributed with that mean (a heavy-ish tail, like OS noise or
a busy neighbour), drawn from a generator seeded by (seed, rank) so runs repeat.
"""

from __future__ import annotations

import numpy as np


class Straggler:
    def __init__(self, slowdown: list[float], jitter_s: float, rank: int, seed: int) -> None:
        self.factor = slowdown[rank] if slowdown else 1.0
        self.jitter_s = jitter_s
        self.rng = np.random.default_rng([seed, rank])

    @property
    def active(self) -> bool:
        return self.factor > 1.0 or self.jitter_s > 0

    def delay_s(self, compute_s: float) -> float:
        """Seconds to sleep this step, given the rank's compute time of the previous step."""
        jitter = self.rng.exponential(self.jitter_s) if self.jitter_s > 0 else 0.0
        return (self.factor - 1.0) * compute_s + jitter
