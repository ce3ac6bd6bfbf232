"""`python -m oal` is the `oal` command."""

from .cli import main

main()
