"""``gtopk-demo``'s command line: arguments, the run on P local gloo
workers (:func:`gtopk_plugin._launch.launcher.run`), and the report."""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import List, Optional, Sequence

from gtopk_plugin import compress
from gtopk_plugin._launch import launcher
from gtopk_plugin.demo.report import format_table, write_json
from gtopk_plugin.demo.train import WARMUP_START, load_data, worker

DEFAULTS = dict(workers=4, method="gtopk", density=0.05, epochs=8, batch_size=32, lr=0.05,
                momentum=0.9, seed=0, timeout=600.0, warmup_epochs=0.0, lr_schedule="cosine")


def _density(text: str) -> float:
    try:
        d = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"density must be a number in (0, 1]; got {text!r}") from None
    if not (0.0 < d <= 1.0):  # also rejects NaN
        raise argparse.ArgumentTypeError(f"density must be in (0, 1] (fraction of gradient entries "
                                         f"sent, e.g. 0.05); got {text}")
    return d


def _positive(kind):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}; got {text!r}") from None
        if not (v > 0):
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}; got {text}")
        return v
    return parse


def build_parser() -> argparse.ArgumentParser:
    d = DEFAULTS
    p = argparse.ArgumentParser(
        prog="gtopk-demo",
        description="Train a small CNN on the 8x8 digits with P local gloo workers, reducing "
                    "gradients with gtopk_plugin (gTop-k S-SGD, Shi et al. 2019), and compare "
                    "accuracy and traffic with dense allreduce.")
    p.add_argument("--workers", type=_positive(int), default=d["workers"],
                   help=f"number of worker processes P (default {d['workers']})")
    p.add_argument("--method", choices=compress.available(), default=d["method"],
                   help=f"gradient reduction method, any registered compressor (default {d['method']})")
    p.add_argument("--density", type=_density, default=d["density"],
                   help=f"fraction of entries each worker sends per layer, in (0, 1] "
                        f"(default {d['density']})")
    p.add_argument("--epochs", type=_positive(int), default=d["epochs"],
                   help=f"training epochs per run (default {d['epochs']})")
    p.add_argument("--batch-size", type=_positive(int), default=d["batch_size"],
                   help=f"global batch size, split across workers (default {d['batch_size']})")
    p.add_argument("--lr", type=_positive(float), default=d["lr"],
                   help=f"SGD learning rate (default {d['lr']})")
    p.add_argument("--momentum", type=float, default=d["momentum"],
                   help=f"SGD momentum (default {d['momentum']})")
    p.add_argument("--no-momentum-correction", action="store_true",
                   help="keep momentum in the optimizer, applied to the sparse update (by default the "
                        "sparse method runs DGC momentum correction + masking: "
                        "GradientReducer(..., momentum_correction=True, optimizer=opt))")
    p.add_argument("--warmup-epochs", type=float, default=d["warmup_epochs"],
                   help=f"DGC density warm-up: the density decays geometrically from {WARMUP_START:g} to "
                        f"--density over this many epochs (default {d['warmup_epochs']:g}; 0: off)")
    p.add_argument("--lr-schedule", choices=("cosine", "const"), default=d["lr_schedule"],
                   help=f"learning rate: cosine decay to 0 over the run, or constant (default {d['lr_schedule']})")
    p.add_argument("--seed", type=int, default=d["seed"], help=f"random seed (default {d['seed']})")
    p.add_argument("--no-compare", action="store_true",
                   help="skip the dense-allreduce baseline run")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    p.add_argument("--timeout", type=_positive(float), default=d["timeout"],
                   help=f"seconds before the whole run is abandoned (default {d['timeout']:g})")
    # Test-only hook (tests/distributed/test_demo.py): rank N raises at training step 1 of
    # the first run, to check that a failing worker ends the demo non-zero
    # without hanging.  Hidden from --help.
    p.add_argument("--fail-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.batch_size < args.workers:
        parser.error(f"--batch-size ({args.batch_size}) must be at least --workers ({args.workers}) "
                     "so that every worker gets a sample of each batch")
    if not (0.0 <= args.momentum < 1.0):
        parser.error(f"--momentum must be in [0, 1); got {args.momentum}")
    if not (args.warmup_epochs >= 0.0) or args.warmup_epochs > args.epochs:
        parser.error(f"--warmup-epochs must be in [0, --epochs]; got {args.warmup_epochs}")
    if args.fail_rank is not None and not (0 <= args.fail_rank < args.workers):
        parser.error(f"--fail-rank must be in [0, {args.workers - 1}]; got {args.fail_rank}")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        parser.error(f"--json {args.json}: directory {os.path.dirname(os.path.abspath(args.json))} "
                     "does not exist")
    return args


def _check_extras() -> None:
    """Fail early, in the launcher, if the demo's extra dependencies are missing."""
    missing = []
    for mod, pkg in (("sklearn", "scikit-learn"), ("tqdm", "tqdm"), ("numpy", "numpy")):
        try:
            __import__(mod)
        except ImportError:
            missing.append(pkg)
    if missing:
        raise DemoError(f"the demo needs {', '.join(missing)}: pip install 'gtopk-plugin[demo]'")


def _prepare_kernels() -> None:
    """Load (and, after a source change, compile) the CPU kernels once in the
    launcher, before the workers start: otherwise every worker waits on the
    same compilation inside ``--timeout`` (minutes on a loaded machine), and
    the demo times out before training begins.  Nothing to do with
    ``GTOPK_KERNELS=reference``; a failed build falls back to the reference
    kernels with the library's own warning."""
    import torch

    from gtopk_plugin import kernels

    kernels.backend(torch.device("cpu"))


# --------------------------------------------------------------- launcher
class DemoError(RuntimeError):
    """A worker failed, died or timed out."""


def run_workers(methods: List[str], args, data) -> List[dict]:
    """Run ``methods`` on ``args.workers`` gloo processes; return rank 0's
    results.  Raises :class:`DemoError` (every worker killed) if any worker
    fails or the run exceeds ``args.timeout``."""
    try:
        per_rank = launcher.run(args.workers, worker, methods, args, data, timeout=args.timeout)
    except launcher.LaunchTimeout as e:
        raise DemoError(f"{e} (raise --timeout for slower machines)") from None
    except launcher.LaunchError as e:
        raise DemoError(str(e)) from None
    if not per_rank[0]:
        raise DemoError("all workers exited cleanly but rank 0 left no results")
    return per_rank[0]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point ``gtopk-demo``; returns the exit status."""
    args = parse_args(argv)
    methods = [args.method] if (args.no_compare or args.method == "dense") else ["dense", args.method]
    recipe = []
    if args.method != "dense" and args.momentum > 0:
        recipe.append("no momentum correction (momentum in the optimizer)" if args.no_momentum_correction
                      else f"momentum {args.momentum:g} with DGC correction + masking")
    if args.method != "dense" and args.warmup_epochs > 0:
        recipe.append(f"density warm-up over {args.warmup_epochs:g} epoch(s)")
    recipe.append(f"{args.lr_schedule} lr {args.lr:g}")
    print(f"gtopk-demo: {args.workers} workers (gloo), methods {', '.join(methods)}, density "
          f"{args.density:g}, {args.epochs} epochs, global batch {args.batch_size}; {', '.join(recipe)}",
          flush=True)
    t0 = time.perf_counter()
    try:
        _check_extras()
        data = load_data()
        _prepare_kernels()
        results = run_workers(methods, args, data)
    except DemoError as e:
        print(f"gtopk-demo: error: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("gtopk-demo: interrupted; all workers were killed", file=sys.stderr, flush=True)
        return 130
    total = time.perf_counter() - t0
    print()
    print(format_table(results))
    print(f"\n(total wall time including process start-up: {total:.1f} s)", flush=True)
    if args.json:
        out = {"workers": args.workers, "method": args.method, "density": args.density,
               "epochs": args.epochs, "batch_size": args.batch_size, "lr": args.lr,
               "momentum": args.momentum, "momentum_correction": not args.no_momentum_correction,
               "warmup_epochs": args.warmup_epochs, "lr_schedule": args.lr_schedule,
               "seed": args.seed, "methods": methods,
               "total_wall_time_s": total, "results": {r["method"]: r for r in results}}
        try:
            write_json(args.json, out)
        except OSError as e:
            print(f"gtopk-demo: error: cannot write --json {args.json}: {e}", file=sys.stderr)
            return 1
    return 0


