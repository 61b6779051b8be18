"""The update store: captured client uploads for the attack module."""

from tff_privacy.updates.capture import CaptureFactory
from tff_privacy.updates.store import (GroundTruthStore, UpdateRecord,
                                       UpdateStore, UpdateStoreError)
