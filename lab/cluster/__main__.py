import sys

from lab.cluster.cli import main

sys.exit(main())
