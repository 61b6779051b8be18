"""Audits of privacy claims: empirical lower bounds on epsilon from canaries
(`one_run`, `uploads`) and estimates (`one_shot`), beside the epsilon
each mechanism claims."""

from tff_privacy.audit import one_run, one_shot, uploads
