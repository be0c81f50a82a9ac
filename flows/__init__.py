"""The flows room (`trnflow.flows`, kept in the repository's flows/ folder): Prefect flows.

A flow chains the stages' tasks (sanity, collectives, compile, train, evaluate, infer), names its
runs and holds the retraining lock. Flows never branch on the backend: the tasks and backends
decide where a job runs. They import `tasks` and the rooms below it, never boto3 or the SageMaker SDK.
"""
