import sys

from lab.convergence.cli import main

if __name__ == "__main__":
    sys.exit(main())
