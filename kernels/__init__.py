"""Verification and sampling ops (DESIGN.md §5): each op is one file with a plain-torch
``<op>_ref`` (the source of truth), a private Triton kernel and a launcher with the reference's
signature (reference on CPU, kernel on CUDA or under ``TRITON_INTERPRET=1``).

Imports only torch, triton and the standard library.
"""

from __future__ import annotations

from kernels.block_verify import (
    block_verify,
    block_verify_noise,
    block_verify_ref,
    block_verify_triton,
)
from kernels.constants import PLACEHOLDER_TOKEN_ID
from kernels.coupled_sample import (
    coupled_sample,
    coupled_sample_ref,
    coupled_sample_triton,
    gumbel_sample,
    gumbel_sample_ref,
    gumbel_sample_triton,
)
from kernels.greedy_verify import greedy_verify, greedy_verify_ref, greedy_verify_triton
from kernels.logits_processing import process_logits, process_logits_ref
from kernels.rejection_sample import (
    rejection_sample,
    rejection_sample_noise,
    rejection_sample_ref,
    rejection_sample_triton,
)
from kernels.tree_layout import tree_node_depths
from kernels.tree_rejection_sample import (
    tree_rejection_sample,
    tree_rejection_sample_noise,
    tree_rejection_sample_ref,
    tree_rejection_sample_triton,
)
from kernels.tree_walk import tree_walk, tree_walk_ref, tree_walk_triton

__all__ = ["PLACEHOLDER_TOKEN_ID", "block_verify", "block_verify_noise", "block_verify_ref",
           "block_verify_triton", "coupled_sample", "coupled_sample_ref", "coupled_sample_triton",
           "greedy_verify", "greedy_verify_ref", "greedy_verify_triton", "gumbel_sample",
           "gumbel_sample_ref", "gumbel_sample_triton", "process_logits", "process_logits_ref",
           "rejection_sample", "rejection_sample_noise", "rejection_sample_ref",
           "rejection_sample_triton", "tree_node_depths", "tree_rejection_sample",
           "tree_rejection_sample_noise", "tree_rejection_sample_ref",
           "tree_rejection_sample_triton", "tree_walk", "tree_walk_ref", "tree_walk_triton"]
