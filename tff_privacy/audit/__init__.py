"""Audits of privacy claims: empirical lower bounds on epsilon from canaries
(`one_run`; per upload, also of methods' own mechanisms: `uploads`; per
round of a central aggregator and over a training with canary clients:
`clients`) and estimates (`one_shot`), beside the epsilon
each mechanism claims; membership inference by tensorflow_privacy's attacks
(`membership`); all of them for a run (`report`, `tff-privacy audit`)."""

from tff_privacy.audit import (clients, membership, one_run, one_shot, report,
                               uploads)
