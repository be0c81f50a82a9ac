"""The production Prefect server's compose file: PostgreSQL behind it, the same Prefect as the
project pins, reachable on loopback only, auth and the database password required, no secret in
the file, and leases kept on a volume."""

import re
from pathlib import Path

import yaml

INFRA = Path(__file__).resolve().parents[1]
COMPOSE = INFRA / "prefect" / "docker-compose.yml"


def test_the_server_runs_the_pinned_prefect_on_postgres_reachable_on_loopback_only():
    compose = yaml.safe_load(COMPOSE.read_text())
    server, database = compose["services"]["prefect"], compose["services"]["postgres"]
    pinned = re.search(r'"prefect==([\d.]+)"', (INFRA.parent / "pyproject.toml").read_text()).group(1)
    assert server["image"].startswith(f"prefecthq/prefect:{pinned}-")
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
