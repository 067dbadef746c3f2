"""The one guarded import of TensorFlow and Horovod-TensorFlow for this
package (docs/design.md §1): a missing or mis-built framework is an
``ImportError`` naming the install command."""
from __future__ import annotations

_INSTALL_HINT = ("Install TensorFlow 2.12-2.15 and Horovod built with TensorFlow support into this "
                 "environment with:  GTOPK_HOROVOD_TF=1 bash scripts/install_horovod.sh  "
                 "(installs tensorflow-cpu==2.15.1 and builds horovod==0.28.1 against it; "
                 "`make horovod` does this too)")
try:
    import tensorflow as tf
except ImportError as _e:  # pragma: no cover - exercised only without TensorFlow
    raise ImportError(f"gtopk_plugin.tensorflow needs TensorFlow (import failed: {_e}). {_INSTALL_HINT}") from _e
try:
    import horovod.tensorflow as hvd
    import horovod.tensorflow.keras as hvd_keras
    from horovod.tensorflow.compression import Compression as HvdCompression
    from horovod.tensorflow.compression import Compressor as HvdCompressor
except Exception as _e:  # pragma: no cover - a Horovod built without TF fails with various types
    raise ImportError(
        f"gtopk_plugin.tensorflow needs Horovod built with TensorFlow support (import failed: "
        f"{type(_e).__name__}: {_e}). {_INSTALL_HINT}") from _e

__all__ = ["tf", "hvd", "hvd_keras", "HvdCompression", "HvdCompressor"]
