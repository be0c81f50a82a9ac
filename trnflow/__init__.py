"""trnflow: production training pipelines for AWS Trainium, with a local NeuronCore emulator."""

__version__ = "0.1.0"
