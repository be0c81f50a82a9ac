"""Item 14: the mock cloud as the README and docs/cloud.md show it. `trnflow mock-aws` serves the
Batch example, the page's boto3 snippet runs as written with no AWS credentials configured
against the bucket and queue it names, and stopping the server removes its temporary folder.
The run talks to the session's Prefect API, as a user's does once a server is configured.

Issue 42: started from a folder of the user's own, the server suggests an example spec that is
there, and the page's recipe section puts the example recipe's data into the mock bucket as
written (the AWS CLI's commands, where the CLI is installed, and the boto3 snippet), where its
spec finds it."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.markdown import FENCE, shell_blocks

ROOT = Path(__file__).resolve().parents[2]
TRNFLOW = Path(sys.executable).with_name("trnflow")
SHORTER = ["--set", "train.steps=10", "--set", "train.checkpoint_every=10", "--set", "gate.eval_every=10"]
"""The README's example with fewer steps: the same jobs, graphs and requests."""


CLOUD_MD = ROOT / "docs" / "cloud.md"
BUCKET = "trnflow-data-123456789012"


def _blocks(language: str, needle: str) -> list[str]:
    """The page's fenced blocks in `language` that contain `needle`."""
    return [body for lang, body in FENCE.findall(CLOUD_MD.read_text()) if lang == language and needle in body]


def _snippet() -> str:
    """The boto3 snippet that looks at what the example wrote."""
    (code,) = _blocks("python", "list_jobs")
    return code


