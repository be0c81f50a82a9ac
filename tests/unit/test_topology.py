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


def test_each_device_sits_on_one_numa_node_with_its_cpus_as_neuron_ls_prints_them():
    trn1 = instance("trn1.32xlarge")  # 128 vCPUs on 2 sockets: the first 8 devices on node 0
    assert [trn1.numa_node(d) for d in (0, 7, 8, 15)] == [0, 0, 1, 1]
    assert (trn1.cpu_affinity(0), trn1.cpu_affinity(15)) == ("0-31,64-95", "32-63,96-127")
    assert instance("trn2.48xlarge").cpu_affinity(15) == "48-95,144-191"
    assert (instance("trn1.2xlarge").cpu_affinity(0), instance("trn1.2xlarge").numa_node(0)) == ("0-7", 0)


def test_trnflow_devices_json_carries_each_devices_cpu_affinity_and_numa_node_where_neuron_ls_does():
    import json

    from typer.testing import CliRunner

    from trnflow.cli.app import app
    from trnflow.neuron.tools import parse_neuron_ls

    result = CliRunner().invoke(app, ["devices", "--instance-type", "trn1.32xlarge", "--json"])
    assert result.exit_code == 0, result.output
    records = json.loads(result.stdout)
    assert list(records[0])[:4] == ["neuron_device", "bdf", "cpu_affinity", "numa_node"]
    assert (records[0]["cpu_affinity"], records[0]["numa_node"]) == ("0-31,64-95", "0")  # a string, as neuron-ls
    assert (records[15]["cpu_affinity"], records[15]["numa_node"]) == ("32-63,96-127", "1")
    assert [r["numa_node"] for r in parse_neuron_ls(result.stdout)] == [0] * 8 + [1] * 8  # read back like the real one


def test_trnflow_devices_prints_neuron_ls_header_lines_and_columns():
    import io
    import re

    from rich.console import Console
    from typer.testing import CliRunner

    from trnflow.cli.app import app
    from trnflow.cli.render import neuron_ls_table

    result = CliRunner().invoke(app, ["devices", "--instance-type", "trn2.48xlarge"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == "instance-type: trn2.48xlarge"
    assert re.fullmatch(r"instance-id: i-[0-9a-f]{17}", lines[1]) and lines[2] == "logical-neuroncore-config: 2"
    console = Console(file=io.StringIO(), width=200)  # the table as a wide terminal shows it
    console.print(neuron_ls_table(neuron_ls("trn2.48xlarge")))
    table = console.file.getvalue().splitlines()
    for column in ("NEURON DEVICE", "NEURON CORES", "NEURON CORE IDS", "NEURON MEMORY", "CONNECTED DEVICES",
                   "PCI BDF", "CPU AFFINITY", "NUMA NODE"):
        assert column in table[1]
    assert [c.strip() for c in table[3].strip("│ ").split("│")][:8] == [
        "0", "4", "0-3", "96 GB", "12, 3, 4, 1", "10:1e.0", "0-47,96-143", "0"]
    narrow = Console(file=io.StringIO(), width=80)  # a narrow one wraps the CPU list rather than cut it
    narrow.print(neuron_ls_table(neuron_ls("trn2.48xlarge")))
    assert "…" not in narrow.file.getvalue()
