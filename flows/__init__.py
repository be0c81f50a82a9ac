"""Prefect flows composing the pipeline stages. They never branch on the backend."""
