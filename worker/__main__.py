"""`python -m worker`: the same as the `ltx-worker` console script."""

from worker.cli import main

if __name__ == "__main__":
    main()
