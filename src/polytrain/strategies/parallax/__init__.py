"""Parallax: sparse parameters' rows on parameter servers, dense ones all-reduced."""

from .options import ParallaxOptions
from .plan import ParallaxPlan, RowRange, SparseVar, classify, parallax_traffic, plan_parallax
from .search import PartitionSearch, fit_cost
from .strategy import Parallax

__all__ = ["Parallax", "ParallaxOptions", "ParallaxPlan", "RowRange", "SparseVar", "classify",
           "plan_parallax", "parallax_traffic", "PartitionSearch", "fit_cost"]
