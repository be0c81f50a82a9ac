import json
import os
import subprocess
import sys

import pytest
import yaml
from typer.testing import CliRunner

from tests.conftest import EXAMPLES, quickstart_data
from trnflow.cli.app import app

runner = CliRunner()


def test_validate_accepts_every_example(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the examples' relative paths: nothing there yet, wherever the checkout ran
    result = runner.invoke(app, ["validate", *map(str, sorted(EXAMPLES.glob("*.yaml")))])
    assert result.exit_code == 0, result.output
    assert result.output.count("ok ") == len(list(EXAMPLES.glob("*.yaml"))) == 6
    # the fine-tuning example's pretrained folder is made by the base example's run: noted, not refused
    said = "".join(result.output.split())  # however the console wraps it, long paths included
    assert "".join(f"note: model.params.pretrained: {tmp_path}/runs/causal-lm/base does not exist".split()) in said
    assert "arunrefusestostartwithoutit" in said


def test_validate_names_every_bad_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(quickstart_data(
        model={"params": {"colour": "blue"}}, train={"steps": "many"}, compute={"cores_per_node": 64})))
    result = runner.invoke(app, ["validate", str(bad)])
    assert result.exit_code == 2
    for field in ("model.params.colour", "train.steps", "compute.cores_per_node"):
        assert field in result.stderr


def test_validate_json_is_machine_readable(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(quickstart_data(train={"lr": -1})))
    result = runner.invoke(app, ["validate", "--json", str(bad), str(EXAMPLES / "quickstart.yaml")])
    report = json.loads(result.stdout)
    assert result.exit_code == 2
    assert [r["valid"] for r in report] == [False, True]
    assert report[0]["problems"][0].startswith("train.lr:")


def test_schema_is_the_jobspec_json_schema():
    result = runner.invoke(app, ["schema"])
    schema = json.loads(result.stdout)
    assert schema["title"] == "JobSpec"
    assert schema["additionalProperties"] is False
    assert {"model", "data", "compute", "compile", "train", "gate", "inference"} <= set(schema["properties"])


def test_devices_json_like_neuron_ls():
    result = runner.invoke(app, ["devices", "--instance-type", "trn1.32xlarge", "--json"])
    records = json.loads(result.stdout)
    assert len(records) == 16
    assert {r["nc_count"] for r in records} == {2}
    assert {r["memory_size"] for r in records} == {32 * 1024**3}


def test_devices_table_and_unknown_type():
    table = runner.invoke(app, ["devices"]).stdout
    assert "trn1.2xlarge" in table and "0-1" in table and "32 GB" in table
    result = runner.invoke(app, ["devices", "--instance-type", "p5.48xlarge"])
    assert result.exit_code == 2 and "unknown" in result.stderr


def test_bad_override_is_refused(tmp_path):
    result = runner.invoke(app, ["run", str(EXAMPLES / "quickstart.yaml"), "--set", "train.steps"])
    assert result.exit_code == 2
    assert "expected FIELD=VALUE" in result.stderr


def test_data_synth_writes_partitions(tmp_path):
    result = runner.invoke(app, ["data", "synth", str(tmp_path), "--days", "2", "--rows-per-day", "20",
                                 "--format", "parquet"])
    assert result.exit_code == 0, result.output
    parts = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.parquet"))
    assert parts == ["holdout/part-00000.parquet", "inference/part-00000.parquet",
                     "train/dt=2026-01-01/part-00000.parquet", "train/dt=2026-01-02/part-00000.parquet"]


def test_data_synth_writes_prompt_completion_rows_for_a_language_model(tmp_path):
    result = runner.invoke(app, ["data", "synth", str(tmp_path), "--days", "1", "--rows-per-day", "30",
                                 "--format", "prompt-completion"])
    assert result.exit_code == 0, result.output
    for part in ("train/dt=2026-01-01", "holdout", "inference"):
        rows = [json.loads(line) for line in (tmp_path / part / "part-00000.jsonl").read_text().splitlines()]
        assert len(rows) == 30 and all(set(r) == {"id", "prompt", "completion"} for r in rows)
        assert all(r["prompt"].startswith("Review: ") and r["prompt"].endswith("\nSentiment:") for r in rows)
        assert {r["completion"] for r in rows} == {" positive", " negative"}


