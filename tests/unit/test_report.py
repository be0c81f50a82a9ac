"""What a run shows a person in the Prefect UI: locations they can open (S3's console) or copy (a
local path), and a stage table whose seconds are rounded."""


from trnflow.reporting.report import links_markdown, location_markdown
from trnflow.urls import shown


def test_a_local_location_is_a_plain_path_and_an_s3_one_a_console_link():
    assert shown("file:///runs/a%20b/step-000010") == ("/runs/a b/step-000010", None)
    assert shown("s3://bucket/runs/x/step-000010") == (
        "s3://bucket/runs/x/step-000010", "https://s3.console.aws.amazon.com/s3/buckets/bucket?prefix=runs/x/step-000010/")
    assert shown("s3://bucket/runs/x/parity.png")[1] == (
        "https://s3.console.aws.amazon.com/s3/object/bucket?prefix=runs/x/parity.png")
    assert location_markdown("file:///runs/x/parity.png") == "`/runs/x/parity.png`"
    text = links_markdown([("parity chart", "file:///runs/x/parity.png"), ("embeddings", "s3://b/out/_manifest.json")])
    assert "- parity chart: `/runs/x/parity.png`" in text and "file://" not in text
    assert "- embeddings: [s3://b/out/_manifest.json](https://s3.console.aws.amazon.com/s3/object/b?prefix=" in text


def test_the_stage_table_artifact_rounds_seconds():
    from trnflow.flows._stages import _cell

    assert _cell(3.8351991310000813) == 3.8 and _cell("Completed") == "Completed" and _cell(None) is None
