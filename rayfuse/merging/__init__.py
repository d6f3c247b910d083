"""``rayfuse fuse``: merges of checkpoints trained elsewhere, with no federation and no client data.

By role: :mod:`~rayfuse.merging.registry` (every merge: what it reads, needs and takes), :mod:`~rayfuse.merging.schema`
(the one fuse-file schema), :mod:`~rayfuse.merging.run` (routing, checks, merge, write), :mod:`~rayfuse.merging.output`
(what leaves: ties, finite values, :func:`load_fused`) and :mod:`~rayfuse.merging.fusers` (the merges over whole
checkpoints of a class). The tensor-by-tensor merges' maths lives in :mod:`rayfuse.finetunes`, aligned fusion's in
:mod:`rayfuse.alignment`.
"""

from rayfuse.merging.output import check_fused, load_fused, tied_names
from rayfuse.merging.registry import MERGES, MergeMethod, get_merge, merge_names, register_merge
from rayfuse.merging.run import FuseSpec, load_fuse_config, run_fuse

__all__ = [
    "MERGES",
    "MergeMethod",
    "FuseSpec",
    "check_fused",
    "get_merge",
    "load_fuse_config",
    "load_fused",
    "merge_names",
    "register_merge",
    "run_fuse",
    "tied_names",
]
