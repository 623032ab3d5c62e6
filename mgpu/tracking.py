"""MLflow: the sweep's parent run, one run per job, and step metrics logged off the hot path.

The parent process creates and ends each job's run; rank 0 alone logs step metrics into it.
One `log_metric` call costs ~5 ms on a SQLite store, longer than a small training step, so
metrics are queued and written in batches by a background thread.

That thread is our own rather than MLflow's async logging (`log_batch(synchronous=False)`,
mlflow 3.17) because it measured cheaper on the training thread. The stream of a 500-step run
(20 metrics every 25 steps and a 20-metric summary) into a SQLite store, both loggers
interleaved in one script, medians of 5 (2-core machine, load average 1.6-2.2):
- cost of one `log` call on the training thread: 94-108 µs here against 296-436 µs for
  MLflow's (its per-call telemetry, entity copies and one pool task per call); 3.2-4.1×;
- the training loop around it: ×0.96-1.01 of the loop without logging here, ×1.06-1.12 with
  MLflow's, which writes each call as its own transaction concurrently with training
  (×1.02 with its `MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS=2`, whose flush at the end is
  reachable only through a private store attribute);
- the end, all points written: 36-37 ms here, 21-61 ms for MLflow's.
Both lost no point. MLflow's also logs an ERROR line per failed batch where this logs one
warning, and joins its threads at exit without a bound, where `close` here gives up after
`timeout_s`.

A store that goes away (a server down, a SQLite file locked or removed) does not end a run nor
lose what it logs: what the store cannot take (metric points, params, the final status) is kept
in order in a spool file in the job's output dir, and written when the store is back: at the
logger's next flush, at the run's end, or by `python -m mgpu.tracking sync OUTPUT_DIR`.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from mlflow.utils.validation import (
    MAX_ENTITY_KEY_LENGTH,
    MAX_PARAM_VAL_LENGTH,
    MAX_PARAMS_TAGS_PER_BATCH,
    MAX_TAG_VAL_LENGTH,
)
from omegaconf import OmegaConf

from mgpu.elastic import parse_nnodes
from mgpu.errors import ConfigError
from mgpu.job import Job

log = logging.getLogger(__name__)

PARENT_RUN_ENV = "MGPU_SWEEP_PARENT_RUN_ID"
PARENT_URI_ENV = "MGPU_SWEEP_TRACKING_URI"
ERROR_TAG = "mgpu.error"
MAX_METRICS_PER_BATCH = 1000
# The runs table's name column holds 250 characters (SQLite ignores it, other databases refuse).
MAX_RUN_NAME_LENGTH = 250
# The MLflow 3 UI opens experiments without this tag in its GenAI view.
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}
MASK = "***"
# Query parameters of a store URI whose values are credentials (postgresql://h/db?password=…).
CREDENTIAL_WORDS = ("password", "passwd", "secret", "token")
# Environment variables whose values are credentials (HF_TOKEN, AWS_SECRET_ACCESS_KEY, ...).
SECRET_ENV_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "CREDENTIAL")
URI_KEY = "tracking.uri"
SPOOL_FILE = "tracking_spool.jsonl"
# MLflow's HTTP client retries a failed request 7 times, backing off up to 2 minutes (~4 min
# in all): a server that is down would stall each write, and the end of the run, that long.
# What mgpu cannot write is spooled instead, so it gives up after ~3 s (connection refused) or
# ~35 s (a server that stopped answering). Set in the parent for its workers, unless the user
# set them.
HTTP_RETRY_ENV = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}


def _not_a_retry(entry: logging.LogRecord) -> bool:
    return not entry.getMessage().startswith("Retrying (")


# urllib3 warns at each retry of a request: while the store is down, two lines per flush. The
# spool's one warning per outage says it instead.
logging.getLogger("urllib3.connectionpool").addFilter(_not_a_retry)


def mask_credentials(uri: str) -> str:
    """`uri` as everyone who can read the store may see it: the password of its user info
    (`postgresql://user:***@host/db`) and the values of credential query parameters masked,
    everything else as written."""
    parts = urlsplit(uri)
    user_info, _, host = parts.netloc.rpartition("@")
    user, colon, _ = user_info.partition(":")
    netloc = f"{user}:{MASK}@{host}" if colon else parts.netloc
    query = _masked_query(parts.query)
    if (netloc, query) == (parts.netloc, parts.query):
        return uri  # as written, not as urlunsplit would normalise it
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def _masked_query(query: str) -> str:
    fields = []
    for field in query.split("&"):
        name, sep, value = field.partition("=")
        if sep and any(word in name.lower() for word in CREDENTIAL_WORDS):
            value = MASK
        fields.append(f"{name}{sep}{value}")
    return "&".join(fields)


def mask_override(override: str) -> str:
    """A command-line override as the run records it: `tracking.uri=…` with its credentials
    masked (`+tracking.uri=…` too)."""
    key, sep, value = override.partition("=")
    return f"{key}={mask_credentials(value)}" if sep and key.lstrip("+") == URI_KEY else override


def public_config(job: Job) -> dict[str, Any]:
    """The job as its params and `config.yaml` show it: `tracking.uri` with its credentials
    masked (the workers get the URI as written)."""
    config = job.as_dict()
    config["tracking"]["uri"] = mask_credentials(config["tracking"]["uri"])
    return config


def flatten(tree: Mapping, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} → {"a.b": 1}: the config as MLflow params."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def experiment_id(client: MlflowClient, name: str) -> str:
    """Id of the experiment `name`, created on first use (tolerating a concurrent creator)."""
    found = client.get_experiment_by_name(name)
    if found:
        return found.experiment_id
    try:
        return client.create_experiment(name, tags=EXPERIMENT_TAGS)
    except Exception:
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id


def start_job_run(
    job: Job, choices: Mapping[str, str], overrides: list[str],
    extra_params: Mapping[str, str] | None = None,
) -> str:
    """Create the job's run: params = flattened config (and `extra_params`: what the options
    state about themselves, `data_params`), tags = group choices and overrides."""
    run_id = create_job_run(job, choices, overrides)
    log_job_config(job, run_id, extra_params)
    return run_id


def create_job_run(job: Job, choices: Mapping[str, str], overrides: list[str]) -> str:
    """The job's run with its tags (group choices and overrides), before its params: a job
    that plans its strategy (strategy=auto) first runs its trials as this run's children."""
    tracking = job.tracking
    client = MlflowClient(tracking.uri)
    overrides = [mask_override(override) for override in overrides]
    tags = {group: str(option) for group, option in choices.items()}
    tags["mgpu.overrides"] = " ".join(overrides) or "(defaults)"
    tags["mgpu.output_dir"] = job.output_dir
    if os.environ.get(PARENT_RUN_ENV):
        tags["mlflow.parentRunId"] = os.environ[PARENT_RUN_ENV]
    name = tracking.run_name or " ".join(overrides) or "defaults"
    run = client.create_run(
        experiment_id(client, tracking.experiment),
        run_name=shortened(name, MAX_RUN_NAME_LENGTH),
        tags=tags_within_limits(tags),
    )
    client.log_text(run.info.run_id, OmegaConf.to_yaml(list(overrides)), "overrides.yaml")
    return run.info.run_id