def _port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _clean_env(home: Path) -> dict[str, str]:
    """This environment without AWS, trnflow or Prefect settings, and a home without ~/.aws."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "TRNFLOW_", "PREFECT_"))}
    return env | {"HOME": str(home), "COLUMNS": "400", "TMPDIR": str(home),
                  "PREFECT_HOME": str(home / "prefect"), "TRNFLOW_HOME": str(home / "trnflow"),
                  "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "TRNFLOW_POLL_SECONDS": "0.2"}


def _started(server: subprocess.Popen) -> str:
    """What the server printed up to its ready message."""
    lines: list[str] = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not any("In another shell" in line for line in lines):
        line = server.stdout.readline()
        assert line or server.poll() is None, "".join(lines)
        lines.append(line)
    return "".join(lines)


@pytest.mark.slow
def test_the_batch_example_runs_on_the_mock_cloud_and_the_docs_snippet_reads_it(tmp_path, prefect_api):
    port = _port()
    env = _clean_env(tmp_path)  # no ~/.aws: no credentials
    server = subprocess.Popen([str(TRNFLOW), "mock-aws", "--port", str(port)], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        printed = _started(server)
        (jobs,) = re.findall(r"jobs run under (\S+)", printed)
        work = Path(jobs).parent
        assert work.is_dir() and "s3://trnflow-data-123456789012" in printed
        endpoint = f"http://127.0.0.1:{port}"
        ran = subprocess.run([str(TRNFLOW), "run", "jobspecs/examples/quickstart-batch.yaml", *SHORTER, "--json"],
                             env=env | {"AWS_ENDPOINT_URL": endpoint, "PREFECT_API_URL": prefect_api}, cwd=ROOT,
                             capture_output=True, text=True, timeout=900)
        assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
        outcome = json.loads(ran.stdout)
        assert outcome["state"] == "Completed"
        # the preflight checked the very instances that trained: one job, the same EC2 instances
        where = [outcome["results"][stage]["ran_on"] for stage in ("sanity", "collectives", "train")]
        assert where[0] == where[1] == where[2] and where[0]["job_id"], where
        assert len(where[0]["hosts"]) == 2 and all(h.startswith("i-") for h in where[0]["hosts"])
        # the instances each stage started, and how long they took to be ready: one allocation of two
        # for sanity, collectives and training; one for the compile job (one worker); two for inference
        rows = {row["stage"]: row for row in outcome["cost"]["rows"]}
        started = {stage: row["instances_started"] for stage, row in rows.items()}
        assert started == {"train": 2, "compile": 1, "infer": 2}, rows
        assert outcome["cost"]["instances_started"] == 5 and outcome["cost"]["provisioning_seconds"] > 0
        assert all(row["provisioning_seconds"] > 0 for row in rows.values())
        infer = outcome["results"]["infer"]["ran_on"]
        # the mock cloud gives each job instances of its own (a real compute environment may reuse idle ones)
        assert len(infer["hosts"]) == 2 and not set(infer["hosts"]) & set(where[0]["hosts"])
        code = _snippet().replace("http://127.0.0.1:5000", endpoint)
        looked = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert looked.returncode == 0, looked.stderr
        assert "'embeddings/'" in looked.stdout and "'registry/'" in looked.stdout
        assert re.search(r"^quickstart-batch-sanity-train-\S+ \[\{", looked.stdout, re.MULTILINE), looked.stdout
    finally:
        server.send_signal(signal.SIGTERM)
        rest, _ = server.communicate(timeout=60)
    assert server.returncode == 0, rest
    assert not work.exists() and f"removed {work}" in " ".join(rest.split())


def _keys(s3, prefix: str) -> list[str]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


@pytest.mark.slow
def test_from_another_folder_the_banner_names_a_spec_there_and_the_docs_put_a_recipes_data_in_the_bucket(tmp_path):
    import boto3

    elsewhere = tmp_path / "my-project"  # a user's own folder: no jobspecs/ in it
    elsewhere.mkdir()
    env = _clean_env(tmp_path)
    port = _port()
    endpoint = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([str(TRNFLOW), "mock-aws", "--port", str(port), "--no-seed-data"], env=env,
                              cwd=elsewhere, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        printed = _started(server) + server.stdout.readline()  # the command comes after the export
        (suggested,) = re.findall(r"^\s+trnflow run (\S+)$", printed, re.MULTILINE)
        assert Path(suggested).is_absolute() and (elsewhere / suggested).is_file(), printed
        example = ROOT / "jobspecs" / "examples" / "quickstart-batch.yaml"
        assert (elsewhere / suggested).read_text() == example.read_text()

        # The shell block: the recipe is installed (make install does it), its data made and uploaded.
        (block,) = [b for b in shell_blocks(CLOUD_MD.read_text()) if any(" s3 cp " in c for c in b)]
        assert block[0] == "pip install -e examples/recipes"
        commands = [c.replace("http://127.0.0.1:5000", endpoint) for c in block[1:]]
        aws_cli = shutil.which("aws") is not None
        if not aws_cli:  # the CLI is not trnflow's dependency; the boto3 snippet below uploads the same
            commands = [c for c in commands if not c.startswith("aws ")]
        path = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # `python` is this environment's
        made = subprocess.run(["bash", "-euc", "\n".join(commands)], env=env | {"PATH": path}, cwd=elsewhere,
                              capture_output=True, text=True, timeout=300)
        assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
        data = elsewhere / "runs" / "tabular" / "data"
        files = sorted(f"tabular/{p.relative_to(data).as_posix()}" for p in data.rglob("*") if p.is_file())
        assert any(f.startswith("tabular/train/dt=") for f in files) and "tabular/holdout/part-00000.parquet" in files
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="mock",
                          aws_secret_access_key="mock")
        assert _keys(s3, "tabular/") == (files if aws_cli else [])

        # The boto3 snippet uploads the same files.
        for key in files:
            s3.delete_object(Bucket=BUCKET, Key=key)
        (code,) = _blocks("python", "upload_file")
        code = code.replace("http://127.0.0.1:5000", endpoint)
        uploaded = subprocess.run([sys.executable, "-c", code], env=env, cwd=elsewhere, capture_output=True,
                                  text=True, timeout=120)
        assert uploaded.returncode == 0, uploaded.stderr
        assert _keys(s3, "tabular/") == files

        # The page's spec finds the data where the commands put it, as its jobs will read it.
        (spec,) = _blocks("yaml", "recipe: tabular-mlp")
        assert yaml.safe_load(spec)["model"]["recipe"] == "tabular-mlp"
        (elsewhere / "tabular-batch.yaml").write_text(spec)
        (block,) = [b for b in shell_blocks(CLOUD_MD.read_text()) if "trnflow run tabular-batch.yaml" in b]
        assert block == ["trnflow data check tabular-batch.yaml", "trnflow run tabular-batch.yaml"]
        checked = subprocess.run([str(TRNFLOW), *block[0].split()[1:], "--json"],
                                 env=env | {"AWS_ENDPOINT_URL": endpoint}, cwd=elsewhere, capture_output=True,
                                 text=True, timeout=300)
        assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-3000:]
        report = json.loads(checked.stdout)
        assert report["ok"] and {p["field"] for p in report["parts"]} == {"data.train", "data.holdout",
                                                                         "data.inference"}
        assert all(p["state"] == "ok" and p["rows_read"] > 0 for p in report["parts"]), report
        assert len([p for p in report["parts"] if p["field"] == "data.train"]) == 3  # a part per day
        # (`trnflow run` of this spec on two Batch nodes: tests/integration/test_recipe_pipelines.py)
    finally:
        server.send_signal(signal.SIGTERM)
        rest, _ = server.communicate(timeout=60)
    assert server.returncode == 0, rest


def _session(env_file: str) -> dict[str, str]:
    """The variables a team's `.env` file exports (as `source` would set them)."""
    return dict(re.findall(r"^export (\w+)=(\S+)$", Path(env_file).read_text(), re.MULTILINE))


