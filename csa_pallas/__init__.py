"""csa_pallas: Pallas TPU kernels for the DeepSeek-V4 CSA lightning-indexer distillation loss.

Public API (SPEC.md is the math contract):
  indexer_distill_loss(indexer_logits, q, compressed_kv, ...)  -> loss (custom_vjp; gradient only to the logits)
  teacher_distribution(q, compressed_kv, ...)                   -> P, f32 [B, S, N] or [B, S, K]
  noncompressed_lse(q, window_kv, ...)                          -> u, f32 [B, S, H]
  fused_indexer_distill_loss(index_q, index_k, index_weights, q, compressed_kv, ...)
                                                                -> the loss with the student given by the indexer's
                                                                   inputs (SPEC §8; gradients to all three)
  indexer_scores(index_q, index_k, index_weights, ...)          -> I, f32 [B, S, N] or [B, S, K], -inf outside V(t)
  sharded_indexer_distill_loss(mesh, indexer_logits, q, ..., batch_axes=, head_axis=, seq_axis=)
  sharded_teacher_distribution(mesh, q, compressed_kv, ...)     -> the same under shard_map (csa_pallas.sharding)
  sharded_fused_indexer_distill_loss(mesh, index_q, index_k, index_weights, q, compressed_kv, ...)
                                                                -> the fused op under shard_map
                                                                   (csa_pallas.sharded_student)
  check_window_layout(segment_ids, positions)                   -> opt-in checkify check of the window kernel's layout
  activation_sharding(batch=, heads=, seq=)                     -> context: how activations are sharded on an Auto
                                                                   mesh (csa_pallas.placement)
  RESIDUAL_NAME                                                 -> the checkpoint name of what the kernels' forward
                                                                   passes keep for the backward (remat policies)

The plain ops run sharded by themselves when their inputs live on a multi-device mesh (`csa_pallas.placement`).
"""

from csa_pallas.api import (check_window_layout, fused_indexer_distill_loss, indexer_distill_loss, indexer_scores,
                            noncompressed_lse, teacher_distribution)
from csa_pallas.loss_vjp import RESIDUAL_NAME
from csa_pallas.placement import activation_sharding
from csa_pallas.sharded_student import sharded_fused_indexer_distill_loss
from csa_pallas.sharding import sharded_indexer_distill_loss, sharded_teacher_distribution

__all__ = ["indexer_distill_loss", "teacher_distribution", "noncompressed_lse", "fused_indexer_distill_loss",
           "indexer_scores", "sharded_indexer_distill_loss", "sharded_fused_indexer_distill_loss",
           "sharded_teacher_distribution", "check_window_layout", "activation_sharding", "RESIDUAL_NAME"]
__version__ = "0.1.0"
