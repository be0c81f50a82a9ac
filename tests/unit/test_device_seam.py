"""The placement half of the device seam, on the emulator (whose torch device is the CPU): inputs
stay the same tensors, host copies are the tensors themselves, and state dicts keep their shape."""

import torch

from trnflow.device.registry import get_device


def test_on_the_cpu_nothing_is_copied_and_nests_keep_their_shape():
    device = get_device("emulator")
    assert device.torch_device == torch.device("cpu")
    t = torch.arange(4)
    assert device.put(t) is t
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    state = optimizer.state_dict()
    host = device.to_host(state)
    assert host["param_groups"] == state["param_groups"]
    assert isinstance(host["param_groups"][0]["betas"], tuple)
    assert all(host["state"][i][k] is state["state"][i][k] for i in state["state"] for k in state["state"][i])
    weights = device.to_host(model.state_dict())
    assert weights["weight"].data_ptr() == model.weight.data_ptr()


def test_evaluation_runs_without_autograd():
    with get_device("emulator").inference():
        assert not torch.is_grad_enabled()
