"""The emulated AWS the cloud backends' tests run in: trnflow's deployment provisioned in moto, the
session's dataset uploaded, and MockCloud running each submitted job for real under its service's
contract; a quickstart spec on it, and what a completed run left on S3."""

import contextlib
import io

import pyarrow.parquet as pq

from trnflow.testing.mockcloud import MockCloud
from trnflow.testing.mockcloud.provision import SETTINGS, provision

HOST_LOST = "Host EC2 (instance i-0d4c3b2a10f9e8d7c) terminated."


def upload(s3, folder, bucket, prefix):
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            s3.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(folder)}")


@contextlib.contextmanager
def in_cloud(moto_endpoint, tmp_path, monkeypatch, dataset, faults=(), in_process=False, compile_cache=None,
             node_faults=None, no_capacity=None, host_faults=None):
    """The emulated AWS with trnflow's deployment in it and the session's dataset uploaded (and a
    compile cache, when given, as the S3 cache). The client reaches it in-process (`mock_aws`) or
    through the moto server on 127.0.0.1; the job containers always reach it through the server,
    as containers reach AWS over the network."""
    import boto3
    from moto import mock_aws

    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    if in_process:  # the SDK's role check calls IAM's policy simulator, which moto lacks
        monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
        monkeypatch.setenv("SAGEMAKER_VALIDATE_ROLE", "false")
    else:
        monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    with mock_aws() if in_process else contextlib.nullcontext():
        cloud = MockCloud(moto_endpoint, tmp_path / "cloud", faults=list(faults), node_faults=node_faults,
                          no_capacity=no_capacity, host_faults=host_faults)
        with cloud:
            outputs = provision(cloud.client)
            for name in SETTINGS:
                monkeypatch.setenv(f"TRNFLOW_{name}", outputs[name])
            s3 = boto3.client("s3")
            # the moto server, and so the bucket, is the worker's: the data and the cache an earlier
            # test left are emptied (another dataset's files in a day's folder fail the run)
            for prefix in ("reviews/", "neuron-cache/"):
                for key in s3_keys(s3, outputs["DATA_BUCKET"], prefix):
                    s3.delete_object(Bucket=outputs["DATA_BUCKET"], Key=key)
            upload(s3, dataset, outputs["DATA_BUCKET"], "reviews")
            if compile_cache is not None:
                upload(s3, compile_cache, outputs["DATA_BUCKET"], "neuron-cache")
            yield cloud, outputs["DATA_BUCKET"]


# A service fault `when="checkpoint"` strikes within half a second of the step-10 checkpoint, and
# the attempt's ranks die with its instances (the next checkpoint, at step 20, is seconds away).


def cloud_spec(make_spec, bucket, backend, **sections):
    s3 = f"s3://{bucket}"
    compute = {"backend": backend, "instance_type": "trn1.2xlarge", "nodes": 1, "cores_per_node": 2}
    if backend == "batch":  # two trn1.32xlarge nodes, one core each: a real two-node rendezvous; the
        # deployment's queue has a fair-share policy, which refuses jobs without a share identifier
        compute |= {"instance_type": "trn1.32xlarge", "nodes": 2, "cores_per_node": 1, "fair_share": True,
                    "share_identifier": "default"}
    compute |= sections.pop("compute", {})
    return make_spec(
        data=sections.pop("data", {"train": f"{s3}/reviews/train", "holdout": f"{s3}/reviews/holdout",
                                   "inference": f"{s3}/reviews/inference"}),
        compute=compute, compile=sections.pop("compile", {"cache_url": f"{s3}/neuron-cache"}),
        registry_url=sections.pop("registry_url", f"{s3}/registry"),
        train={"checkpoint_url": f"{s3}/checkpoints", "steps": 40, "checkpoint_every": 10} | sections.pop("train", {}),
        gate={"reference": "champion", "eval_every": 20} | sections.pop("gate", {}),
        inference=sections.pop("inference", {"output_url": f"{s3}/embeddings"}),
        retries={"max_retries": 2, "backoff_seconds": 0.5}, **sections)


def s3_keys(s3, bucket, prefix):
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


def assert_artifacts_in_s3(spec, bucket, results):
    import boto3

    s3 = boto3.client("s3")
    run = results["train"]["checkpoint"].rsplit("/", 2)[1]
    assert any(k.endswith("/COMMITTED") for k in s3_keys(s3, bucket, f"checkpoints/{run}/"))
    done = [k for k in s3_keys(s3, bucket, "neuron-cache/") if k.endswith("/model.done")]
    assert len(done) == 3  # the training, evaluation and embedding programs
    assert results["train"]["compile"]["recompiles"] == [] and results["train"]["compile"]["hits"] == 2, (
        results["train"]["compile"], results["train"]["start_step"])
    shards = [k for k in s3_keys(s3, bucket, "embeddings/") if k.endswith(".parquet")]
    assert shards and any(k.endswith("_manifest.json") for k in s3_keys(s3, bucket, "embeddings/"))
    table = pq.read_table(io.BytesIO(s3.get_object(Bucket=bucket, Key=shards[0])["Body"].read()))
    assert table.num_rows and "embedding" in table.column_names
    champion = [k for k in s3_keys(s3, bucket, "registry/") if "/champion/" in k]
    assert champion, "the gate passed, so the run was registered and promoted"


def our_batch_jobs(began: float) -> list[dict]:
    """The Batch jobs created since `began` (ms): the moto server is the session's, with earlier tests' jobs in it."""
    import boto3

    batch = boto3.client("batch")
    listed = [j["jobId"] for status in ("RUNNABLE", "STARTING", "RUNNING", "SUCCEEDED", "FAILED")
              for j in batch.list_jobs(jobQueue="trnflow-trn1", jobStatus=status)["jobSummaryList"]]
    return sorted((j for j in batch.describe_jobs(jobs=listed)["jobs"] if j["createdAt"] >= began),
                  key=lambda j: j["createdAt"])
