"""`trnflow mock-aws`: SageMaker, Batch, S3 and CloudWatch on 127.0.0.1, with the jobs run for real.

It starts moto's server with trnflow's MockCloud attached (moto alone accepts jobs but never runs
them), creates the deployment the cloud backends expect, and uploads a synthetic dataset. Point
trnflow at it with `export AWS_ENDPOINT_URL=http://127.0.0.1:PORT`.
"""

from __future__ import annotations

import logging
import shutil
import signal
import tempfile
import time
from importlib.resources import files
from pathlib import Path

from moto.server import ThreadedMotoServer

from trnflow.cli.console import cli_console
from trnflow.testing.mockcloud import MockCloud
from trnflow.testing.mockcloud.provision import provision, provision_teams, team_prefixes
from trnflow.workload.synth import synthesize

console = cli_console()
EXAMPLE = "quickstart-batch.yaml"
"""The example spec the banner suggests: the quickstart as two-node Batch jobs, on the seeded data."""


def example_spec() -> Path:
    """The Batch example as installed with trnflow (`trnflow.specs.examples`), by its absolute path:
    the banner's command then runs from any folder, not only from the repository's root."""
    return Path(str(files("trnflow.specs.examples") / EXAMPLE)).resolve()


def banner(endpoint: str, jobs: Path, outputs: dict[str, str], teams: dict[str, Path] | None = None) -> list[str]:
    """What the server prints once it is ready: where it is, its bucket and queue, and what to run
    (with declared teams: as which team, and where in the bucket each team's run writes)."""
    lines = [f"Emulated AWS on {endpoint}; jobs run under {jobs}",
             f"  data bucket  s3://{outputs['DATA_BUCKET']}  |  queue {outputs['BATCH_JOB_QUEUE']}"]
    if not teams:
        return [*lines, f"In another shell:  export AWS_ENDPOINT_URL={endpoint}",
                f"                   trnflow run {example_spec()}"]
    lines.append(f"  teams        {', '.join(teams)} (each starts runs as its own role; its folders are "
                 f"s3://{outputs['DATA_BUCKET']}/teams/<team>/)")
    for n, (team, env) in enumerate(teams.items()):
        lines += [f"{'In another shell' if n == 0 else 'And as ' + team}:  export AWS_ENDPOINT_URL={endpoint}; "
                  f"source {env}",
                  f"  trnflow run {example_spec()} {' '.join(team_overrides(team))}"]
    return lines


def team_overrides(team: str) -> list[str]:
    """The example's `--set` options that put a team's run in its own folders."""
    folders = team_prefixes(team)
    return [f"--set train.checkpoint_url={folders['checkpoints']}", f"--set compile.cache_url={folders['cache']}",
            f"--set inference.output_url={folders['outputs']}", f"--set registry_url={folders['registry']}"]


def _stop(signum, frame):
    raise KeyboardInterrupt


def mock_aws(port: int, seed_data: bool, work_dir: Path | None = None, provision_seconds: float = 0.5,
             image_pull_seconds: float = 0.5, teams: list[str] | None = None,
             quotas: dict[str, int] | None = None) -> None:
    """Run an emulated AWS for the sagemaker and batch backends until Ctrl-C or SIGTERM; the jobs'
    containers keep their files under `work_dir` (default: a temporary folder, removed on exit). A new
    instance takes `provision_seconds` to boot and `image_pull_seconds` to pull the image. With
    `teams`, the deployment declares them (`provision_teams`, each with `quotas`), and `<work_dir>/teams/<team>.env`
    holds the variables of a session as each team's role."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    endpoint = f"http://127.0.0.1:{port}"
    signal.signal(signal.SIGTERM, _stop)  # a service manager's stop cleans up as Ctrl-C does
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    root = work_dir or Path(tempfile.mkdtemp(prefix="trnflow-mock-aws-"))
    cloud = MockCloud(endpoint, root / "jobs", provision_seconds=provision_seconds,
                      image_pull_seconds=image_pull_seconds).attach()
    try:
        outputs = provision(cloud.client)
        envs: dict[str, Path] = {}
        for team, session in provision_teams(cloud.client, teams, quotas=quotas).items() if teams else ():
            envs[team] = root / "teams" / f"{team}.env"
            envs[team].parent.mkdir(exist_ok=True)
            envs[team].touch(mode=0o600)
            envs[team].write_text("".join(f"export {k}={v}\n" for k, v in session.items()))
        if seed_data:
            data = root / "quickstart-data"
            synthesize(data, days=3, rows_per_day=1500, seed=7)
            s3 = cloud.client("s3")
            for path in sorted(p for p in data.rglob("*") if p.is_file()):
                s3.upload_file(str(path), outputs["DATA_BUCKET"], f"quickstart/{path.relative_to(data)}")
        for n, line in enumerate(banner(endpoint, root / "jobs", outputs, envs)):  # never wrapped: paths are copied
            console.print(line, style="bold" if n == 0 else None, markup=False, highlight=False, soft_wrap=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        cloud.detach()
        server.stop()
        if work_dir is None:
            shutil.rmtree(root, ignore_errors=True)
            console.print(f"removed {root}")
