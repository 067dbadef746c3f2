"""``gtopk-demo``: data-parallel training of a small CNN with sparse gradients.

Launches ``--workers`` local processes joined in a gloo group, trains a
small CNN on scikit-learn's bundled 8x8 digits and reduces every step's
gradients with :class:`gtopk_plugin.GradientReducer`.  By default it trains
twice from the same seed, dense allreduce and the chosen method (gTop-k
S-SGD: Shi et al. 2019, arXiv 1901.04359), and prints accuracy and traffic
side by side::

    gtopk-demo                       # 4 workers, gtopk vs dense
    python -m gtopk_plugin.demo --method rtopk --density 0.02 --json out.json

The default recipe (docs/recipes.md): DGC momentum correction via
``GradientReducer(..., momentum_correction=True, optimizer=opt, ...)`` and a cosine
learning rate; ``--warmup-epochs`` turns on DGC's density warm-up,
``--no-momentum-correction`` leaves momentum to the optimizer.  Exit status
is non-zero if any worker raises, dies or exceeds ``--timeout``.
Layout: :mod:`.demo_cli` (arguments, the run on the launcher),
:mod:`.train`, :mod:`.report`.  ``--method``: any registered compressor.
"""
from gtopk_plugin.demo.demo_cli import DEFAULTS, DemoError, build_parser, main, parse_args, run_workers  # noqa: F401
from gtopk_plugin.demo.report import format_table  # noqa: F401
from gtopk_plugin.demo.train import (WARMUP_START, build_model, load_data, lr_at, train_one,  # noqa: F401
                    uses_momentum_correction, warmup_schedule)
