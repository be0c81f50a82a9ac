"""Sharded training (fsdp) on each cloud backend, in MockCloud."""



import pytest

from tests.clouds import (
    cloud_spec,
    in_cloud,
)
from trnflow.flows.pipeline import pipeline


@pytest.mark.slow
@pytest.mark.parametrize("service", ["sagemaker", "batch"])
def test_the_pipeline_with_sharded_training_on_each_cloud_backend(
        service, prefect_api, make_spec, moto_endpoint, tmp_path, monkeypatch, dataset):
    """train.parallelism.strategy fsdp over the two ranks of each service's job (two nodes of one
    core on Batch): the whole pipeline completes, training compiles nothing beyond what the compile
    stage cached, each rank held half of the state, and the registry gets the model whole."""
    from trnflow.lifecycle.registry import Registry
    from trnflow.workload.checkpoint import load

    with in_cloud(moto_endpoint, tmp_path, monkeypatch, dataset) as (_, bucket):
        spec = cloud_spec(make_spec, bucket, service, train={"parallelism": {"strategy": "fsdp"}},
                           registry_url=f"s3://{bucket}/registry-fsdp-{service}")
        state = pipeline(spec, return_state=True)
        outcome = state.result(raise_on_failure=False)
        assert state.is_completed(), outcome
        train = outcome.results["train"]
        assert train.compile.recompiles == [] and train.compile.hits == train.compile.graphs > 0
        memory = train.device_memory
        assert memory.weights * 2 == pytest.approx(sum(p.numel() for p in load(train.checkpoint).model.values()) * 4,
                                                      rel=0.05)
        final = load(train.checkpoint)
        assert final.meta.parallelism == "fsdp" and sorted(final.shards)[1:] == ["__0_0.distcp", "__1_0.distcp"]
        champion = Registry(spec.registry_url).champion(spec.name)
        assert champion is not None and champion.checkpoint == train.checkpoint
        assert champion.entry.weights == f"{train.checkpoint}/model.pt"  # the model whole, beside its shards
