"""Fusions: the graph rewrites that ``lower`` runs before it plans a program, one module each.

A rewrite is a function ``(graph, outputs, training) -> (graph, outputs, report)``: it returns a
graph that computes the same ``outputs`` (the values the program returns, first the loss) with
fewer launches or less memory, and a line saying what it changed (empty: nothing, and the graph
it was given). The rewritten graph is a copy made node by node (``Rebuild``); the caller's graph
stays as traced. ``lower(graph, mode, rewrites=DEFAULT_REWRITES)`` runs them in order,
``rewrites=()`` runs none, and ``Program.summary()`` lists what each one did.

Each module holds one rewrite and says what it changes; ``pipeline`` has what they share
(``Rebuild``, ``RewriteReport``, ``apply_rewrites``). Default order: ``DEFAULT_REWRITES`` below;
``fuse_mlp`` is asked for; ``precision=`` adds ``mixed_precision`` last, then
``fold_loss_upcast`` again (for the casts mixed precision made) and ``read_master_weights``.
"""

from .attention_layout import attention_in_place
from .chunked_loss import CHUNKED_LOGITS_MIN_BYTES, chunk_linear_cross_entropy
from .grouped_kv import read_grouped_kv
from .loss_upcast import fold_loss_upcast
from .master_weights import read_master_weights
from .mixed_precision import PRECISIONS, mixed_precision, precision_rewrites
from .mlp_chain import fuse_mlp
from .packed_qkv import read_packed_qkv
from .pipeline import Rebuild, RewriteFn, RewriteReport, apply_rewrites
from .qkv_products import fuse_qkv_products
from .residual_norm import fuse_residual_norm
from .transposed_weights import read_transposed_weights

DEFAULT_REWRITES: tuple[RewriteFn, ...] = (
    read_transposed_weights,
    fuse_residual_norm,
    chunk_linear_cross_entropy,
    read_grouped_kv,
    attention_in_place,
    read_packed_qkv,
    fuse_qkv_products,
    fold_loss_upcast,
)

__all__ = [
    "CHUNKED_LOGITS_MIN_BYTES",
    "DEFAULT_REWRITES",
    "PRECISIONS",
    "Rebuild",
    "RewriteFn",
    "RewriteReport",
    "apply_rewrites",
    "attention_in_place",
    "chunk_linear_cross_entropy",
    "fold_loss_upcast",
    "fuse_mlp",
    "fuse_qkv_products",
    "read_master_weights",
    "fuse_residual_norm",
    "mixed_precision",
    "precision_rewrites",
    "read_grouped_kv",
    "read_packed_qkv",
    "read_transposed_weights",
]
