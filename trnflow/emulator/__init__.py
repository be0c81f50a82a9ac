"""The NeuronCore emulator: Trainium topology, launch contracts and compile cache on plain PyTorch."""
