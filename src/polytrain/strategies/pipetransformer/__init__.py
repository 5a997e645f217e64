"""PipeTransformer: pipelines that freeze their front layers, shorten and widen (ICML 2021)."""

from .options import PipeTransformerOptions
from .strategy import PipeTransformer

__all__ = ["PipeTransformer", "PipeTransformerOptions"]
