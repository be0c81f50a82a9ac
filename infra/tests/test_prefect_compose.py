"""The production Prefect server's compose file: PostgreSQL behind it, the same Prefect as the
project pins (with SQLAlchemy and fastapi held where the project holds them), reachable on
loopback only, auth and the database password required, no secret in the file, and leases kept
on a volume."""

import re
import tomllib
from pathlib import Path

import yaml

INFRA = Path(__file__).resolve().parents[1]
COMPOSE = INFRA / "prefect" / "docker-compose.yml"
SERVER_IMAGE = INFRA / "prefect" / "Dockerfile"


def _pins() -> dict[str, str]:
    """pyproject.toml's requirements by package name: `{"sqlalchemy": "sqlalchemy>=2.0,<2.1", ...}`."""
    dependencies = tomllib.loads((INFRA.parent / "pyproject.toml").read_text())["project"]["dependencies"]
    return {re.match(r"[A-Za-z0-9_.-]+", d).group(0).lower(): d for d in dependencies}


def test_the_server_runs_the_pinned_prefect_on_postgres_reachable_on_loopback_only():
    compose = yaml.safe_load(COMPOSE.read_text())
    server, database = compose["services"]["prefect"], compose["services"]["postgres"]
    pinned = _pins()["prefect"].removeprefix("prefect==")
    assert server["build"] == "." and server["image"].endswith(f":{pinned}")
    (base,) = re.findall(r"^FROM (\S+)$", SERVER_IMAGE.read_text(), re.MULTILINE)
    assert base.startswith(f"prefecthq/prefect:{pinned}-")
    assert database["image"].startswith("postgres:")
    env = server["environment"]
    assert env["PREFECT_API_DATABASE_CONNECTION_URL"].startswith("postgresql+asyncpg://prefect:${POSTGRES_PASSWORD}@postgres")
    assert server["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert all(port.startswith("127.0.0.1:") for port in server["ports"])
    assert "healthcheck" in server and "healthcheck" in database
    assert env["PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE"].endswith(".filesystem")
    assert any(v.endswith(":" + env["PREFECT_HOME"]) for v in server["volumes"])


def test_secrets_are_required_from_the_environment_and_never_written_in_the_file():
    text = COMPOSE.read_text()
    assert "${POSTGRES_PASSWORD:?" in text and "${PREFECT_SERVER_API_AUTH_STRING:?" in text
    example = (INFRA / "prefect" / ".env.example").read_text()
    assert all(line.endswith("=") or not line.split("=", 1)[0].endswith(("PASSWORD", "AUTH_STRING"))
               for line in example.splitlines() if line and not line.startswith("#"))
    ignored = (INFRA.parent / ".gitignore").read_text().split()
    assert "infra/prefect/.env" in ignored


def test_the_server_image_holds_sqlalchemy_and_fastapi_where_the_project_does():
    """Prefect 3.8.8's scheduler creates no run with SQLAlchemy 2.1, and its API breaks with fastapi
    0.151: the server image installs the project's own bounds for both."""
    installed = re.findall(r'"([^"]+)"', SERVER_IMAGE.read_text().split("RUN pip install", 1)[1])
    pins = _pins()
    assert sorted(installed) == sorted([pins["sqlalchemy"], pins["fastapi"]])
    assert "<2.1" in pins["sqlalchemy"] and "<0.151" in pins["fastapi"]