def log_job_config(job: Job, run_id: str, extra_params: Mapping[str, str] | None = None
                   ) -> None:
    """The job's params (its flattened config and `extra_params`) and its config."""
    uri = job.tracking.uri
    config = public_config(job)
    values = {**flatten(config), **world_size_param(job), **(extra_params or {})}
    params = {key: value for key, value in values.items() if not key.endswith("_target_")}
    text = {"text": OmegaConf.to_yaml(config), "artifact_file": "config.yaml"}
    Spool(job.output_dir).deliver([*param_records(uri, run_id, params),
                                   record(uri, run_id, text=text)])


def world_size_param(job: Job) -> dict[str, str]:
    """`launch.world_size` as an elastic job's param: params never change, and the job runs at
    any size from MIN to MAX nodes' ranks (`launch.nnodes=MIN:MAX`), so it says "MIN:MAX" in
    ranks; the size the steps ran at is the metric `elastic/world_size` (`mgpu.elastic`)."""
    low, high = parse_nnodes(job.launch.nnodes)
    if low == high:
        return {}
    nproc = job.launch.nproc_per_node
    return {"launch.world_size": f"{low * nproc}:{high * nproc}"}


def data_params(data: object) -> dict[str, str]:
    """What the data option states about itself beyond its settings, where it does
    (`run_params`): a corpus that differs between machines, its size and source."""
    return data.run_params() if hasattr(data, "run_params") else {}


def log_env(uri: str, run_id: str, env: Mapping[str, str], output_dir: str | Path,
            topology: Path | None = None) -> None:
    """The variables the network group set for the workers, as `env.<NAME>` params (those keys
    only, never the rest of the environment; a credential's value masked), and the GPU
    topology table where one was read."""
    params = {f"env.{name}": env_value(name, value) for name, value in env.items()}
    records = param_records(uri, run_id, params)
    if topology and topology.exists():
        records.append(record(uri, run_id, artifact=str(topology)))
    Spool(output_dir).deliver(records)


