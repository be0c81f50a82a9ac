"""The testing room: test machinery, never imported by the product.

It owns the mocked cloud (moto's SageMaker, Batch, S3 and CloudWatch, with each submitted job run
for real on the emulator), the `trnflow mock-aws` server and the S3 fault injector. It needs the
[mock] extra (moto). Only the tests and `trnflow mock-aws` import it; it may import any room.
"""
