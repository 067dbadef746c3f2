"""Worker script of tests/horovod/test_horovod_registry.py, run under
``horovodrun -np N --gloo``: compressors from the registry that are not
selectors through the PyTorch Horovod ``DistributedOptimizer`` -- the
built-in ``onebit`` codec and a codec registered here, from user code --
plus the dense ``Compression.none`` handed to Horovod's own optimizer.

    horovodrun -np N -H localhost:N --gloo python tests/jobs/hvd_torch_registry_job.py OUTDIR

Every rank saves ``OUTDIR/rank{r}.pt``: per step its local gradients and
the reduced ones, then its residuals.
"""
import os
import sys
import traceback

import torch

import horovod.torch as hvd

torch.set_num_threads(1)
hvd.init()

from gtopk_plugin.frameworks.horovod.waiting import barrier  # noqa: E402
from gtopk_plugin.compress import Codec, register  # noqa: E402
from gtopk_plugin.horovod import Compression, DistributedOptimizer  # noqa: E402

R, P = hvd.rank(), hvd.size()
STEPS = 3


class HalfCodec(Codec):
    """User codec: the accumulator as float16 (allgathered, decoded, summed
    in rank order)."""

    def encode(self, acc, offsets, ctx):
        return [acc.to(torch.float16)]

    def decode(self, payload, offsets, numel, dtype):
        return payload[0].to(dtype)


register("half_user", HalfCodec)


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3))


def run(comp):
    model = make_model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters(),
                               compression=comp, op=hvd.Sum)
    raws, outs, traffic = [], [], []
    for s in range(STEPS):
        opt.zero_grad()
        g = torch.Generator().manual_seed(100 * s + R)
        x, y = torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        raws.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
        outs.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        traffic.append(dict(opt.last_step_traffic))
    sd = opt.state_dict().get("gtopk_plugin", {})
    return {"raw": raws, "out": outs, "residuals": sd.get("residuals", {}), "traffic": traffic,
            "type": f"{type(opt).__module__}", "repr": repr(comp)}


def main():
    res = {"rank": R, "size": P}
    for key, comp in (("onebit", Compression.onebit()), ("half_user", Compression.half_user()),
                      # steps 0, 1: the dense warm-up; step 2: onebit
                      ("onebit_warm", Compression.onebit(start_iter=2)),
                      ("none", Compression.none),
                      # the biases (10 and 3 entries) go dense, the weights gTop-k
                      ("gtopk_dense_below", Compression.gtopk(0.1, dense_below=12))):
        try:
            res[key] = ("ok", run(comp))
        except BaseException as e:  # noqa: BLE001 - recorded for the parent
            res[key] = ("error", (type(e).__name__, str(e), traceback.format_exc()))
    torch.save(res, os.path.join(sys.argv[1], f"rank{R}.pt"))
    barrier()  # Horovod's own barrier spins: see waiting.barrier
    hvd.shutdown()


if __name__ == "__main__":
    main()
