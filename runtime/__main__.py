"""`python -m runtime` is `runtime`."""

from runtime.cli import main

main()
