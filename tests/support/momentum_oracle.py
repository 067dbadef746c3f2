"""Independent numpy oracle of DGC momentum correction + momentum factor
masking (Lin et al. 2018), written from docs/design.md §2 without the library's
MomentumCorrection or reducer code.

Per worker r (float32 throughout, in the operation order DGC states):
    u ← m·u + g             (Nesterov: u ← m·(u + g); increment u + g)
    acc = increment + v     (v: the error-feedback residual)
    the selection/aggregation of ``acc`` across workers (who sends what and
    which entries reach the global result) comes from the selection oracle
    ``gtopk_plugin.testing.Oracle`` run with error feedback off, which is
    itself checked against brute force elsewhere;
    v ← acc with the reached entries less what was sent (0 in fp32);
    u ← 0 at the reached entries (masking).
"""
from __future__ import annotations

from typing import Dict, List

import numpy as np
import torch

from gtopk_plugin.testing import Oracle


class NumpyMomentumOracle:
    def __init__(self, P: int, momentum: float, nesterov: bool = False, masking: bool = True,
                 **selection_kwargs):
        self.P, self.m, self.nesterov, self.masking = P, np.float32(momentum), nesterov, masking
        self.sel = Oracle(P, error_feedback=False, **selection_kwargs)
        self.method = selection_kwargs.get("method")
        self.u: List[Dict[str, np.ndarray]] = [dict() for _ in range(P)]
        self.v: List[Dict[str, np.ndarray]] = [dict() for _ in range(P)]
        self.increments_total: Dict[str, np.ndarray] = {}
        self.result_total: Dict[str, np.ndarray] = {}

    def step(self, grads_per_rank):
        names = sorted(grads_per_rank[0])
        accs = []
        for r in range(self.P):
            acc = {}
            for n in names:
                g = grads_per_rank[r][n].detach().numpy().astype(np.float32).reshape(-1)
                u = self.u[r].setdefault(n, np.zeros_like(g))
                if self.nesterov:
                    u = ((u + g) * self.m).astype(np.float32)
                    inc = (u + g).astype(np.float32)
                else:
                    u = (u * self.m + g).astype(np.float32)
                    inc = u
                self.u[r][n] = u
                v = self.v[r].get(n)
                a = inc.copy() if v is None else (inc + v).astype(np.float32)
                acc[n] = a
                self.increments_total[n] = self.increments_total.get(n, 0) + inc.astype(np.float64)
            accs.append(acc)
        shapes = {n: tuple(grads_per_rank[0][n].shape) for n in names}
        out = self.sel.step([{n: torch.from_numpy(a[n].reshape(shapes[n])) for n in names} for a in accs])
        sizes = [accs[0][n].size for n in names]
        offs = np.cumsum([0] + sizes)
        for r in range(self.P):
            flat_acc = np.concatenate([accs[r][n] for n in names])
            flat_u = np.concatenate([self.u[r][n] for n in names])
            reached = self.sel.last_sent[r].numpy().astype(np.int64)
            flat_acc[reached] = 0.0          # fp32: acc − sent = 0 where it reached
            if self.masking and self.method != "dense":
                flat_u[reached] = 0.0
            for j, n in enumerate(names):
                self.v[r][n] = flat_acc[offs[j]:offs[j + 1]].copy()
                self.u[r][n] = flat_u[offs[j]:offs[j + 1]].copy()
        for n in names:
            self.result_total[n] = self.result_total.get(n, 0) + out[n].numpy().reshape(-1).astype(np.float64)
        return out