@pytest.mark.slow  # a real process importing the CLI (and Prefect): with the integration tests
def test_the_installed_command_runs_in_a_real_process():
    exe = [sys.executable, "-m", "trnflow.cli"]
    proc = subprocess.run([*exe, "validate", str(EXAMPLES / "quickstart.yaml")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "ok" in proc.stdout
    helped = subprocess.run([*exe, "--help"], capture_output=True, text=True, timeout=120)
    for command in ("validate", "schema", "devices", "run", "data", "reference"):
        assert command in helped.stdout


def test_training_events_relayed_to_the_task_log_read_as_words_and_move_the_progress_bar():
    import io
    import json
    import logging

    from rich.console import Console

    from trnflow.cli.progress import training_progress
    from trnflow.redact import Redactor
    from trnflow.tasks._jobs import relay

    console = Console(file=io.StringIO(), force_terminal=True)
    logger = logging.getLogger("prefect.task_runs")
    task_log = logging.getLogger("prefect.task_runs.a-task")  # as a task's, it reaches its parent's handlers
    records: list[logging.LogRecord] = []
    kept = logging.Handler()
    kept.emit = records.append
    task_log.addHandler(kept)
    with training_progress(console) as _:
        handler = next(h for h in logger.handlers if type(h).__name__ == "TrainingProgress")
        events = [{"ts": 1.0, "event": "train", "rank": 0, "steps": 40, "step": step, "loss": 0.5,
                   "samples_per_s": 3000.0, "graphs": 2} for step in (10, 20)]
        relay(task_log, Redactor(["hunter22secret"]), "".join(json.dumps(e) + "\n" for e in events)
              + "a line that is not an event, with hunter22secret\n")
        task = handler.progress.tasks[0]
        assert (task.completed, task.total) == (20, 40) and "loss 0.5000" in task.description
    task_log.removeHandler(kept)
    assert handler not in logger.handlers
    assert [(r.levelno, r.getMessage()) for r in records] == [
        (logging.INFO, "train: step 10/40, mean loss 0.5000, 3,000 samples/s, graphs 2"),
        (logging.INFO, "train: step 20/40, mean loss 0.5000, 3,000 samples/s, graphs 2"),
        (logging.INFO, "a line that is not an event, with ********"),
    ]  # the JSON went to DEBUG, below the log's level


def test_a_job_run_straight_on_a_backend_shows_its_training_as_a_bar_or_as_lines():
    """`trnflow reference` follows its job's log lines: a bar on a terminal, a line a point elsewhere."""
    import io
    import json

    from rich.console import Console

    from trnflow.cli.progress import job_progress

    lines = "".join(json.dumps({"ts": 1.0, "event": "train", "rank": 0, "steps": 40, "step": step, "loss": 0.5,
                                "samples_per_s": 3000.0, "eta_s": 72.0}) + "\n" for step in (10, 20))
    lines += '{"event": "checkpoint", "step": 20}\nnot an event\n{"cut short'
    plain = Console(file=io.StringIO(), force_terminal=False, width=200)
    with job_progress(plain, "reference") as follow:
        follow(lines)
    assert plain.file.getvalue().splitlines() == [
        "reference: step 10/40, loss 0.5000, 3000 samples/s, 1.2 min left",
        "reference: step 20/40, loss 0.5000, 3000 samples/s, 1.2 min left"]
    terminal = Console(file=io.StringIO(), force_terminal=True, width=200)
    with job_progress(terminal, "reference") as follow:
        follow(lines)
    drawn = terminal.file.getvalue()
    assert "20/40" in drawn and "loss 0.5000" in drawn and "reference: step" not in drawn  # the bar, drawn last


def test_the_events_a_progress_bar_follows_are_typed_and_a_line_cut_short_moves_nothing():
    from trnflow.events import Late, ShardDone, TrainTick, progress_of

    tick = progress_of({"event": "train", "rank": 0, "step": 10, "steps": 40, "loss": 0.5, "global_step": 10})
    assert isinstance(tick, TrainTick) and (tick.step, tick.steps, tick.eta_s) == (10, 40, None)
    shard = progress_of({"event": "infer_shard", "rank": 1, "shard": 3, "shards": 4, "rows_per_s": 12.5})
    assert isinstance(shard, ShardDone) and (shard.shards, shard.rank) == (4, 1)
    assert isinstance(progress_of({"event": "late", "deadline_minutes": 5, "forecast_minutes": 7.5}), Late)
    assert progress_of({"event": "train", "step": 10}) is None  # no steps nor loss: not a point to draw
    assert progress_of({"event": "checkpoint", "step": 10}) is None


def test_submitted_runs_exit_0_when_completed_3_for_a_failed_gate_and_1_otherwise():
    from trnflow.cli.runs import exit_code

    assert exit_code("COMPLETED", "Completed") == 0
    assert exit_code("FAILED", "GateFailed") == 3
    assert [exit_code(t, t.title()) for t in ("FAILED", "CRASHED", "CANCELLED")] == [1, 1, 1]


def test_piped_output_is_not_cut_at_80_columns():
    """Rich folds tables at 80 columns when stdout is a pipe; the CLI's stay one line a row."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    piped = subprocess.run([sys.executable, "-m", "trnflow.cli", "devices", "--instance-type", "trn1.32xlarge"],
                           capture_output=True, text=True, timeout=120, env=env)
    assert piped.returncode == 0, piped.stderr
    rows = [line for line in piped.stdout.splitlines() if line.startswith("│")]
    assert len(rows) == 16 and all(len(line) > 80 and "10:1e.0" in rows[0] for line in rows)  # a device a line


def test_a_key_figure_is_printed_as_it_is():
    import io

    from rich.console import Console

    from trnflow.cli.render import stage_table
    from trnflow.results import StageRow

    out = Console(file=io.StringIO(), width=200)
    out.print(stage_table([StageRow(stage="train", state="Failed", seconds=1.0,
                                    summary="[Errno 2] No such file: '/data/[red]x'")], ("train", "evaluate")))
    text = out.file.getvalue()
    assert "[Errno 2] No such file: '/data/[red]x'" in text and "NotRun" in text


def test_submit_params_keep_text_parameters_as_text_and_refuse_a_second_spec():
    import typer

    from trnflow.cli.runs import _parse_params

    assert _parse_params(["run_id=20260105", "lock_timeout_seconds=60"]) == {"run_id": "20260105",
                                                                            "lock_timeout_seconds": 60}
    assert _parse_params(["run_id = 0105 ", 'checkpoint="s3://b/run/step-000010"']) == {
        "run_id": "0105", "checkpoint": "s3://b/run/step-000010"}
    for key in ("spec_url", "spec"):
        with pytest.raises(typer.Exit) as refused:
            _parse_params([f"{key}=s3://bucket/spec.yaml"])
        assert refused.value.exit_code == 2


def test_a_server_that_asks_for_credentials_is_told_apart(monkeypatch):
    """A Prefect server behind basic auth (the production compose file) answers 401: the CLI says
    which variable to set rather than echoing the server's JSON."""
    import http.server
    import threading

    class Refuse(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self._refuse()

        def do_POST(self):
            self._refuse()

        def _refuse(self):
            body = b'{"exception_message": "Unauthorized"}'
            self.send_response(401)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: f"http://127.0.0.1:{server.server_address[1]}/api"}):
            result = CliRunner().invoke(app, ["runs"])
    finally:
        server.shutdown()
    assert result.exit_code == 2
    assert "PREFECT_API_AUTH_STRING" in " ".join(result.stderr.split())


def _data_spec(tmp_path, fmt="parquet", **data) -> str:
    """A quickstart spec over `tmp_path/data` (synthesized, 3 days of 20 rows), written to a file."""
    from trnflow.workload.synth import synthesize

    root = tmp_path / "data"
    if not root.exists():
        synthesize(root, days=3, rows_per_day=20, seed=1, fmt=fmt)
    urls = {"train": str(root / "train"), "holdout": str(root / "holdout"), "inference": str(root / "inference")}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(quickstart_data(data={**urls, "format": fmt, **data})))
    return str(path)


