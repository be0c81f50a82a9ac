"""The fault matrix: the quickstart pipeline, shortened, run once without faults and once per fault,
each run compared with the fault-free one. `make faults` runs every case; `make test` a few."""
