"""The Neuron SDK's tools as a Neuron host has them: `neuron-ls --json-output` and `nccom-test`'s
JSON report, read in their real formats, and run when on PATH (here: scripts that print what the
real tools print, since no Neuron host is reachable)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.sdk_tools import NCCOM_TEST, fake_neuron_ls, fake_tool
from trnflow.backends import launcher
from trnflow.errors import FatalError
from trnflow.neuron import launch, tools

pytestmark = pytest.mark.unit

TRN2_DEVICE = {"neuron_device": 0, "bdf": "cc:00.0", "cpu_affinity": "48-95,144-191", "numa_node": "1",
               "connected_to": [12, 3, 4, 1], "nc_count": 4, "logical_neuroncore_config": 2,
               "memory_size": 103079215104, "neuroncore_ids": [0, 1, 2, 3],
               "neuron_processes": [{"pid": 113985, "command": "neuron-bench exec", "neuron_runtime_version": "2.0.0"}]}


def test_neuron_ls_json_is_read_with_its_real_fields_and_checked_against_the_jobs_cores():
    second = {**TRN2_DEVICE, "neuron_device": 1, "neuroncore_ids": [4, 5, 6, 7], "neuron_processes": []}
    records = tools.parse_neuron_ls(json.dumps([TRN2_DEVICE, second]))
    assert records[0]["cpu_affinity"] == "48-95,144-191" and records[0]["numa_node"] == 1
    found = tools.inventory(records, cores=[2, 3, 8], own_pids={4242})
    assert found.model_dump() == {"source": "neuron-ls", "devices": 2, "cores": 8, "missing": [8],
                                  "held": {2: {"pid": 113985, "command": "neuron-bench exec"},
                                           3: {"pid": 113985, "command": "neuron-bench exec"}}}
    assert tools.inventory(records, cores=[2, 3], own_pids={113985}).held == {}  # the job's own processes


@pytest.mark.parametrize("text, problem", [("not json", "not JSON"), ('{"a": 1}', "expected a list"),
                                           ('[{"neuron_device": 0}]', "has no nc_count, neuroncore_ids")])
def test_neuron_ls_output_it_cannot_read_is_an_error_that_says_what(text, problem):
    with pytest.raises(FatalError, match=problem):
        tools.parse_neuron_ls(text)


def test_nccom_json_is_read_with_either_time_column():
    current = {"results": [{"size(B)": 1024, "count(elems)": 256, "type": "fp32", "algbw(GB/s)": 0.1655,
                            "busbw(GB/s)": 0.1604, "time:avg(us)": 6.19}]}
    older = {"results": [{"size(B)": 33554432, "count(elems)": 33554432, "type": "uint8", "algbw(GB/s)": 40.69,
                          "busbw(GB/s)": 40.69, "time(us)": 768}]}
    # the rows say time:avg(us), as current versions do, whichever name the tool wrote
    assert [r.model_dump(exclude_defaults=True) for r in tools.parse_nccom_json(json.dumps(current), "all_reduce")] == [
        {"op": "all_reduce", "size(B)": 1024, "count(elems)": 256, "type": "fp32", "time:avg(us)": 6.19,
         "algbw(GB/s)": 0.1655, "busbw(GB/s)": 0.1604}]  # stored under the tool's own columns
    assert tools.parse_nccom_json(json.dumps(older), "all_gather")[0].time_us == 768.0
    with pytest.raises(FatalError, match=r"no time column \(neither time:avg\(us\) nor time\(us\)\)"):
        tools.parse_nccom_json('{"results": [{"size(B)": 8}]}', "all_reduce")
    with pytest.raises(FatalError, match=r"no time column"):  # a null time is no time
        tools.parse_nccom_json('{"results": [{"size(B)": 8, "time:avg(us)": null}]}', "all_reduce")
    with pytest.raises(FatalError, match=r"no size\(B\)"):
        tools.parse_nccom_json('{"results": [{"time(us)": 8}]}', "all_reduce")


def test_numa_node_is_read_as_a_number_however_neuron_ls_writes_it():
    records = [{**TRN2_DEVICE, "numa_node": value} for value in ("1", 0, "-1", "n/a")]
    assert [r["numa_node"] for r in tools.parse_neuron_ls(json.dumps(records))] == [1, 0, -1, None]
    without = {k: v for k, v in TRN2_DEVICE.items() if k not in ("cpu_affinity", "numa_node")}  # an older neuron-ls
    assert "numa_node" not in tools.parse_neuron_ls(json.dumps([without]))[0]


def test_rows_read_from_either_time_column_show_the_same_in_every_table():
    from trnflow.cli.render import nccom_text
    from trnflow.reporting.report import collectives_markdown
    from trnflow.results import CollectivesResult

    base = {"size(B)": 65536, "count(elems)": 16384, "type": "fp32", "algbw(GB/s)": 1.0, "busbw(GB/s)": 1.5}
    for column in ("time:avg(us)", "time(us)"):
        rows = tools.parse_nccom_json(json.dumps({"results": [{**base, column: 61.0}]}), "all_reduce")
        result = CollectivesResult(ranks=4, rows=rows, avg_busbw=1.5, avg_busbw_by_op={"all_reduce": 1.5})
        assert "| all_reduce | 65,536 | fp32 | 61 | 1.000 | 1.500 | - |" in collectives_markdown(result)
        assert nccom_text(rows).splitlines()[2].split() == ["65536", "16384", "fp32", "61.0", "1.0000", "1.5000", "-"]
    assert nccom_text(rows).splitlines()[1].split()[3] == "time:avg(us)"  # the tool's own header
    for column in ("time:avg(us)", "time(us)"):  # rows as stored, by this trnflow or an older one
        stored = [{**base, "op": "all_reduce", column: 61.0}]
        result = CollectivesResult(ranks=4, rows=stored, avg_busbw=1.5, avg_busbw_by_op={"all_reduce": 1.5})
        assert "| all_reduce | 65,536 | fp32 | 61 | 1.000 | 1.500 | - |" in collectives_markdown(result)
        assert nccom_text(result.rows).splitlines()[2].split()[3] == "61.0"


def test_an_unchecked_nccom_test_sweep_is_not_reported_wrong(tmp_path, monkeypatch):
    from trnflow.reporting.report import collectives_markdown
    from trnflow.results import CollectivesResult

    fake_tool(tmp_path, "nccom-test", NCCOM_TEST)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    rows = tools.nccom_sweep("all_reduce", 4, 65536, 65536, 4, "fp32", 5, 1, check=False)
    assert rows[0].correct is None  # without -c, nccom-test says nothing of the results
    shown = collectives_markdown(CollectivesResult(ranks=4, rows=rows, avg_busbw=1.5))
    assert "WRONG" not in shown and shown.rstrip().endswith("| - |")


def test_the_tools_run_from_path_with_the_real_command_lines(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    fake_neuron_ls(bin_dir, [TRN2_DEVICE])
    fake_tool(bin_dir, "nccom-test", NCCOM_TEST)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    assert tools.which("neuron-ls") == str(bin_dir / "neuron-ls")
    assert tools.neuron_ls()[0]["nc_count"] == 4
    rows = tools.nccom_sweep("all_reduce", 4, 65536, 65536, 4, "fp32", 5, 1, check=True)
    assert [r.model_dump(exclude_defaults=True) for r in rows] == [
        {"op": "all_reduce", "size(B)": 65536, "count(elems)": 16384, "type": "fp32", "time:avg(us)": 61.0,
         "algbw(GB/s)": 1.0, "busbw(GB/s)": 1.5, "correct": True}]
    (wrong,) = tools.nccom_sweep("all_to_all", 4, 65536, 65536, 4, "fp32", 5, 1, check=True)
    assert wrong.correct is False
    argv = tools.nccom_command("all_gather", 8, 1024, 4096, 2, "bf16", 20, 5, True, Path("/r.json"))
    assert argv == ["nccom-test", "all_gather", "-r", "8", "-b", "1024", "-e", "4096", "-f", "2", "-d", "bf16",
                    "-n", "20", "-w", "5", "--non-interactive", "--report-to-json-file", "/r.json", "-c", "all_ones"]


def test_neuron_parallel_compile_wraps_the_trial_and_its_totals_are_read(tmp_path, monkeypatch):
    log = """INFO ||NEURON_CACHE||: Current remaining items are 0, locked are 0, failed are 0, done are 5, total is 5
