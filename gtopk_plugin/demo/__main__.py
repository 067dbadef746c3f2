"""``python -m gtopk_plugin.demo``: the ``gtopk-demo`` console script."""
import sys

from gtopk_plugin.demo.demo_cli import main

sys.exit(main())
