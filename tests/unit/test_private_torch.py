"""PyTorch's private APIs that trnflow uses, checked against the release they were written for: on
another release this fails, saying where they are, before a training run finds out."""

import atexit
import importlib
import inspect

import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from trnflow.device import private_torch

PRIVATE = (("torch.distributed.tensor.placement_types", "_StridedShard"),
           ("torch._utils", "_flatten_dense_tensors"), ("torch._utils", "_unflatten_dense_tensors"),
           ("torch.distributed.checkpoint.state_dict_loader", "_load_state_dict"),
           ("torch.testing._internal.distributed.fake_pg", "FakeStore"),
           ("torch.distributed.checkpoint._traverse", "set_element"),
           ("torch.distributed.checkpoint.default_planner", "_EmptyStateDictLoadPlanner"),
           ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch._dynamo.config", "optimize_ddp"),
           *private_torch.PICKLED_NAMES)


def test_the_private_apis_were_checked_against_this_torch_release():
    release = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    assert release == private_torch.TORCH_CHECKED, (
        f"torch {torch.__version__} is installed; trnflow's uses of PyTorch's private APIs were checked against "
        f"{private_torch.TORCH_CHECKED}. Check each in trnflow/device/private_torch.py (and the overrides in "
        "trnflow/device/tensor_parallel.py, and atexit._clear in trnflow/backends/launcher.py), then set "
        "TORCH_CHECKED to this release")


def test_every_private_name_is_where_trnflow_reaches_for_it():
    missing = [f"{module}.{name}" for module, name in PRIVATE
               if not hasattr(importlib.import_module(module), name)]
    assert missing == [], f"gone from this torch ({torch.__version__}): {missing}; see trnflow/device/private_torch.py"
    for style in (ColwiseParallel, RowwiseParallel):  # the tensor-parallel styles override `_apply`, with these
        assert list(inspect.signature(style._apply).parameters) == ["self", "module", "device_mesh"]
        assert list(inspect.signature(style._prepare_input_fn).parameters) == [
            "input_layouts", "desired_input_layouts", "mod", "inputs", "device_mesh"]
        assert list(inspect.signature(style._prepare_output_fn).parameters) == [
            "output_layouts", "use_local_output", "mod", "outputs", "device_mesh"]
        made = style()
        assert all(hasattr(made, a) for a in ("input_layouts", "output_layouts", "use_local_output"))
    assert callable(atexit._clear) and callable(atexit._run_exitfuncs)  # the launcher's forked ranks


def test_the_wrappers_do_what_the_private_calls_did():
    parts = [torch.arange(3.0), torch.ones(2, 2)]
    flat = private_torch.flatten(parts)
    assert flat.shape == (7,)
    assert all(torch.equal(a, b) for a, b in zip(private_torch.unflatten(flat * 2, parts), [p * 2 for p in parts],
                                                   strict=True))
    placement = private_torch.strided_shard(0, 3)
    assert private_torch.in_parts(placement) and not private_torch.in_parts(object())
    tree: dict = {"a": {}}
    private_torch.set_element(tree, ("a", "b"), 5)
    assert tree == {"a": {"b": 5}}