def _csv_day(tmp_path, day="2026-01-02"):
    """Rewrite one training day as CSV: the spec says Parquet."""
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    folder = tmp_path / "data" / "train" / f"dt={day}"
    pacsv.write_csv(pq.read_table(folder / "part-00000.parquet"), folder / "part-00000.csv")
    (folder / "part-00000.parquet").unlink()


def test_validate_checks_the_data_locations_and_names_the_field_and_path(tmp_path):
    import shutil

    spec = _data_spec(tmp_path)
    assert runner.invoke(app, ["validate", spec]).exit_code == 0
    shutil.rmtree(tmp_path / "data" / "holdout")
    _csv_day(tmp_path)
    result = runner.invoke(app, ["validate", spec])
    assert result.exit_code == 2, result.output
    problems = "".join(result.stderr.split())  # Rich may wrap a line anywhere
    assert f"data.holdout:{(tmp_path / 'data' / 'holdout').as_uri()}:nosuchfolder" in problems
    assert "data.train:" in problems and "daydt=2026-01-02(dt=2026-01-02/part-00000.csv)holdsnoparquet" in problems
    report = json.loads(runner.invoke(app, ["validate", "--json", spec]).stdout)
    assert not report[0]["valid"] and [p.split(":")[0] for p in report[0]["problems"]] == ["data.train", "data.holdout"]
    skipped = runner.invoke(app, ["validate", "--no-data-check", spec])
    assert skipped.exit_code == 0, skipped.output


