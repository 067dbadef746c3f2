"""``python -m lab train-report``: the time-to-accuracy table over rows that
several ``python -m lab train`` jobs wrote.

A job that adds methods to a group (``--methods dense-fp16,rtopk`` for a
seed whose dense and Top-k rows an earlier job ran) has no baseline of its
own, so its table shows no time to target.  This joins the rows of every
JSON given, groups them as one job would (workload, link label, seed,
engine; the elastic engine against its dense barrier), and recomputes
targets and ratios with the same code (``report.summarise``)::

    python -m lab train-report lab/results/train_p4_vgg_paper_800_2seeds.json \\
        lab/results/train_p4_vgg_paper_800_more_seed1.json --seeds 1

A row of the same configuration (engine, method, density, policy, beta,
Horovod cycle) in the same group in a later file replaces the earlier one,
and the replacement is printed; rows are never averaged.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from typing import List, Optional, Sequence

from lab.train import report


def identity(r: dict) -> tuple:
    """What makes two rows the same configuration within a group."""
    return report.group_key(r) + tuple(r.get(k) for k in ("method", "density", "policy", "beta", "cycle_ms"))


def join(documents: Sequence[dict], seeds: Optional[Sequence[int]] = None, log=None) -> List[dict]:
    """Rows of every document (copies), later files replacing earlier rows
    of the same identity, restricted to ``seeds``; summarised."""
    rows, where = [], {}
    for i, doc in enumerate(documents):
        for r in doc["rows"]:
            if seeds is not None and r["seed"] not in seeds:
                continue
            r = copy.deepcopy(r)
            key = identity(r)
            if key in where:
                if log is not None:
                    log(f"file {i + 1} replaces the row {r['name']!r} (seed {r['seed']}, {r['engine']}) "
                        f"of file {where[key][0] + 1}")
                rows[where[key][1]] = r
                where[key] = (i, where[key][1])
            else:
                where[key] = (i, len(rows))
                rows.append(r)
    rows.sort(key=lambda r: report.group_key(r))  # stable: each group's rows keep their order
    return report.summarise(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+", help="train JSONs, earliest first")
    ap.add_argument("--seeds", type=int, nargs="+", help="only these seeds")
    ap.add_argument("--md", help="also write the table to this file")
    args = ap.parse_args(argv)
    docs = []
    for path in args.json:
        with open(path) as f:
            docs.append(json.load(f))
    rows = join(docs, args.seeds, log=lambda m: print(m, file=sys.stderr))
    table = report.markdown(rows)
    print(table, end="")
    if args.md:
        with open(args.md, "w") as f:
            f.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