def env_value(name: str, value: object) -> str:
    """`value` as its `env.<NAME>` param shows it: masked where the name says it is a
    credential (everyone who can read the store reads params)."""
    if any(word in name.upper() for word in SECRET_ENV_WORDS):
        return MASK
    return str(value)


def check_reachable(uri: str) -> None:
    """The store answers before any worker starts. A run it cannot create has no id to keep
    records under, so an outage at the start is for the user to mend; later ones are spooled."""
    try:
        MlflowClient(uri).search_experiments(max_results=1)
    except Exception as e:
        raise ConfigError(
            f"tracking.uri={mask_credentials(uri)}: MLflow does not answer ({first_line(e)}); "
            f"start it (make ui serves ./mlflow.db), set tracking.uri to a store that answers, "
            f"or train without one: tracking.enabled=false"
        ) from None


def continue_run(uri: str, run_id: str | None) -> str | None:
    """Reopen the run a checkpoint was saved by, so a resumed job continues it (its params
    stay as first logged); None if there is none or it is not in this store."""
    if run_id is None:
        return None
    client = MlflowClient(uri)
    try:
        client.get_run(run_id)
    except MlflowException:
        log.warning("run %s of the checkpoint is not in %s: starting a new run", run_id,
                    mask_credentials(uri))
        return None
    client.update_run(run_id, status="RUNNING")
    return run_id


def start_trial_run(uri: str, parent_run_id: str, name: str, layout: str) -> str:
    """A child run of the job's run for one timed trial of a planned layout (`mgpu.trial`)."""
    client = MlflowClient(uri)
    parent = client.get_run(parent_run_id)
    tags = {"mlflow.parentRunId": parent_run_id, "mgpu.trial": layout}
    return client.create_run(parent.info.experiment_id, run_name=name, tags=tags).info.run_id


def log_metrics(uri: str, run_id: str, metrics: Mapping[str, float], step: int,
                output_dir: str | Path) -> None:
    """A few figures the parent computed (not the workers' stream), in one batch."""
    now = int(time.time() * 1000)
    points = [[key, float(value), now, step] for key, value in metrics.items()]
    Spool(output_dir).deliver([record(uri, run_id, metrics=points)])


def finish_run(uri: str, run_id: str, status: str, output_dir: str | Path,
               error: str | None = None) -> None:
    """Close the run as FINISHED, FAILED or KILLED; a failure's summary becomes a tag.

    The final metrics are already in the run (or spooled before the status): rank 0 logs them
    at the last step.
    """
    records = [record(uri, run_id, tags=tags_within_limits({ERROR_TAG: error}))] if error else []
    records.append(record(uri, run_id, status=status, end_time=int(time.time() * 1000)))
    Spool(output_dir).deliver(records)


def close_running(uri: str, experiment: str, output_dir: str, status: str, error: str) -> None:
    """End as `status` every run of `output_dir` still RUNNING: in a multi-node job the run is
    global rank 0's, whose id a parent never gets when rank 0 dies without closing it."""
    client = MlflowClient(uri)
    try:
        found = client.get_experiment_by_name(experiment)
        if found is None:
            return
        runs = client.search_runs(
            [found.experiment_id],
            filter_string=f"tags.`mgpu.output_dir` = '{output_dir}' and "
                          "attributes.status = 'RUNNING'",
        )
    except MlflowException as e:  # the store is down: the runs stay RUNNING, the error stands
        log.warning("could not close the runs of %s in MLflow: %s", output_dir, first_line(e))
        return
    for run in runs:
        finish_run(uri, run.info.run_id, status, output_dir, error=error)


def short_http_retries() -> None:
    """MLflow's HTTP client gives up within seconds (`HTTP_RETRY_ENV`) where the user has not
    set its retries: the spool, not the client, rides out an outage of the store."""
    for name, value in HTTP_RETRY_ENV.items():
        os.environ.setdefault(name, value)


# A record, as written and as spooled: the store's `uri`, the `run_id` and one of "metrics"
# ([key, value, timestamp, step] each), "params", "tags", "text" ({"text", "artifact_file"}),
# "artifact" (a local path) or "status" (with "end_time").
Record = dict[str, Any]


def record(uri: str, run_id: str, **what: Any) -> Record:
    return {"uri": uri, "run_id": run_id, **what}


