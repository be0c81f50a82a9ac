"""The architecture's import rules, checked on the source (every import statement, at any depth)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def _full_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}


def _offenders(folder: str, banned: set[str], allow: tuple[str, ...] = ()) -> dict[str, set[str]]:
    out = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        if rel in allow:
            continue
        hits = _imports(path) & banned
        if hits:
            out[rel] = hits
    assert any((ROOT / folder).rglob("*.py")), f"{folder} has no Python files"
    return out


def test_engine_never_imports_prefect():
    allow = (*(f"trnflow/cli/{n}" for n in ("app.py", "runs.py", "serve.py", "server.py", "progress.py")),
             "trnflow/testing/mockcloud/cloud.py")
    assert _offenders("trnflow", {"prefect"}, allow=allow) == {}


def test_jobspecs_import_nothing_else_of_ours():
    tree_imports = set().union(*(_full_imports(p) for p in (ROOT / "jobspecs").rglob("*.py")))
    assert {m for m in tree_imports if m.startswith("trnflow") and not m.startswith("trnflow.specs")} == set()


def test_flows_never_talk_to_aws_directly():
    assert _offenders("flows", {"boto3", "botocore", "sagemaker"}) == {}


def test_workload_and_emulator_do_not_reach_into_orchestration_or_backends():
    banned = {"prefect", "flows", "tasks"}
    assert _offenders("trnflow/workload", banned | {"boto3"}) == {}
    assert _offenders("trnflow/emulator", banned) == {}
    assert _offenders("trnflow/backends", banned) == {}


def test_flows_and_tasks_never_read_the_backend_choice():
    for folder in ("flows", "tasks"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                reads_backend = (isinstance(node, ast.Attribute) and node.attr == "backend"
                                 and isinstance(node.value, ast.Attribute) and node.value.attr == "compute")
                assert not reads_backend, f"{path}:{node.lineno} reads spec.compute.backend"


def test_the_sagemaker_sdk_is_imported_only_where_jobs_are_sent_and_only_lazily():
    """`from sagemaker.train import ModelTrainer` takes about 3 s: only the submitting module may
    import it, and only inside a function."""
    users = {rel for rel, hits in _offenders("trnflow", {"sagemaker"}).items()}
    assert users == {"trnflow/backends/sagemaker_trainer.py"}
    tree = ast.parse((ROOT / "trnflow/backends/sagemaker_trainer.py").read_text())
    top_level = {n.module.split(".")[0] for n in tree.body if isinstance(n, ast.ImportFrom) and n.module}
    assert "sagemaker" not in top_level


def test_the_mock_cloud_is_not_part_of_the_product_path():
    """Only the tests and the `mock-aws` command start the mocked cloud."""
    users = {rel for rel, hits in _offenders("trnflow", {"moto"}).items()}
    assert all(rel.startswith("trnflow/testing/") or rel == "trnflow/cli/mock.py" for rel in users), users
    assert _offenders("trnflow/backends", {"moto"}) == {} and _offenders("flows", {"moto"}) == {}
