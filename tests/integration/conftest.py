"""Every integration test starts with its worker's compile cache warm (`warm_compile_cache`):
`make_spec`'s model is compiled once for the whole pytest run, not in the first test of each
worker. A test about cold compiles names a cache folder of its own."""

import pytest

from tests.conftest import once_per_run
from tests.faults.matrix import Matrix
from tests.faults.world import world


@pytest.fixture(autouse=True)
def _warm_cache(warm_compile_cache):
    return warm_compile_cache


@pytest.fixture(scope="session")
def fault_free(tmp_path_factory, warm_compile_cache, prefect_api):
    """The folder of the fault-free run of a layout (`ddp`, `fsdp`), made once for the pytest run."""

    def folder(layout: str):
        def make(root):
            with world(root, reference=False, prefect=False, compile_cache=warm_compile_cache) as w, \
                    Matrix(w) as matrix:
                matrix.run_baseline(layout)

        made = once_per_run(tmp_path_factory, f"fault-free-{layout}", make)
        return made / ("baseline" if layout == "ddp" else f"baseline-{layout}")

    return folder
