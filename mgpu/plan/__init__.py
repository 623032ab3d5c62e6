"""The planner behind strategy=auto: which layouts of the model over the ranks fit in memory,
and how fast each would step, predicted without starting a process.

`python -m mgpu.plan <overrides>` prints the ranked table for a job; `plan_job` is the same as
a function. See `candidates` (what is weighed), `memory` (bytes per rank), `speed` (step
time) and `machine` (what is known of this machine).
"""

from mgpu.plan.candidates import Candidate, candidates
from mgpu.plan.planner import Row, format_table, plan_job, rank_rows, smallest

__all__ = ["Candidate", "Row", "candidates", "format_table", "plan_job", "rank_rows", "smallest"]
