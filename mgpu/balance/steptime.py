"""Each rank's step time as a fixed cost plus a cost per sample, and the split that evens it out.

A rank's own work in a step (its busy time, see `clock.py`) is not proportional to its local
batch: kernel launches, Python, the per-parameter hooks and the start of the backward pass cost
the same for 4 samples as for 400. Splitting the global batch in proportion to measured
samples/s treats all of that as per-sample work, which is right only where the fixed part is
negligible (large batches); at small ones it moves too little work at a time or, with the rates
smoothed across splits, the wrong amount. So each rank's busy seconds for a local batch of b
samples are modelled as

    t(b) = fixed_s + per_sample_s x b,

fitted by weighted least squares over the local batch sizes the rank has run (`fit`), newer
measurements weighing more (`remember`). The split is then the one whose slowest rank is
predicted to finish first (`equal_finish_split`): where the lines are straight it makes every
rank finish together. With one size measured the fixed cost cannot be told from the per-sample
one. The first time, the prior is a line through the origin — the proportional split — which
also moves the ranks to a second size, and from there on the fit has two. Later, once a rank
has run one size long enough for the others to be forgotten, the prior is its last fitted line
scaled through the new measurement: a rank that got slower is slower at both costs, and what
was learnt of their ratio is kept (the line through the origin would read a mostly fixed step
as all per-sample cost, and send the share down to one sample). Two guards keep noise from
moving the split (`next_split`): a new split must be predicted to gain more than a hysteresis,
and no share more than doubles or halves at once.

All of it is plain arithmetic on Python floats, so every rank, given the same gathered
measurements, computes bitwise the same split.
"""

from __future__ import annotations

import math
from typing import NamedTuple

#: A size measured this many windows ago weighs `ema` ** age in the fit; once that is below
#: this the record is dropped: a speed measured long ago (before throttling, before a busy
#: neighbour left) should not steer the slope for ever.
FORGOTTEN_BELOW = 0.01


class StepTime(NamedTuple):
    """A rank's predicted busy seconds for a local batch: fixed_s + per_sample_s x size."""

    fixed_s: float
    per_sample_s: float

    def at(self, size: int) -> float:
        return self.fixed_s + self.per_sample_s * size

    def scaled(self, speed: float) -> StepTime:
        """The same rank expected to run `speed` times as fast."""
        return StepTime(self.fixed_s / speed, self.per_sample_s / speed)


#: A rank's measurements: local batch size -> (median busy seconds, age in windows).
History = dict[int, tuple[float, int]]


def remember(history: History, size: int, seconds: float, ema: float) -> History:
    """`history` after one more window, run at `size`, whose median step took `seconds`.

    Every record ages by one window. A size measured before is blended with its old value,
    which weighs `ema` ** (its age + 1), so a size run for many windows in a row is an EMA of
    them; a record whose weight has fallen below FORGOTTEN_BELOW is dropped.
    """
    aged = {s: (t, age + 1) for s, (t, age) in history.items()
            if ema ** (age + 1) >= FORGOTTEN_BELOW}
    if size in aged:
        past = ema ** aged[size][1]
        seconds = past * aged[size][0] + (1 - past) * seconds
    aged[size] = (seconds, 0)
    return aged


