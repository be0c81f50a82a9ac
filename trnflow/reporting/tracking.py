"""Experiment tracking: each run mirrored where teams already compare runs (an MLflow tracking
server, `tracking.mlflow_uri`), from what the orchestrator holds. trnflow's own records (the
registry, the metric series, the stage results) stay the source of truth; the mirror never decides
anything.

This module checks that a server is there to take a run (`server_problem`, for `trnflow validate
--data-check`). A SageMaker managed MLflow server is named by its ARN and reached through the
`sagemaker-mlflow` plugin, which signs each request with the orchestrator's AWS credentials.
"""

from __future__ import annotations

import importlib.util
import urllib.error
import urllib.request

HEALTH_TIMEOUT_SECONDS = 5.0
PLUGIN = "sagemaker_mlflow"


def is_sagemaker_arn(uri: str) -> bool:
    return uri.startswith("arn:")


def server_problem(uri: str, timeout: float = HEALTH_TIMEOUT_SECONDS) -> tuple[str | None, str | None]:
    """Whether the MLflow server at `uri` answers: a problem line (`tracking.mlflow_uri: ...`), or a
    note on what could not be checked from here; (None, None) when it answered."""
    if is_sagemaker_arn(uri):
        if importlib.util.find_spec(PLUGIN) is None:
            return ("tracking.mlflow_uri: a SageMaker MLflow ARN needs the sagemaker-mlflow plugin, which is not "
                    "installed here: pip install 'trnflow[mlflow]'"), None
        return None, ("tracking.mlflow_uri: a SageMaker MLflow server, reached with the orchestrator's AWS "
                      "credentials when a run starts; not asked now")
    try:
        with urllib.request.urlopen(f"{uri}/health", timeout=timeout) as answer:  # noqa: S310  # http(s) only
            if answer.status == 200:
                return None, None
            said = f"HTTP {answer.status}"
    except urllib.error.HTTPError as exc:
        said = f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:  # refused, unknown host, timed out
        said = str(getattr(exc, "reason", exc))
    return (f"tracking.mlflow_uri: no MLflow server answers at {uri} ({said}); start one (`trnflow tracking "
            "server` for a local one) or correct the URL"), None