def param_records(uri: str, run_id: str, params: Mapping[str, object]) -> list[Record]:
    """`params` within MLflow's limits (`within_limits`), in records of at most its batch
    size."""
    items = [within_limits(key, value, MAX_PARAM_VAL_LENGTH) for key, value in params.items()]
    return [record(uri, run_id, params=dict(items[i : i + MAX_PARAMS_TAGS_PER_BATCH]))
            for i in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH)]


def tags_within_limits(tags: Mapping[str, object]) -> dict[str, str]:
    return dict(within_limits(key, value, MAX_TAG_VAL_LENGTH) for key, value in tags.items())


def within_limits(key: str, value: object, value_limit: int) -> tuple[str, str]:
    """`key` and `value` as MLflow takes them, for a config however large. MLflow refuses a
    key over 250 characters, and with it the whole batch it came in; such a key keeps its
    start and ends with a hash of all of it, so two long keys that share a start stay apart.
    A value over `value_limit` is cut with a marker (MLflow would cut it silently)."""
    if len(key) > MAX_ENTITY_KEY_LENGTH:
        suffix = "-truncated-" + hashlib.sha1(key.encode()).hexdigest()[:8]
        key = key[: MAX_ENTITY_KEY_LENGTH - len(suffix)] + suffix
    return key, shortened(str(value), value_limit)


def shortened(text: str, limit: int) -> str:
    """`text` cut to `limit` characters, its end saying how long it was."""
    if len(text) <= limit:
        return text
    marker = f"…[truncated, {len(text)} chars]"
    return text[: limit - len(marker)] + marker


def write_record(entry: Record) -> None:
    """Write one record to its run; raises what the store raises."""
    client = MlflowClient(entry["uri"])
    run_id = entry["run_id"]
    if "metrics" in entry:
        client.log_batch(run_id, metrics=[Metric(*point) for point in entry["metrics"]])
    if "params" in entry:
        client.log_batch(run_id, params=[Param(k, v) for k, v in entry["params"].items()])
    if "tags" in entry:
        client.log_batch(run_id, tags=[RunTag(k, v) for k, v in entry["tags"].items()])
    if "text" in entry:
        client.log_text(run_id, entry["text"]["text"], entry["text"]["artifact_file"])
    if "artifact" in entry:
        client.log_artifact(run_id, entry["artifact"])
    if "status" in entry:
        client.set_terminated(run_id, entry["status"], end_time=entry["end_time"])


def refused(error: Exception) -> bool:
    """Whether the store answered and refused a record (a 4xx: a param logged before with
    another value, a run deleted): writing it again would fail again. Anything else (no
    answer, 5xx, 429, a locked SQLite file) is an outage, which ends; so is a store that does
    not hold the run at all (its SQLite file removed, and made anew empty): it holds it again
    once the file is restored."""
    if not isinstance(error, MlflowException) or error.error_code == "RESOURCE_DOES_NOT_EXIST":
        return False
    status = error.get_http_status_code()
    return 400 <= status < 500 and status != 429


def first_line(error: Exception, limit: int = 200) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:limit]


class Spool:
    """The records the store could not take, one JSON line each in the order they were logged,
    in `SPOOL_FILE` of the job's output dir. Every write goes through it: while it holds
    records, new ones are written after them (or join them), so the run gets every record in
    order; it is removed once all it held was written.

    The rank writing metrics, the parent closing the run and a user's `sync` may share it:
    each holds a lock on the output dir while it reads and writes the spool.
    """

    def __init__(self, output_dir: str | Path) -> None:
        self.dir = Path(output_dir)
        self.path = self.dir / SPOOL_FILE

    def pending(self) -> bool:
        return self.path.exists()

    def deliver(self, records: list[Record]) -> int:
        """Write what the spool holds, then `records`; what the store cannot take now (the
        first record it fails on and all after) is kept. Returns how many records are kept.

        One warning when an outage starts (the spool was empty), one line when it ends.
        """
        with self._locked():
            spooled = self.records()
            pending = [*spooled, *records]
            failed, error = write_in_order(pending)
            if error is None:
                if spooled:
                    self.path.unlink()
                    log.info("MLflow is back: wrote the %d records kept in %s", len(spooled),
                             self.path)
                return 0
            if failed == 0:
                self._append(records)
            else:
                self._rewrite(pending[failed:])
            if not spooled:
                log.warning(
                    "MLflow at %s is unreachable (%s): training goes on; what it cannot take "
                    "is kept in %s and written when it is back (or by python -m mgpu.tracking "
                    "sync %s)", mask_credentials(pending[failed]["uri"]), first_line(error),
                    self.path, self.dir)
            return len(pending) - failed

    def records(self) -> list[Record]:
        if not self.path.exists():
            return []
        with self.path.open() as f:
            return [json.loads(line) for line in f if line.strip()]

    def _append(self, records: list[Record]) -> None:
        with self.path.open("a") as f:
            f.writelines(json.dumps(entry) + "\n" for entry in records)

    def _rewrite(self, records: list[Record]) -> None:
        part = self.path.with_suffix(".part")
        with part.open("w") as f:
            f.writelines(json.dumps(entry) + "\n" for entry in records)
        os.replace(part, self.path)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock


