"""``python -m gtopk_plugin.demo``: the ``gtopk-demo`` console script."""
import sys

from .cli import main

sys.exit(main())
