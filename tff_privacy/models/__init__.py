"""Models: Keras builders by name and their TFF wrappers."""

from tff_privacy.models.builders import MODELS, WEIGHT_INITS, build
from tff_privacy.models.tff_model import ModelSpec, loss_fn
