"""The pieces of a run that `tff_privacy.runner`'s round loop puts
together: its configuration, its clients' data, evaluation, checkpoints
and outputs."""
