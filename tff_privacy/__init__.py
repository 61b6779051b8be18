"""tff_privacy: defences against gradient leakage in TensorFlow Federated, the
attacks that judge them, and experiments that measure utility and leakage."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tff_privacy import runtime  # noqa: E402  (owns TFF's worker process)

__version__ = "0.1.0"
