from trnflow.neuron.topology import neuron_ls, torus_neighbours
from trnflow.specs import CATALOGUE, instance
from trnflow.specs.instances import GIB


def test_trn1_32xlarge_has_16_devices_of_2_cores_and_32_gib():
    records = neuron_ls("trn1.32xlarge")
    assert len(records) == 16
    assert all(r["nc_count"] == 2 and r["memory_size"] == 32 * GIB for r in records)
    assert [r["neuroncore_ids"] for r in records[:2]] == [[0, 1], [2, 3]]
    assert records[-1]["neuroncore_ids"] == [30, 31]


def test_torus_links_match_neuron_ls_on_trn1_32xlarge():
    assert torus_neighbours(0, 16) == [12, 3, 4, 1]
    assert torus_neighbours(5, 16) == [1, 4, 9, 6]
    for dev in range(16):  # links are symmetric
        for other in torus_neighbours(dev, 16):
            assert dev in torus_neighbours(other, 16)


def test_core_counts_and_memory_per_core():
    assert instance("trn1.2xlarge").cores == 2
    assert instance("trn2.48xlarge").cores == 64
    assert instance("trn1.32xlarge").core_memory_bytes == 16 * GIB
    assert "logical_neuroncore_config" in neuron_ls("trn2.48xlarge")[0]
    assert {"inf2.xlarge", "inf2.48xlarge"} <= set(CATALOGUE)


def test_total_cores_sum_like_sagemaker_counts_them():
    # SageMaker's driver sums nc_count over `neuron-ls -j` to get SM_NUM_NEURONS.
    for name, itype in CATALOGUE.items():
        assert sum(r["nc_count"] for r in neuron_ls(name)) == itype.cores
