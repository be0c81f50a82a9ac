"""The lifecycle room: what happens to a model after training, torch-free.

It owns the model registry (versions, champion, promotion, rollback), the accuracy-parity gate
(candidate against an fp32 reference and against the champion: `gate` compares series, `judge`
decides, registers and sums up). It imports the base modules, `specs` and `storage`; the workload
reads the registry and writes the gate's metric series through it. Training the fp32 reference is
a job, so it lives with the backends (`trnflow.backends.reference`).
"""
