"""The neuron room: torch-free facts about Trainium hosts and the Neuron tools' formats.

It owns the launch contract of a host (torchrun, NEURON_RT_VISIBLE_CORES, NEURON_CC_FLAGS and the
cache location they name), core placement rules, and the device topology in `neuron-ls`'s shape,
as functions that start nothing and load no torch; the launcher program that runs torchrun is the
backends' (`trnflow.backends.launcher`), and the instance catalogue lives in `specs`. It imports
only the base modules and `specs`.
"""
