"""The workload: the program every backend runs on the NeuronCores, phase by phase."""
