"""A procedurally generated image task that needs no download: "glyphs".

Ten classes, each a fixed glyph of four random pen strokes (drawn once from
``TEMPLATE_SEED``).  Every sample draws its class glyph under a random affine
map (rotation ±30°, scale 0.7–1.15, shear ±0.25, shift ±3 px), with a random
stroke width, adds two distractor strokes of random intensity, random
contrast, and Gaussian pixel noise, on a 16 x 16 canvas.  The distractors and
the translation make a linear read-out weak and the noise makes the task
non-saturating, so differences between reduction methods stay visible.

Difficulty (measured with :func:`difficulty_report`, defaults below, seed 0,
6000 train / 2000 test): chance 10%; multinomial logistic regression on the
raw pixels ~55%; the study's 41k-parameter CNN trained densely for the full
budget ~80-85% (numbers in lab/reports/convergence.md).  ``noise`` and
``distractors`` are the difficulty knobs.

Everything is a pure function of the seeds: the same arrays on every machine
with the same torch version.
"""
from __future__ import annotations

import math
from typing import Dict

import torch

TEMPLATE_SEED = 1234
SIZE = 16
CLASSES = 10
STROKES = 4


def _templates(seed: int = TEMPLATE_SEED) -> torch.Tensor:
    """[CLASSES, STROKES, 2 endpoints, 2 coords] in [-1, 1]; strokes are
    chained (each starts where the previous ended) so glyphs look like pen
    drawings; a class is re-drawn until its strokes are long enough."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(CLASSES):
        while True:
            pts = torch.rand(STROKES + 1, 2, generator=g) * 1.5 - 0.75
            seg = torch.stack([pts[:-1], pts[1:]], 1)
            if (seg[:, 1] - seg[:, 0]).norm(dim=1).min() > 0.45:
                break
        out.append(seg)
    return torch.stack(out)


def _render(segs: torch.Tensor, width: torch.Tensor, intensity: torch.Tensor) -> torch.Tensor:
    """Rasterise line segments [n, S, 2, 2] (coordinates in [-1, 1]) with a
    Gaussian pen profile of per-sample ``width`` [n]; ``intensity`` [n, S]."""
    n, S = segs.shape[:2]
    lin = (torch.arange(SIZE, dtype=torch.float32) + 0.5) / SIZE * 2 - 1
    py, px = (c.reshape(1, 1, SIZE * SIZE) for c in torch.meshgrid(lin, lin, indexing="ij"))
    ax, ay = segs[:, :, 0, 0:1], segs[:, :, 0, 1:2]  # [n, S, 1]
    bx, by = segs[:, :, 1, 0:1] - ax, segs[:, :, 1, 1:2] - ay
    t = (((px - ax) * bx + (py - ay) * by) / (bx * bx + by * by).clamp_min(1e-8)).clamp_(0, 1)
    dx = (t * bx).add_(ax).sub_(px)
    dy = (t * by).add_(ay).sub_(py)
    d2 = dx.mul_(dx).add_(dy.mul_(dy))  # [n, S, SIZE*SIZE]
    ink = d2.div_(-2 * width.view(n, 1, 1) ** 2).exp_().mul_(intensity.unsqueeze(-1))
    return ink.max(1).values.view(n, SIZE, SIZE)


def generate(n: int, seed: int, noise: float = 0.2, distractors: int = 2) -> Dict[str, torch.Tensor]:
    """``n`` samples: ``x`` float32 [n, 1, 16, 16], ``y`` int64 [n]."""
    g = torch.Generator().manual_seed(seed)
    tpl = _templates()
    y = torch.randint(0, CLASSES, (n,), generator=g)
    segs = tpl[y]  # [n, STROKES, 2, 2]

    def U(lo, hi, *shape):
        return torch.rand(*shape, generator=g) * (hi - lo) + lo

    ang, scale, shear = U(-math.pi / 6, math.pi / 6, n), U(0.7, 1.15, n), U(-0.25, 0.25, n)
    c, s = torch.cos(ang), torch.sin(ang)
    rot = torch.stack([torch.stack([c, -s], -1), torch.stack([s, c], -1)], -2)
    sh = torch.zeros(n, 2, 2)
    sh[:, 0, 0] = sh[:, 1, 1] = 1
    sh[:, 0, 1] = shear
    A = rot @ sh * scale.view(n, 1, 1)
    shift = U(-3 / SIZE * 2, 3 / SIZE * 2, n, 2) * 0.5
    segs = torch.einsum("nij,nsej->nsei", A, segs) + shift.view(n, 1, 1, 2)
    # distractors: random strokes of random other glyphs, anywhere
    if distractors:
        cls = torch.randint(0, CLASSES, (n, distractors), generator=g)
        which = torch.randint(0, STROKES, (n, distractors), generator=g)
        d = tpl[cls, which] * U(0.6, 1.0, n, distractors, 1, 1) + U(-0.5, 0.5, n, distractors, 1, 2)
        segs = torch.cat([segs, d], 1)
    intensity = torch.ones(n, segs.shape[1])
    if distractors:
        intensity[:, STROKES:] = U(0.4, 0.9, n, distractors)
    x = _render(segs, U(0.06, 0.12, n), intensity)
    x = x * U(0.6, 1.0, n, 1, 1) + noise * torch.randn(n, SIZE, SIZE, generator=g)
    return {"x": x.unsqueeze(1).float(), "y": y}


def load(n_train: int = 6000, n_test: int = 2000, seed: int = 0, **kw) -> Dict[str, torch.Tensor]:
    """Train and test sets (independent draws), standardised with the
    training set's mean and standard deviation."""
    tr, te = generate(n_train, seed * 2 + 1, **kw), generate(n_test, seed * 2 + 2, **kw)
    mean, std = tr["x"].mean(), tr["x"].std()
    return {"x_train": (tr["x"] - mean) / std, "y_train": tr["y"],
            "x_test": (te["x"] - mean) / std, "y_test": te["y"]}


def difficulty_report(seed: int = 0, **kw) -> Dict[str, float]:
    """Chance level and a multinomial logistic-regression baseline on the raw
    pixels (scikit-learn), the numbers that document how hard the task is."""
    from sklearn.linear_model import LogisticRegression

    d = load(seed=seed, **kw)
    clf = LogisticRegression(max_iter=2000)
    clf.fit(d["x_train"].flatten(1).numpy(), d["y_train"].numpy())
    acc = float(clf.score(d["x_test"].flatten(1).numpy(), d["y_test"].numpy()))
    return {"chance": 1.0 / CLASSES, "logistic_regression": acc}


def sample_figure(path: str, n: int = 30, seed: int = 5) -> str:
    """The ten clean class glyphs and ``n`` training-style samples."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = generate(n, seed)
    clean = _render(_templates(), torch.full((CLASSES,), 0.08), torch.ones(CLASSES, STROKES))
    rows = 1 + (n + CLASSES - 1) // CLASSES
    fig, ax = plt.subplots(rows, CLASSES, figsize=(CLASSES, rows * 1.1))
    for i in range(CLASSES):
        ax[0][i].imshow(clean[i], cmap="gray")
        ax[0][i].set_title(f"class {i}", fontsize=7)
    for i in range(n):
        a = ax[1 + i // CLASSES][i % CLASSES]
        a.imshow(d["x"][i, 0], cmap="gray")
        a.set_title(str(int(d["y"][i])), fontsize=7)
    for r in ax:
        for a in r:
            a.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=70)
    plt.close(fig)
    return path
