"""`python -m trnflow.cli`: the `trnflow` command."""

from trnflow.cli.app import main

main()
