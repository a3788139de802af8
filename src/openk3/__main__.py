"""`python -m openk3 ...` is the same as the `openk3` console script."""

from openk3.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
