"""Aligned fusion math: put N models into one frame by permutations (weight or activation matching), merge them
(average, Fisher-weighted, RegMean, nonparametric width) and repair their BatchNorm statistics. numpy / torch / scipy only: no Ray, no
engine; assignment solves go through an executor (:mod:`rayfuse.matching`)."""

from rayfuse.alignment.activation import (
    GroupStats,
    activation_matching,
    collect_correlations,
    solve_activation_perms,
    solve_activation_perms_many,
)
from rayfuse.alignment.merge import (
    diagonal_fisher,
    input_grams,
    masked_grams,
    merge_average,
    merge_fisher,
    merge_regmean,
    permute_fisher,
    permute_grams,
)
from rayfuse.alignment.nonparametric import (
    WidthPlan,
    WidthRoles,
    fuse_nonparametric,
    merge_nonparametric,
    plan_widths,
    unit_agreement,
    width_roles,
)
from rayfuse.alignment.repair import (
    RepairUnit,
    apply_batchnorm,
    apply_repair,
    batchnorm_statistics,
    combine_batchnorm,
    repair_targets,
    repair_units,
    unit_statistics,
)
from rayfuse.alignment.weight import Alignment, apply_alignment, match_weights, resolve_cost_keys, weight_matching

__all__ = [
    "Alignment",
    "GroupStats",
    "activation_matching",
    "apply_alignment",
    "apply_batchnorm",
    "batchnorm_statistics",
    "collect_correlations",
    "combine_batchnorm",
    "solve_activation_perms_many",
    "diagonal_fisher",
    "input_grams",
    "masked_grams",
    "match_weights",
    "merge_average",
    "merge_fisher",
    "merge_regmean",
    "permute_fisher",
    "permute_grams",
    "resolve_cost_keys",
    "solve_activation_perms",
    "weight_matching",
    "WidthPlan",
    "WidthRoles",
    "fuse_nonparametric",
    "merge_nonparametric",
    "plan_widths",
    "unit_agreement",
    "width_roles",
    "RepairUnit",
    "apply_repair",
    "repair_targets",
    "repair_units",
    "unit_statistics",
]
