"""`python -m trnflow.cli`: the `trnflow` command."""

from trnflow.cli.main import main

main()