INFO ||NEURON_PARALLEL_COMPILE||: {"compilation_summary": {"true": 5}, "compilation_report": {}}
INFO ||NEURON_PARALLEL_COMPILE||: Total graphs: 5
INFO ||NEURON_PARALLEL_COMPILE||: Total successful compilations: 4
INFO ||NEURON_PARALLEL_COMPILE||: Total failed compilations: 1
"""
    assert tools.parse_parallel_compile(log) == {"graphs": 5, "compiled": 4, "failed": 1}
    assert tools.parse_parallel_compile("no totals here") == {}
    assert tools.parallel_compile_command("/opt/npc", 4, ["python", "-m", "x"]) == [
        "/opt/npc", "--num_parallel", "4", "python", "-m", "x"]

    from tests.sdk_tools import fake_parallel_compile

    trial = tmp_path / "trial.py"
    out = tmp_path / "out"
    trial.write_text(f"import json, pathlib; p = pathlib.Path({str(out)!r}); p.mkdir(); "
                     "(p / 'result.json').write_text(json.dumps({'trial': True}))")
    command = ["python3", str(trial), "--output", str(out)]
    fake_parallel_compile(tmp_path / "bin", tmp_path / "record.json", failed=1)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(FatalError, match=r"(?s)neuron_parallel_compile failed \(exit 1, 1 failed compilations\).*"
                                         r"Received error code"):
        tools.parallel_compile(2, command, dict(os.environ))
    seen = json.loads((tmp_path / "record.json").read_text())
    assert seen["workers"] == 2 and seen["command"] == command and seen["trial_result"] == {"trial": True}


def test_the_compiler_is_given_a_local_cache_as_a_path_and_trnflow_reads_it_back_as_a_url(tmp_path):
    """neuronx-cc's --cache_dir and NEURON_COMPILE_CACHE_URL take an s3:// URL or a folder; a spec
    names a local cache as file://, which the compiler would take for a relative folder."""
    from tests.conftest import quickstart_data
    from trnflow.neuron.launch import cache_url, neuron_env
    from trnflow.specs import validate_spec

    cache = tmp_path / "compile cache"
    spec = validate_spec(quickstart_data(compile={"cache_url": cache.as_uri()}))
    env = neuron_env(spec, [0], "trn1.2xlarge")
    assert env["NEURON_COMPILE_CACHE_URL"] == str(cache)
    assert env["NEURON_CC_FLAGS"].endswith(f"--cache_dir={cache}")
    assert cache_url("file:///elsewhere", {"NEURON_COMPILE_CACHE_URL": str(cache)}) == cache.as_uri()
    s3 = validate_spec(quickstart_data(compile={"cache_url": "s3://acme-cache/neuron"}))
    assert neuron_env(s3, [0], "trn1.2xlarge")["NEURON_COMPILE_CACHE_URL"] == "s3://acme-cache/neuron"


