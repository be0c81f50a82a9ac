"""The reporting room: what a person reads about a run.

It owns the charts (accuracy parity, training curve), the Markdown and table summaries of stage
results, the cost model (instance prices, billable time per job), and experiment tracking (the
MLflow server a spec's runs belong to). It imports the base modules, `specs`, `storage` and
`lifecycle`; never torch, Prefect or a backend.
"""
