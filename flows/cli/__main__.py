"""`python -m rollflow.flows.cli ...`: the `rollflow` console script without the script."""

from rollflow.flows.cli.root import main

main()
