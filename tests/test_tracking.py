"""What a run records about itself in the tracking store."""

from __future__ import annotations

from mlflow.tracking import MlflowClient
from mlflow.utils.validation import (
    MAX_ENTITY_KEY_LENGTH,
    MAX_PARAM_VAL_LENGTH,
    MAX_TAG_VAL_LENGTH,
)

from mgpu import tracking
from tests.conftest import make_job


def test_a_password_in_the_tracking_uri_is_masked_everywhere_the_run_records_it(
    tmp_path, monkeypatch
):
    """A store whose URI carries a password (a file store takes one and ignores it, as a
    stand-in for postgresql://user:secret@host/db): the run's params, tags, name and
    artifacts show the URI with the password masked and never the password itself."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = f"file://user:s3cret@localhost{tmp_path}/mlruns"
    overrides = [f"tracking.uri={uri}", "seed=1"]
    job = make_job(overrides, tmp_path / "out")
    run_id = tracking.start_job_run(job, {"strategy": "ddp"}, overrides)

    client = MlflowClient(uri)
    run = client.get_run(run_id)
    assert run.data.params["tracking.uri"] == f"file://user:***@localhost{tmp_path}/mlruns"
    recorded = [*run.data.params.values(), *run.data.tags.values(), run.info.run_name]
    for artifact in ("config.yaml", "overrides.yaml"):
        recorded.append((tmp_path / "mlruns").joinpath(
            run.info.experiment_id, run_id, "artifacts", artifact).read_text())
    assert not [text for text in recorded if "s3cret" in text]


def test_credentials_are_masked_and_the_rest_of_the_uri_kept():
    mask = tracking.mask_credentials
    assert mask("postgresql://user:secret@db.example:5432/mlflow") == \
        "postgresql://user:***@db.example:5432/mlflow"
    assert mask("https://user:token@mlflow.example/") == "https://user:***@mlflow.example/"
    assert mask("postgresql://db.example/mlflow?user=me&password=secret&sslmode=require") == \
        "postgresql://db.example/mlflow?user=me&password=***&sslmode=require"
    for plain in ("sqlite:////tmp/mlflow.db", "http://127.0.0.1:5000", "databricks"):
        assert mask(plain) == plain


def test_env_values_whose_names_say_secret_are_masked(tmp_path):
    """An `env.<NAME>` param never shows the value of a variable named like a credential;
    the others are logged as set."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("env")).info.run_id
    secret = {"HF_TOKEN": "t0k", "AWS_SECRET_ACCESS_KEY": "s3c", "WANDB_API_KEY": "k3y",
              "DB_PASSWORD": "pw", "GOOGLE_APPLICATION_CREDENTIALS": "/keys/me.json",
              "my_token": "low"}
    plain = {"NCCL_IB_DISABLE": "1", "GLOO_SOCKET_IFNAME": "lo"}
    tracking.log_env(uri, run_id, {**secret, **plain}, tmp_path / "out")

    params = client.get_run(run_id).data.params
    assert {name: params[f"env.{name}"] for name in secret} == dict.fromkeys(secret, "***")
    assert {name: params[f"env.{name}"] for name in plain} == plain


def test_params_and_tags_of_any_size_are_logged_within_mlflows_limits(tmp_path, monkeypatch):
    """A 10,000-char run name (also a param and in the overrides tag), a 10,000-char param
    and error, and two 300-char param keys that share their first 250 chars: all logged, each
    value cut to MLflow's limit with a marker that says how long it was, each key shortened to
    250 chars and the two kept apart, the run ended with its status."""
    monkeypatch.chdir(tmp_path)  # the store's artifacts go to ./mlruns
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    name = "n" * 10_000
    overrides = [f"tracking.uri={uri}", f"tracking.run_name={name}"]
    job = make_job(overrides, tmp_path / "out")
    long_keys = ["data." + "k" * 295, "data." + "k" * 294 + "x"]
    extra = {long_keys[0]: "first", long_keys[1]: "second", "data.source": "s" * 10_000}
    run_id = tracking.start_job_run(job, {"strategy": "ddp"}, overrides, extra)
    tracking.finish_run(uri, run_id, "FAILED", tmp_path / "out", error="e" * 10_000)

    run = MlflowClient(uri).get_run(run_id)
    params, tags = run.data.params, run.data.tags
    assert run.info.status == "FAILED"
    assert not (tmp_path / "out" / tracking.SPOOL_FILE).exists()
    assert len(run.info.run_name) <= 250
    for value, limit in [(params["tracking.run_name"], MAX_PARAM_VAL_LENGTH),
                         (params["data.source"], MAX_PARAM_VAL_LENGTH),
                         (tags["mgpu.overrides"], MAX_TAG_VAL_LENGTH),
                         (tags[tracking.ERROR_TAG], MAX_TAG_VAL_LENGTH),
                         (run.info.run_name, 250)]:
        assert len(value) <= limit
        assert value.endswith(" chars]") and "…[truncated, " in value, value[-40:]
    assert params["data.source"].endswith("…[truncated, 10000 chars]")
    shortened = {value: key for key, value in params.items() if value in ("first", "second")}
    assert set(shortened) == {"first", "second"}
    assert all(len(key) <= MAX_ENTITY_KEY_LENGTH for key in params)
    assert shortened["first"] != shortened["second"]
    assert shortened["first"].startswith(long_keys[0][:200])
