import sys

from lab.train.cli import main

sys.exit(main())
