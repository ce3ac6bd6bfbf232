"""`python -m oal` is the `oal` command."""

from oal.cli import main

main()
