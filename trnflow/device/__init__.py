"""The device room: the seam between the workload and the NeuronCores it runs on.

It owns the `Device` interface (torch device, compile backend and its persistent cache,
process-group backend, precision, sync point, visible cores, compile metrics), the registry that
finds a device by name, and the persistent compile cache's layout (`cache`, `plans`), which is
torch-free. It imports the base modules, `specs` and `neuron`; devices themselves (today the
emulator, `trnflow.emulator.device`) import it, never the other way round.

Import what you need from `trnflow.device.base` and `trnflow.device.registry` (which load torch),
or from `trnflow.device.cache` and `trnflow.device.plans` (which do not).
"""
