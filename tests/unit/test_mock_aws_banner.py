"""Issue 42: what `trnflow mock-aws` suggests running is there wherever the server was started, not
only at the repository's root (the whole server from another folder: tests/integration/test_mock_aws_docs.py)."""

from pathlib import Path

from trnflow.testing.aws_server import banner

ROOT = Path(__file__).resolve().parents[2]


def test_the_banner_suggests_the_installed_example_by_a_path_that_exists_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    lines = banner("http://127.0.0.1:5000", tmp_path / "jobs",
                   {"DATA_BUCKET": "trnflow-data-123456789012", "BATCH_JOB_QUEUE": "trnflow-trn1"})
    (command,) = [line.split() for line in lines if "trnflow run" in line]
    assert command[:2] == ["trnflow", "run"] and len(command) == 3
    suggested = Path(command[2])
    assert suggested.is_absolute() and suggested.is_file()
    assert suggested.read_text() == (ROOT / "jobspecs" / "examples" / "quickstart-batch.yaml").read_text()
    assert "export AWS_ENDPOINT_URL=http://127.0.0.1:5000" in "\n".join(lines)
