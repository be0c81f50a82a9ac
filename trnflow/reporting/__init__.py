"""The reporting room: what a person reads about a run.

It owns the charts (accuracy parity, training curve), the Markdown and table summaries of stage
results, and the cost model (instance prices, billable time per job). It imports the base
modules, `specs`, `storage` and `lifecycle`; never torch, Prefect or a backend.
"""
