"""Server-side aggregations that need more than the uploads."""

from tff_privacy.aggregation.pda_pam import (SCORE_SCALES, UPDATE_RULES,
                                             PublicRegions,
                                             build_pda_pam,
                                             compose_with_server_aggregation)

__all__ = ["SCORE_SCALES", "UPDATE_RULES", "PublicRegions", "build_pda_pam",
           "compose_with_server_aggregation"]
