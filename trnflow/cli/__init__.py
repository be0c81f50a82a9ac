"""The cli room: the `trnflow` command (typer and rich), the composition root.

It reads specs and settings, picks what to run, and prints results as tables or `--json`. It may
import every room but `testing`, except that `trnflow mock-aws` loads `trnflow.testing` lazily
(it needs the [mock] extra). Prefect and heavy modules are imported by the commands that use them,
so `trnflow --help` and `trnflow validate` start fast; the entry point (`trnflow.cli.main`) starts
`trnflow cache` without the rest of the app at all.
"""
