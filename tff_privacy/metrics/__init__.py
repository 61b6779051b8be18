"""Utility and privacy metrics."""

from tff_privacy.metrics.image import (PSNR_CAP_DB, feature_mse, image_scores,
                                       match_by_mse, region_scores, summarize)
