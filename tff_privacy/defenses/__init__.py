"""Classic defences against gradient leakage, as client-side update transforms."""

from tff_privacy.defenses.updates import (DEFENSES, ClipOnly, LocalGaussian,
                                          LocalLaplace, Sparsification,
                                          UpdateDefense, build, run_local_query)
