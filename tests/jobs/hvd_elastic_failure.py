"""The elastic run with one simulated peer loss that the elastic worker
scripts (hvd_torch_elastic_job.py, hvd_tf_elastic_job.py) share.

``run_with_one_failure`` runs batches 0..9 under ``hvd.elastic.run``, one
``step(b)`` each.  It commits after batch 4 and, the first time batch 6 is
done, raises ``HorovodInternalError`` on every worker (what Horovod raises
when a peer is lost), so ``hvd.elastic.run`` restores the commit (batch 4),
re-initialises Horovod, syncs the state and carries on to batch 10.
"""
from horovod.common.exceptions import HorovodInternalError

BATCHES, COMMIT_AT, FAIL_AT = 10, 4, 6


def run_with_one_failure(hvd, state, step, snapshot):
    """Train ``state`` (its ``batch`` counter starts at 0) with ``step(b)``
    under ``hvd.elastic.run`` (``hvd``: horovod.torch or horovod.tensorflow)
    and fail once.  Returns the log: ``snapshot()`` at the commit
    (``committed``), just before the failure (``before_failure``) and right
    after the sync that follows the restore (``after_restore``), plus
    ``events``, one ``("reset", hvd.size())`` per reset."""
    log = {"events": []}
    failed = []

    @hvd.elastic.run
    def train(state):
        while state.batch < BATCHES:
            b = state.batch
            step(b)
            state.batch = b + 1
            if state.batch == COMMIT_AT:
                state.commit()
                log["committed"] = snapshot()
            if state.batch == FAIL_AT and not failed:
                failed.append(True)
                log["before_failure"] = snapshot()
                raise HorovodInternalError("simulated loss of a peer")

    state.register_reset_callbacks([lambda: log["events"].append(("reset", hvd.size()))])
    orig_sync = state.sync

    # The restored values are only observable once the sync after the reset
    # has run, so the snapshot is taken from inside the state's own sync.
    def sync_and_record():
        orig_sync()
        if failed and "after_restore" not in log:
            log["after_restore"] = snapshot()

    state.sync = sync_and_record
    train(state)
    return log
