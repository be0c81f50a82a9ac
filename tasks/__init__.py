"""The tasks room (`trnflow.tasks`, kept in the repository's tasks/ folder): thin Prefect tasks.

One task per pipeline stage: it sends the stage's job to a backend, waits, and returns a typed
result with its artifacts attached. The retry policy lives here (which failures Prefect retries).
It imports the rooms below it, never the emulator or a backend's SDK.
"""