def fit(history: History, ema: float, prior: StepTime | None = None) -> StepTime:
    """Least squares of busy seconds against local batch size, each size weighted by `ema` **
    its age, with neither cost negative.

    Where the unconstrained line has a negative fixed cost or cost per sample (noise on sizes
    close together, not a machine), the fit is the better of the two lines on that border: the
    line through the origin (all cost per sample) or the flat line (all fixed cost), whichever
    leaves the smaller weighted squared error. Times that do not grow with the size are then
    flat: a share shrunk further would not finish sooner. With one size in the history the fit
    is `prior` (the rank's last fitted line) scaled to pass through its measurement, or without
    one the line through the origin, the proportional prior (see the module's docstring).
    """
    weights = {size: ema ** age for size, (_, age) in history.items()}
    total = sum(weights.values())
    mean_size = sum(w * size for size, w in weights.items()) / total
    mean_s = sum(w * history[size][0] for size, w in weights.items()) / total
    spread = sum(w * (size - mean_size) ** 2 for size, w in weights.items())
    through_origin = StepTime(0.0, sum(w * size * history[size][0] for size, w in weights.items())
                              / sum(w * size * size for size, w in weights.items()))
    if spread == 0:
        size = next(iter(history))
        if prior is None or prior.at(size) <= 0:
            return through_origin
        return prior.scaled(prior.at(size) / mean_s)
    slope = sum(w * (size - mean_size) * (history[size][0] - mean_s)
                for size, w in weights.items()) / spread
    fixed = mean_s - slope * mean_size
    if slope >= 0 and fixed >= 0:
        return StepTime(fixed, slope)

    def error(line: StepTime) -> float:
        return sum(w * (line.at(size) - history[size][0]) ** 2 for size, w in weights.items())

    return min((through_origin, StepTime(mean_s, 0.0)), key=error)


def slowest_s(models: list[StepTime], sizes: list[int]) -> float:
    """The predicted busy seconds of the slowest rank: what a synchronous step waits for."""
    return max(model.at(size) for model, size in zip(models, sizes, strict=True))


def equal_finish_split(models: list[StepTime], total: int, low: list[int],
                       high: list[int]) -> list[int]:
    """Integers within [`low`, `high`] per rank, summing to `total`, that minimise the slowest
    rank's predicted time (`sum(low) <= total <= sum(high)`).

    The continuous answer is the finish time T at which the ranks' sizes (T - fixed) /
    per-sample, each clamped to its bounds, add up to `total`; found by bisection, each size
    rounded down. The few samples left go one at a time to the rank that would finish soonest
    with one more (ties to the lower rank, so every rank computes the same split).
    """
    def size_at(model: StepTime, finish_s: float, lo: int, hi: int) -> int:
        if model.per_sample_s == 0:  # flat: past its fixed cost it takes any size, at it none
            return hi if finish_s > model.fixed_s else lo
        return min(hi, max(lo, math.floor((finish_s - model.fixed_s) / model.per_sample_s)))

    def sizes_at(finish_s: float) -> list[int]:
        return [size_at(m, finish_s, lo, hi) for m, lo, hi in zip(models, low, high, strict=True)]

    early = min(m.at(lo) for m, lo in zip(models, low, strict=True))
    late = max(m.at(hi) for m, hi in zip(models, high, strict=True))
    for _ in range(100):  # float64 bisection: exhausted well before 100 halvings
        middle = (early + late) / 2
        if middle in (early, late):
            break
        if sum(sizes_at(middle)) <= total:
            early = middle
        else:
            late = middle
    sizes = sizes_at(early)
    while sum(sizes) < total:
        rank = min((r for r in range(len(models)) if sizes[r] < high[r]),
                   key=lambda r: (models[r].at(sizes[r] + 1), r))
        sizes[rank] += 1
    return sizes


def next_split(models: list[StepTime], current: list[int], total: int, minimum: int,
               hysteresis: float) -> list[int]:
    """The equal-finish split where it is predicted to shorten the slowest rank's time by more
    than the fraction `hysteresis`, else `current`: a split within noise of the best one stays,
    so the sizes settle instead of following every window's noise.

    No share more than doubles or halves at once (within `minimum`): a line fitted on the sizes
    a rank has run is trusted near them, and a noisy fit far beyond them would send the split
    far off before the next window could correct it.
    """
    low = [max(minimum, math.ceil(size / 2)) for size in current]
    high = [2 * size for size in current]
    best = equal_finish_split(models, total, low, high)
    if slowest_s(models, best) < (1 - hysteresis) * slowest_s(models, current):
        return best
    return current
