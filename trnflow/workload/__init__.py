"""The workload room: the one program that runs on the NeuronCores, `python -m trnflow.workload <phase>`.

It owns the phases (sanity, collectives, compile, train, evaluate, infer), the `Trainer`, the
model recipes (`recipes`: the protocol, the registry and the built-in `m5-text`), data reading,
checkpoints and the inference layout. Every backend launches it
the same way. It reaches the hardware only through `trnflow.device`, and never imports Prefect,
boto3 or the emulator.
"""

from trnflow.specs import PREFLIGHT_FOLDER

__all__ = ["PREFLIGHT_FOLDER"]
