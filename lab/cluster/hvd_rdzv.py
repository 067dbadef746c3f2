"""Horovod's gloo rendezvous for workers started by hand (what horovodrun's
driver does before it launches ranks over ssh):

    python -m lab.cluster.hvd_rdzv ADDR PORT P

serves Horovod's HTTP rendezvous on ADDR:PORT (run it inside worker 0's
namespace, so it is reachable from every worker and from nothing else),
with one slot per host (host "w<r>", local size 1, cross size P), prints
"READY" and serves until stdin closes or it is killed.  Each worker then
gets the environment of :func:`worker_env`.
"""
import sys


def worker_env(rank: int, P: int, addr: str, port: int, iface: str) -> dict:
    """Horovod's gloo environment for one rank (as horovodrun --gloo sets it)."""
    return {
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": addr,
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_IFACE": iface,
        "HOROVOD_HOSTNAME": f"w{rank}",
        "HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(P),
        "HOROVOD_LOCAL_RANK": "0", "HOROVOD_LOCAL_SIZE": "1",
        "HOROVOD_CROSS_RANK": str(rank), "HOROVOD_CROSS_SIZE": str(P),
    }


def main(argv):
    addr, port, P = argv[0], int(argv[1]), int(argv[2])
    from horovod.runner.common.util.hosts import SlotInfo
    from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer
    from horovod.runner.util.threads import in_thread

    httpd = RendezvousHTTPServer((addr, port), RendezvousHandler, 0)
    httpd.init([SlotInfo(hostname=f"w{r}", rank=r, local_rank=0, cross_rank=r, size=P,
                         local_size=1, cross_size=P) for r in range(P)])
    in_thread(target=httpd.serve_forever)
    print("READY", flush=True)
    sys.stdin.read()  # until the parent closes our stdin (or kills us)
    httpd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
