"""FedRE's privacy sensitivity: PSI scores of model tensors for a region."""

from tff_privacy.psi.regions import box_mask, check_box, check_mask, parse_boxes
from tff_privacy.psi.scores import (PsiScores, layer_groups, mean_by_format,
                                    pixel_jvp_squares, pixel_norms_nested_tape,
                                    psi_scores, psi_scores_nested_tape,
                                    region_pixel_norms)

__all__ = ["PsiScores", "box_mask", "check_box", "check_mask", "parse_boxes",
           "layer_groups", "mean_by_format", "pixel_jvp_squares",
           "pixel_norms_nested_tape", "psi_scores", "psi_scores_nested_tape",
           "region_pixel_norms"]
