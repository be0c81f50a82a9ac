"""The fault matrix's sharded CI cases (fsdp over two cores): a rank torn while writing its shard of a
checkpoint, and a hardware error that leaves fewer cores, each compared with the fault-free fsdp
run. A file of their own, so that the two test processes share the matrix's CI cases."""

import pytest

from tests.integration.test_fault_matrix import SHARDED, run_ci_case


@pytest.mark.slow
@pytest.mark.parametrize("name", SHARDED)
def test_a_sharded_ci_case_of_the_fault_matrix_ends_like_its_fault_free_run(name, fault_free, prefect_api, tmp_path,
                                                                             warm_compile_cache):
    run_ci_case(name, fault_free, tmp_path, warm_compile_cache)