def test_validate_passes_a_spec_written_before_its_data_unless_told_to_check(tmp_path):
    missing = tmp_path / "not-yet"
    spec = tmp_path / "spec.yaml"
    urls = {field: str(missing / field) for field in ("train", "holdout", "inference")}
    spec.write_text(yaml.safe_dump(quickstart_data(data=urls)))
    result = runner.invoke(app, ["validate", str(spec)])
    assert result.exit_code == 0, result.output
    assert "none exists yet" in result.stdout
    strict = runner.invoke(app, ["validate", "--data-check", "--json", str(spec)])
    assert strict.exit_code == 2
    problems = json.loads(strict.stdout)[0]["problems"]
    assert [p.split(":")[0] for p in problems] == ["data.train", "data.holdout", "data.inference", "gate.reference"]
    for field, problem in zip(("train", "holdout", "inference"), problems[:3], strict=True):
        assert problem.startswith(f"data.{field}: {(missing / field).as_uri()}: no such folder")


def test_validate_data_check_lists_s3_locations(tmp_path, s3_bucket):
    import boto3

    from trnflow.workload.synth import synthesize

    synthesize(tmp_path, days=2, rows_per_day=10, seed=1)
    for path in tmp_path.rglob("*.jsonl"):
        boto3.client("s3").upload_file(str(path), s3_bucket, f"reviews/{path.relative_to(tmp_path).as_posix()}")
    base = f"s3://{s3_bucket}/reviews"
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(quickstart_data(data={
        "train": f"{base}/train", "holdout": f"{base}/holdout", "inference": f"{base}/catalogue"})))
    assert "not checked, on S3" in runner.invoke(app, ["validate", str(spec)]).stdout
    result = runner.invoke(app, ["validate", "--data-check", str(spec)])
    assert result.exit_code == 2
    assert "".join(
        f"data.inference: {base}/catalogue: no such folder, or it is empty; check the data URLs and data.format in the "
        "spec".split()) in "".join(result.stderr.split())
    assert "gate.reference:" in result.stderr and "does not exist" in result.stderr  # checked too when asked


def test_data_check_reports_every_day_and_fails_on_one_without_readable_rows(tmp_path):
    spec = _data_spec(tmp_path)
    good = runner.invoke(app, ["data", "check", spec])
    assert good.exit_code == 0, good.output
    assert good.stdout.count("│ ok ") == 5
    _csv_day(tmp_path)
    result = runner.invoke(app, ["data", "check", spec, "--json"])
    assert result.exit_code == 2
    report = json.loads(result.stdout)
    assert not report["ok"] and report["columns"] == ["text"]
    rows = {(p["field"], p["day"]): (p["state"], p["rows_read"], p["rows_rejected"]) for p in report["parts"]}
    assert rows == {("data.train", "2026-01-01"): ("ok", 20, 0), ("data.train", "2026-01-02"): ("failed", 0, 20),
                    ("data.train", "2026-01-03"): ("ok", 20, 0), ("data.holdout", None): ("ok", 20, 0),
                    ("data.inference", None): ("ok", 20, 0)}
    assert [p["problems"] for p in report["parts"] if p["state"] == "failed"] == [[
        "dt=2026-01-02/part-00000.csv: not parquet (data.format), so no run reads it", "no readable rows in parquet"]]
    table = runner.invoke(app, ["data", "check", spec])
    assert table.exit_code == 2 and table.stdout.count("│ failed ") == 1
    assert "data.traindt=2026-01-02:dt=2026-01-02/part-00000.csv:notparquet(data.format)" in "".join(
        table.stderr.split())