def write_in_order(records: list[Record]) -> tuple[int, Exception | None]:
    """Write `records` in order up to the first the store cannot take now: (its index, the
    error), or (len(records), None). A record the store refuses is dropped with a warning."""
    for i, entry in enumerate(records):
        try:
            write_record(entry)
        except Exception as e:
            if not refused(e):
                return i, e
            log.warning("MLflow refused a record of run %s (%s): dropped", entry["run_id"],
                        first_line(e))
    return len(records), None


def sync(output_dir: Path) -> int:
    """Write every spool under `output_dir` (a job's output dir, or a sweep's) to its store;
    0 if all were written, 1 if some store is still unreachable (the rest stays spooled)."""
    paths = sorted(output_dir.rglob(SPOOL_FILE))
    if not paths:
        print(f"nothing to sync: no {SPOOL_FILE} under {output_dir}")
        return 0
    code = 0
    for path in paths:
        spool = Spool(path.parent)
        count = len(spool.records())
        kept = spool.deliver([])
        if kept:
            print(f"{path}: MLflow still unreachable, {kept} records kept")
            code = 1
        else:
            print(f"{path}: wrote {count} records")
    return code


class MetricLogger:
    """Queues metric points and writes them to MLflow in batches from a background thread."""

    def __init__(self, uri: str, run_id: str, output_dir: str | Path,
                 flush_every_s: float = 2.0) -> None:
        self.uri = uri
        self.run_id = run_id
        self.spool = Spool(output_dir)
        self.flush_every_s = flush_every_s
        self.queue: queue.Queue[list | None] = queue.Queue()
        self.thread = threading.Thread(target=self._drain, name="mgpu-metrics", daemon=True)
        self.thread.start()

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        for key, value in metrics.items():
            self.queue.put([key, float(value), now, step])

    def close(self, timeout_s: float = 60.0) -> None:
        """Write everything still queued, then stop the thread.

        Bounded: a tracking store that stops answering must not keep a finished rank alive.
        """
        self.queue.put(None)
        with termination_deferred():
            self.thread.join(timeout_s)
        if self.thread.is_alive():
            log.warning("MLflow did not take the last metric points within %.0f s", timeout_s)

    def _drain(self) -> None:
        done = False
        while not done:
            batch: list[list] = []
            deadline = time.monotonic() + self.flush_every_s
            while len(batch) < MAX_METRICS_PER_BATCH and (left := deadline - time.monotonic()) > 0:
                try:
                    item = self.queue.get(timeout=left)
                except queue.Empty:
                    break
                if item is None:
                    done = True
                    break
                batch.append(item)
            self._write(batch)

    def _write(self, points: list[list]) -> None:
        """The batch, after what an outage left in the spool (retried at every flush)."""
        if not (points or self.spool.pending()):
            return
        records = [record(self.uri, self.run_id, metrics=points)] if points else []
        try:
            self.spool.deliver(records)
        except Exception as e:  # the spool itself failed (a full disk): training goes on
            log.warning("could not write nor keep %d metric points: %s", len(points), e)


@contextmanager
def termination_deferred() -> Iterator[None]:
    """SIGTERM waits for the block to end, then acts as it would have.

    The launcher ends a failed group with SIGTERM, which reaches rank 0 while it writes its
    last metric points; ending it there would lose the points still queued.
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set a handler; signals are handled there anyway
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if received:
            signal.raise_signal(signal.SIGTERM)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mgpu.tracking",
        description="Write to MLflow what a run kept while its tracking store was unreachable.")
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser(
        "sync", help=f"write the {SPOOL_FILE} files under OUTPUT_DIR to their runs")
    command.add_argument("output_dir", type=Path, help="a job's output dir, or a sweep's")
    args = parser.parse_args(argv)
    short_http_retries()
    return sync(args.output_dir)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
