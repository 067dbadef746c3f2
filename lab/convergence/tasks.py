"""The three offline tasks of the convergence study.

A :class:`Task` holds its data (tensors), builds its model, cuts a global
batch into the P workers' shards, computes a worker's loss, and evaluates the
model.  The simulated workers (:mod:`.sim`) and the real gloo workers
(:mod:`.gloo`) call the same functions, so both compute bit-identical
gradients from the same weights.

- ``digits``: scikit-learn's bundled 8x8 handwritten digits and the demo's
  CNN (``gtopk_plugin.demo.load_data`` / ``build_model``, ~39k parameters).
- ``glyphs``: a harder procedurally generated 16x16 image task
  (:mod:`.glyphs`) and a 41k-parameter CNN.
- ``glyphs_resnet``: the glyphs data with :class:`GlyphResNet`, a small
  ResNet (three basic blocks with BatchNorm, ~50k parameters).
- ``charlm``: a character-level LSTM language model on the Python
  documentation text that ships with every CPython installation
  (``pydoc_data.topics``), reporting validation perplexity.
"""
from __future__ import annotations

import hashlib
import math
import sys
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

Tensor = torch.Tensor


@dataclass
class Task:
    name: str
    metric: str  # "accuracy" (higher is better) or "perplexity" (lower is better)
    data: Dict[str, Tensor]
    build_model: Callable[[], nn.Module]
    n_train: int
    # hyper-parameters of the study (chosen for dense S-SGD, used for every method)
    steps: int
    batch_size: int
    lr: float
    eval_every: int
    info: Dict[str, object] = field(default_factory=dict)
    _perm: Optional[tuple] = field(default=None, repr=False)

    @property
    def higher_is_better(self) -> bool:
        return self.metric == "accuracy"

    # -- batches and shards: the same on every (simulated or real) worker --
    def batch_indices(self, seed: int, step: int, batch_size: Optional[int] = None) -> Tensor:
        """Global batch of ``step``: a slice of a per-epoch permutation seeded
        by (seed, epoch), the last partial batch of an epoch dropped (the
        batches of ``gtopk-demo``)."""
        b = batch_size or self.batch_size
        per_epoch = self.n_train // b
        epoch, i = divmod(step, per_epoch)
        if self._perm is None or self._perm[0] != (seed, epoch):
            g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
            self._perm = ((seed, epoch), torch.randperm(self.n_train, generator=g))
        return self._perm[1][i * b:(i + 1) * b]

    def shard(self, batch: Tensor, rank: int, world: int) -> Tensor:
        return torch.tensor_split(batch, world)[rank]

    def loss(self, model: nn.Module, idx: Tensor) -> Tensor:
        if self.metric == "perplexity":
            x, y = _lm_windows(self.data["train"], idx, self.info["seq_len"])
            logits = model(x)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        return F.cross_entropy(model(self.data["x_train"][idx]), self.data["y_train"][idx])

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> Dict[str, float]:
        """Test accuracy and loss, or validation perplexity and loss."""
        was = model.training
        model.eval()
        try:
            if self.metric == "perplexity":
                x, y = self.data["val_x"], self.data["val_y"]
                logits = model(x)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item()
                return {"perplexity": math.exp(loss), "loss": loss}
            logits = model(self.data["x_test"])
            y = self.data["y_test"]
            return {"accuracy": (logits.argmax(1) == y).float().mean().item(),
                    "loss": F.cross_entropy(logits, y).item()}
        finally:
            model.train(was)

    def n_params(self) -> int:
        return sum(p.numel() for p in self.build_model().parameters())


# ------------------------------------------------------------------ digits
def digits() -> Task:
    from gtopk_plugin.demo import build_model, load_data

    d = load_data()
    data = {k: torch.from_numpy(v) for k, v in d.items()}
    return Task("digits", "accuracy", data, build_model, n_train=len(data["y_train"]),
                steps=150, batch_size=64, lr=0.3, eval_every=10,
                info={"source": "sklearn.datasets.load_digits (1797 8x8 images, 1437 train / 360 test)",
                      "model": "gtopk_plugin.demo.build_model (CNN)"})


# ------------------------------------------------------------------ glyphs
class GlyphCNN(nn.Sequential):
    """Two conv blocks and two linear layers for 16x16 inputs (38k parameters)."""

    def __init__(self):
        super().__init__(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),   # 16 x 8 x 8
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 32 x 4 x 4
            nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))


def glyphs_task() -> Task:
    from lab.convergence import glyphs

    data = glyphs.load()
    return Task("glyphs", "accuracy", data, GlyphCNN, n_train=len(data["y_train"]),
                steps=250, batch_size=64, lr=0.3, eval_every=25,
                info={"source": "lab.convergence.glyphs (procedural, 6000 train / 2000 test)",
                      "model": "GlyphCNN"})