@pytest.mark.slow  # a real process importing the CLI (and Prefect): with the integration tests
def test_run_gives_prefect_its_startup_timeout_before_prefect_is_first_imported(make_spec, tmp_path):
    """Prefect reads its settings when first imported, and `trnflow run` imports its flows before it runs them."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(make_spec(gate={"reference": None}).model_dump(mode="json", exclude_none=True)))
    probe = (
        "import sys\n"
        "import trnflow.cli.pipeline as pipeline\n"
        "def seen(*args, **kwargs):\n"
        "    from prefect.settings import get_current_settings\n"
        "    print(get_current_settings().server.ephemeral.startup_timeout_seconds)\n"
        "pipeline._run_flow = seen\n"
        "from trnflow.cli.main import main\n"
        f"sys.argv = ['trnflow', 'run', {str(spec)!r}]\n"
        "main()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "120"


def test_the_prefect_server_command_listens_on_loopback_only():
    for host in ("0.0.0.0", "::", "10.1.2.3", "myhost"):  # noqa: S104 (each must be refused)
        refused = runner.invoke(app, ["server", "--host", host])
        assert refused.exit_code == 2 and "loopback only" in refused.output, refused.output


def _written(spec, path):
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json", exclude_none=True)))
    return str(path)


def test_a_cloud_run_of_a_spec_with_local_locations_is_refused_before_its_first_job(make_spec, tmp_path,
                                                                                    trnflow_home):
    """`trnflow run --backend sagemaker` on a spec whose data, checkpoints, cache and outputs are
    local: exit 2 naming every one, and no job (SageMaker's or the compile cache's) is started."""
    spec = _written(make_spec(gate={"reference": None}), tmp_path / "spec.yaml")
    result = runner.invoke(app, ["run", spec, "--backend", "sagemaker"])
    assert result.exit_code == 2
    named = [line.split(":")[0].strip() for line in result.stderr.splitlines() if " is not on S3" in line]
    assert named == ["data.train", "data.holdout", "data.inference", "train.checkpoint_url", "compile.cache_url",
                     "inference.output_url"], result.stderr
    assert "Traceback" not in result.output and not list((trnflow_home / "jobs").glob("*"))
    checked = runner.invoke(app, ["validate", spec, "--set", "compute.backend=sagemaker", "--json"])
    assert checked.exit_code == 2
    assert len(json.loads(checked.stdout)[0]["problems"]) == 6  # the same six, before anything is run
    assert runner.invoke(app, ["validate", spec, "--set", "train.steps=0"]).exit_code == 2
    assert runner.invoke(app, ["validate", spec, "--set", "train.steps=5"]).exit_code == 0


def test_a_run_whose_gate_reference_is_missing_is_refused_before_sanity(make_spec, tmp_path, trnflow_home):
    missing = tmp_path / "refs" / "metrics.json"
    spec = _written(make_spec(gate={"reference": str(missing)}), tmp_path / "spec.yaml")
    result = runner.invoke(app, ["run", spec])
    assert result.exit_code == 2, result.output
    assert f"gate.reference: {missing.as_uri()} does not exist" in " ".join(result.stderr.split())
    assert not list((trnflow_home / "jobs").glob("*"))  # no sanity job, no training job
    missing.parent.mkdir()
    missing.write_text('{"points": [{"step": 1, "accuracy": "high"}]}')
    malformed = runner.invoke(app, ["run", spec])
    assert malformed.exit_code == 2 and "points[0] needs an integer 'step' and a numeric 'accuracy'" in " ".join(
        malformed.stderr.split())


def test_a_spec_evaluated_at_none_of_its_references_steps_is_refused_before_launch(make_spec, tmp_path,
                                                                                 trnflow_home):
    """Changing train.steps after writing the reference: the gate would find no common step after
    training; validate and run say so first, naming the steps and the command that writes a new one.
    Retraining is judged on its final point alone, so it may train for any number of steps."""
    from trnflow.cli.prelaunch import launch_problems

    reference = tmp_path / "reference" / "metrics.json"
    reference.parent.mkdir()
    reference.write_text(json.dumps({"points": [{"step": 20, "accuracy": 0.7}, {"step": 40, "accuracy": 0.75}]}))
    spec = _written(make_spec(gate={"reference": str(reference), "eval_every": 20}), tmp_path / "spec.yaml")
    assert runner.invoke(app, ["validate", spec]).exit_code == 0
    assert runner.invoke(app, ["validate", spec, "--set", "train.steps=60"]).exit_code == 0  # 20 and 40 in common
    for command in ("validate", "run"):
        result = runner.invoke(app, [command, spec, "--set", "train.steps=30", "--set", "gate.eval_every=15"])
        said = " ".join(result.stderr.split())
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        assert (f"gate.reference: {reference.as_uri()} was evaluated at steps [20, 40], and this spec evaluates at "
                "steps [15, 30] (train.steps 30, gate.eval_every 15): none in common") in said
        assert "`trnflow reference SPEC` (with the same --set options)" in said
    assert not list((trnflow_home / "jobs").glob("*"))  # refused before the first job
    shorter = make_spec(gate={"reference": str(reference), "eval_every": 25}, train={"steps": 30})
    assert [p.split(":")[0] for p in launch_problems(shorter)] == ["gate.reference"]
    assert launch_problems(shorter, retraining=True) == []


def test_retraining_on_a_cloud_backend_needs_the_registry_on_s3(tmp_path, trnflow_home):
    """Retraining starts from the champion, so its jobs read the registry: a local one is refused
    before the first job, though the spec as written (not starting from the champion) is valid."""
    from tests.conftest import ON_S3

    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(quickstart_data(
        compute={"backend": "batch", "instance_type": "trn1.32xlarge"}, train={"checkpoint_url": "s3://acme-data/c"},
        registry_url=str(tmp_path / "registry"), gate={"reference": None}, **ON_S3)))
    assert runner.invoke(app, ["validate", str(spec)]).exit_code == 0
    result = runner.invoke(app, ["retrain", str(spec)])
    assert result.exit_code == 2 and "registry_url:" in result.stderr and "is not on S3" in result.stderr
    assert not list((trnflow_home / "jobs").glob("*"))


def test_recipes_lists_each_recipes_gate_metrics_with_which_way_each_is_better():
    result = runner.invoke(app, ["recipes", "--json"])
    assert result.exit_code == 0, result.output
    found = {r["name"]: r for r in json.loads(result.output)["recipes"]}
    assert found["m5-text"]["metrics"] == [
        {"name": "accuracy", "better": "higher"}, {"name": "loss", "better": "lower"},
        {"name": "f1", "better": "higher"}, {"name": "auc", "better": "higher"}]
    shown = runner.invoke(app, ["recipes"], env={"COLUMNS": "200"})
    assert "gate metrics: accuracy (higher is better), loss (lower is better)" in shown.output


def test_validate_of_a_hugging_face_recipe_without_the_hf_extra_names_the_recipe(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # as where `pip install 'trnflow[hf]'` was not run
    spec = tmp_path / "lm.yaml"
    spec.write_text((EXAMPLES / "causal-lm-base.yaml").read_text())
    result = runner.invoke(app, ["validate", str(spec), "--json"])
    assert result.exit_code == 2, result.output
    assert json.loads(result.stdout)[0]["problems"] == [
        "model.recipe: hf-causal-lm needs transformers, which is not installed here: pip install 'trnflow[hf]'"]


def test_mock_aws_is_the_mock_extras_command_found_by_entry_point(monkeypatch):
    """The command line names no test module: `trnflow mock-aws` loads what the mock extra registers,
    and says how to install it where nothing does."""
    import trnflow.cli.app as cli_app
    from trnflow.testing.aws_server import mock_aws

    assert cli_app._extra_command("mock-aws") is mock_aws
    monkeypatch.setattr(cli_app, "entry_points", lambda group: [])
    result = runner.invoke(app, ["mock-aws"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "pip install 'trnflow[mock]'" in " ".join(result.stderr.split())
