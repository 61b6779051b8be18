"""The update store: captured client uploads for the attack module."""

from tff_privacy.updates.capture import CaptureFactory, ClientPlacedCapture
from tff_privacy.updates.store import (GroundTruthStore, UpdateRecord,
                                       UpdateStore, UpdateStoreError)
