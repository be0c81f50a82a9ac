"""The mocked cloud, run for real: moto's SageMaker and Batch, with every submitted job executed by
the NeuronCore emulator under the service's container contract. Used by the tests, and by
`trnflow mock-aws` for trying the cloud backends on one machine."""

from trnflow.testing.mockcloud.cloud import MockCloud, ServiceFault

__all__ = ["MockCloud", "ServiceFault"]
