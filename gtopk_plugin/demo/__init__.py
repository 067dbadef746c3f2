"""``gtopk-demo``: data-parallel training of a small CNN with sparse gradients.

Launches ``--workers`` local processes joined in a ``torch.distributed`` gloo
group, trains a small CNN on scikit-learn's 8x8 digits (bundled with
scikit-learn, no download) and reduces every step's gradients with
:class:`gtopk_plugin.GradientReducer`.  By default it trains twice from the
same seed, once with dense allreduce (S-SGD) and once with the chosen method
(gTop-k S-SGD: Shi et al., 2019, "A Distributed Synchronous SGD Algorithm with
Global Top-k Sparsification for Low Bandwidth Networks", arXiv 1901.04359),
and prints test accuracy and traffic side by side::

    gtopk-demo                       # 4 workers, gtopk vs dense
    python -m gtopk_plugin.demo --method rtopk --density 0.02 --json out.json

Each worker gets its shard of every global batch; the reducer's update (the
global top-k average for gTop-k, with error feedback keeping what was not
sent, Algorithm 2 of the paper) is written into ``p.grad`` and applied by
``torch.optim.SGD``.

The default run is the recipe the convergence study supports
(docs/recipes.md): for the sparse method, DGC momentum
correction with momentum factor masking (Lin et al. 2018), turned on with
``reducer.correct_momentum(opt, model.named_parameters())``, so that the
SGD optimizer's momentum 0.9 moves in front of the compressor (the
optimizer then steps without momentum), and a cosine learning-rate decay to
zero for both runs.  DGC's exponential density warm-up is one flag away
(``--warmup-epochs 1``: ``DensityWarmup``, 25% down to the target over the
first epoch); it is off by default because in this configuration it did not
help (lab/reports/convergence.md) and it raises the traffic above 15% of dense.
``--no-momentum-correction --lr-schedule const`` gives the old setup
(momentum applied by the optimizer to the sparse update), which ends
several points below dense.  Exit status is non-zero if any worker
raises, dies, or the run exceeds ``--timeout``; the surviving workers are
killed rather than left waiting in a collective.

Layout: :mod:`.cli` (arguments, the run on the project's one launcher
:mod:`gtopk_plugin._launch.launcher`, the report), :mod:`.train` (data, model and the
worker side), :mod:`.report` (table and JSON).  ``--method`` takes any
compressor in the registry (:func:`gtopk_plugin.compress.available`).
"""
from gtopk_plugin.demo.demo_cli import DEFAULTS, DemoError, build_parser, main, parse_args, run_workers  # noqa: F401
from gtopk_plugin.demo.report import format_table  # noqa: F401
from gtopk_plugin.demo.train import (WARMUP_START, build_model, load_data, lr_at, train_one,  # noqa: F401
                    uses_momentum_correction, warmup_schedule)