def test_the_workloads_ranks_are_forked_on_linux_unless_told_to_exec_or_on_a_neuron_host(monkeypatch):
    monkeypatch.setattr(launcher.sys, "platform", "linux")
    assert launcher.forks_ranks("trnflow.workload", {}, devices=False) is True
    assert launcher.forks_ranks("trnflow.workload", {}, devices=True) is False  # a Trainium host: as torchrun does
    assert launcher.forks_ranks("trnflow.workload", {"TRNFLOW_RANK_START": "exec"}) is False
    assert launcher.forks_ranks("some.other.module", {}) is False  # only the workload offers a preload
    assert launcher.forks_ranks(None, {}) is False  # a script, not a module
    monkeypatch.setattr(launcher.sys, "platform", "darwin")  # torch cannot be forked there
    assert launcher.forks_ranks("trnflow.workload", {}, devices=False) is False


def test_neuron_devices_are_found_by_their_device_files(tmp_path):
    assert launch.neuron_devices_here(tmp_path) is False
    (tmp_path / "neuron_other").touch()
    assert launch.neuron_devices_here(tmp_path) is False
    (tmp_path / "neuron0").touch()
    assert launch.neuron_devices_here(tmp_path) is True


def test_every_jobs_command_runs_the_launcher_program_the_contract_names(tmp_path):
    """The command is built in the torch-free neuron room, which names the launcher program (the
    backends' module) without importing it."""
    assert launcher.__name__ == launch.LAUNCHER
    argv = launch.launch_command("train", 2, tmp_path, "r1")
    assert argv[1:4] == ["-m", launcher.__name__, str(tmp_path / "ranks")]


def test_the_launch_contract_and_the_launchers_module_load_no_torch():
    """Building a job's command and environment, and reading the launcher's records, load no torch:
    only running torchrun (the launcher's `main`) does."""
    probe = ("import sys, trnflow.neuron.launch, trnflow.neuron.plan, trnflow.neuron.tools, trnflow.neuron.topology, "
             "trnflow.neuron.nccom, trnflow.neuron.devices, trnflow.backends.launcher, trnflow.backends.failures; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
