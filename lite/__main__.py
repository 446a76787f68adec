"""`python -m lite` is `lite`."""

from lite.cli import main

main()