class BasicBlock(nn.Module):
    """He et al. 2016's basic block: conv3x3-BN-ReLU-conv3x3-BN plus the
    identity (or a strided 1x1 conv + BN when the shape changes), ReLU."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = None
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: Tensor) -> Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.short is None else self.short(x)))


class GlyphResNet(nn.Module):
    """A ResNet-style model for 16x16 glyphs: conv stem (BN), three basic
    blocks of widths ``widths`` (the last two strided: 16 → 8 → 4 pixels),
    global average pooling, linear read-out.  BatchNorm everywhere, so its
    running statistics matter at evaluation (see sim.Rank0Buffers)."""

    def __init__(self, widths=(12, 24, 48), classes: int = 10):
        super().__init__()
        a, b, c = widths
        self.stem = nn.Sequential(nn.Conv2d(1, a, 3, padding=1, bias=False), nn.BatchNorm2d(a), nn.ReLU())
        self.blocks = nn.Sequential(BasicBlock(a, a), BasicBlock(a, b, 2), BasicBlock(b, c, 2))
        self.head = nn.Linear(c, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))


def glyphs_resnet_task() -> Task:
    from lab.convergence import glyphs

    data = glyphs.load()
    return Task("glyphs_resnet", "accuracy", data, GlyphResNet, n_train=len(data["y_train"]),
                steps=250, batch_size=64, lr=0.3, eval_every=25,
                info={"source": "lab.convergence.glyphs (procedural, 6000 train / 2000 test)",
                      "model": "GlyphResNet (BatchNorm; rank 0's running statistics)"})


# ------------------------------------------------------------------ charlm
VOCAB = ["\n"] + [chr(c) for c in range(32, 127)] + ["\x00"]  # \x00: any other character
_CHAR_ID = {c: i for i, c in enumerate(VOCAB)}


def corpus_text() -> Tuple[str, str]:
    """The Python documentation topics shipped with CPython
    (``pydoc_data/topics.py``), joined in key order; the source named."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # pragma: no cover - stripped installations
        import inspect
        import argparse
        import collections
        text = "".join(inspect.getsource(m) for m in (argparse, collections))
        return text, "stdlib source (argparse, collections): pydoc_data missing"
    return "\n\n".join(topics[k] for k in sorted(topics)), "pydoc_data.topics (Python documentation)"


def encode(text: str) -> Tensor:
    unk = _CHAR_ID["\x00"]
    return torch.tensor([_CHAR_ID.get(c, unk) for c in text.replace("\t", "    ")], dtype=torch.int64)


def _lm_windows(stream: Tensor, idx: Tensor, seq_len: int) -> Tuple[Tensor, Tensor]:
    """Training windows: sample ``i`` is ``stream[i*seq_len : i*seq_len+seq_len+1]``."""
    starts = idx * seq_len
    w = torch.stack([stream[s:s + seq_len + 1] for s in starts.tolist()])
    return w[:, :-1], w[:, 1:]


class CharLSTM(nn.Module):
    """Embedding 32, one LSTM layer of 96 units, linear read-out (62k parameters)."""

    def __init__(self, vocab: int = len(VOCAB), emb: int = 32, hidden: int = 96):
        super().__init__()
        self.emb = nn.Embedding(vocab, emb)
        self.lstm = nn.LSTM(emb, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x: Tensor) -> Tensor:
        h, _ = self.lstm(self.emb(x))
        return self.head(h)


def charlm(seq_len: int = 32, val_chars: int = 32 * 1024) -> Task:
    text, source = corpus_text()
    ids = encode(text)
    train, val = ids[:-val_chars], ids[-val_chars:]
    n_train = (len(train) - 1) // seq_len
    nv = (len(val) - 1) // 256
    vw = torch.stack([val[i * 256:i * 256 + 257] for i in range(nv)])
    data = {"train": train, "val_x": vw[:, :-1], "val_y": vw[:, 1:]}
    return Task("charlm", "perplexity", data, CharLSTM, n_train=n_train,
                steps=200, batch_size=64, lr=3.0, eval_every=20,
                info={"source": source, "model": "CharLSTM", "seq_len": seq_len,
                      "train_chars": len(train), "val_chars": len(val),
                      "python": sys.version.split()[0],
                      "corpus_sha256": hashlib.sha256(text.encode()).hexdigest()[:16]})


TASKS = {"digits": digits, "glyphs": glyphs_task, "glyphs_resnet": glyphs_resnet_task, "charlm": charlm}


def get(name: str) -> Task:
    try:
        return TASKS[name]()
    except KeyError:
        raise ValueError(f"unknown task {name!r}; choose from {', '.join(TASKS)}") from None
