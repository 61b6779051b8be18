"""Attacks that judge defences: gradient inversion and attribute inference.

They read only what an honest-but-curious server holds: captured records from
`tff_privacy.updates` (broadcast model, upload, protocol facts).
"""

from tff_privacy.attacks.inversion import (ATTACKS, DLG, IDLG, GradientInversion,
                                           InvertingGradients, Reconstruction,
                                           Target, build)
from tff_privacy.attacks.labels import recover_labels
