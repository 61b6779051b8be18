"""tff_privacy: defences against gradient leakage in TensorFlow Federated, the
attacks that judge them, and experiments that measure utility and leakage.

Importing the package changes no global state. Programs that run TFF
computations start the runtime first: `tff_privacy.runtime.start()` (or
`install()`, which starts TFF's worker on first use); see `runtime`.
"""

__version__ = "0.1.0"
