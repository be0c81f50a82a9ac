"""Prefect tasks, one per pipeline stage, over the backends. The retry policy lives here."""
