"""Run by Python at start-up in a process whose PYTHONPATH holds this folder (`s3faults.environment`):
the process injects the S3 faults TRNFLOW_S3_FAULTS asks for."""

from trnflow.testing import s3faults

s3faults.activate()
