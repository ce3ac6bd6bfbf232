"""`python -m oal` is the `oal` command."""

from oal.cli import main

if __name__ == "__main__":  # importing the module (pydoc, griffe, a module walker) starts nothing
    main()
