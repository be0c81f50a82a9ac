"""The emulator room: NeuronCores emulated on plain PyTorch, reached only through `trnflow.device`.

It owns the emulated runtime's core ownership (one process per core, by lock file), the compiler
(TorchInductor standing in for neuronx-cc, with its optlevels), the compile backend that reads and
fills the persistent cache, software stochastic rounding, the fault model and `trnflow top`'s
monitor. `trnflow.emulator.device` is the `Device` the registry hands out under the name `emulator`.
It imports `device` and the rooms below it.
"""