@pytest.mark.slow
def test_two_teams_run_the_quickstart_side_by_side_each_in_its_own_folders(tmp_path, prefect_api):
    """`trnflow mock-aws --teams search,ads --quota trn1.32xlarge=2`: each team starts the Batch example
    as its own role, as the banner says, at the same time, through the stack's queue; each run's team
    is its role's tag, and everything it writes lands in its team's folders, its cache entries signed
    with its team's key. A spec naming the
    other team's folders, and a starter with no team, are refused before any job."""
    import boto3

    port = _port()
    endpoint = f"http://127.0.0.1:{port}"
    env = _clean_env(tmp_path) | {"AWS_ENDPOINT_URL": endpoint, "PREFECT_API_URL": prefect_api}
    server = subprocess.Popen([str(TRNFLOW), "mock-aws", "--port", str(port), "--teams", "search,ads",
                               "--quota", "trn1.32xlarge=2"], env=env,
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        printed = _started(server) + "".join(server.stdout.readline() for _ in range(3))
        sources = dict((team, path) for path, team in re.findall(r"source (\S+/teams/(\w+)\.env)", printed))
        commands = re.findall(r"^\s+trnflow run (\S+ .+)$", printed, re.MULTILINE)
        assert set(sources) == {"search", "ads"} and len(commands) == 2, printed
        runs = {}
        for team, command in zip(("search", "ads"), commands, strict=True):
            assert f"teams/{team}/checkpoints" in command
            args = [a for part in command.split(" --set ") for a in ("--set", part)][1:]  # the spec, then each --set
            runs[team] = subprocess.Popen([str(TRNFLOW), "run", *args, *SHORTER, "--json"],
                                          env=env | _session(sources[team]), cwd=ROOT, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True)
        ended = {team: run.communicate(timeout=900) for team, run in runs.items()}
        for team, (out, said) in ended.items():
            assert runs[team].returncode == 0, team + out[-3000:] + said[-3000:]
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="mock",
                          aws_secret_access_key="mock")
        for team, (out, _) in ended.items():
            run_id = json.loads(out)["run_id"]
            mine = _keys(s3, f"teams/{team}/")
            assert any(k.startswith(f"teams/{team}/checkpoints/{run_id}/step-") for k in mine), mine[:20]
            assert any(k.startswith(f"teams/{team}/embeddings/") for k in mine)
            assert any(k.startswith(f"teams/{team}/registry/quickstart-batch/") for k in mine)
            assert any(k.startswith(f"teams/{team}/neuron-cache/") for k in mine)
            staging = sorted(o["Key"] for o in s3.list_objects_v2(Bucket="trnflow-staging-123456789012",
                                                                  Prefix=f"jobs/{team}/").get("Contents", []))
            assert f"jobs/{team}/{run_id}.owner.json" in staging and any(k.startswith(f"jobs/{team}/{run_id}/")
                                                                         for k in staging)
            owner = json.loads(s3.get_object(Bucket="trnflow-staging-123456789012",
                                             Key=f"jobs/{team}/{run_id}.owner.json")["Body"].read())
            assert owner == {"team": team, "model": "quickstart-batch"}
        assert not _keys(s3, "checkpoints/") and not _keys(s3, "embeddings/")  # nothing outside the teams' folders
        # each team has the role its orchestrators run as, tagged with it, and spot capacity of its own
        aws = {"endpoint_url": endpoint, "region_name": "us-east-1", "aws_access_key_id": "mock",
               "aws_secret_access_key": "mock"}
        teams = yaml.safe_load(s3.get_object(Bucket="trnflow-staging-123456789012",
                                             Key="_operators/teams.yaml")["Body"].read())["teams"]
        assert [t["quotas"] for t in teams] == [{"trn1.32xlarge": 2}] * 2
        # both runs went through the stack's queue on the Prefect server, each holding its team's two
        # instances of the stack's four, and gave them back
        limits = subprocess.run([str(TRNFLOW), "queue", "--stack", "--json"], env=env, cwd=ROOT,
                                capture_output=True, text=True, timeout=120)
        held = json.loads(limits.stdout)
        assert held["runs"] == [] and held["limits"]["trnflow-trn1.32xlarge"] == {"held": 0, "limit": 4}, held
        assert held["limits"]["trnflow-search-trn1.32xlarge"] == {"held": 0, "limit": 2}
        queues = [t["batch_spot_job_queue"] for t in teams]
        assert queues == ["trnflow-search-trn1-spot", "trnflow-ads-trn1-spot"]
        found = boto3.client("batch", **aws).describe_job_queues(jobQueues=queues)["jobQueues"]
        assert sorted(q["jobQueueName"] for q in found) == sorted(queues)
        for team in ("search", "ads"):
            tags = boto3.client("iam", **aws).list_role_tags(RoleName=f"trnflow-{team}-orchestrator")["Tags"]
            assert tags == [{"Key": "trnflow-team", "Value": team}]

        # search's run naming ads' registry, and a run started by a principal with no team: refused
        example, *_ = commands[0].split(" --set ")
        outside = subprocess.run([str(TRNFLOW), "run", example, *SHORTER, "--set",
                                  f"registry_url=s3://{BUCKET}/teams/ads/registry"],
                                 env=env | _session(sources["search"]), cwd=ROOT, capture_output=True, text=True,
                                 timeout=300)
        said = " ".join(outside.stderr.split())
        assert outside.returncode == 2 and "registry_url: s3://trnflow-data-123456789012/teams/ads/registry is " \
            "outside team search's prefix s3://trnflow-data-123456789012/teams/search/registry" in said, said
        anyone = subprocess.run([str(TRNFLOW), "run", example, *SHORTER], env=env, cwd=ROOT, capture_output=True,
                                text=True, timeout=300)
        said = " ".join(anyone.stderr.split())
        assert anyone.returncode == 2 and "team: " in said and "trnflow-team" in said and "Traceback" not in said, said
    finally:
        server.send_signal(signal.SIGTERM)
        rest, _ = server.communicate(timeout=60)
    assert server.returncode == 0, rest
