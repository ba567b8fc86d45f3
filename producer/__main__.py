"""`python -m producer`: the same as the `producer` console script."""

from producer.cli import main

main()
