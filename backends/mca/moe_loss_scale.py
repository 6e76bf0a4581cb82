"""The MoE router z-loss at its coefficient whatever the tensor / context parallel size (per-token loss).

megatron-core 0.16's router divides ``moe_z_loss_coeff`` by the size of its ``tp_cp`` group (right for
Megatron's mean-of-micro-batch-means loss, where the router gradients of the TP ranks' token slices are
summed), then, with ``calculate_per_token_loss`` (roll's loss definition), weights the z-loss's gradient by
the tokens of this rank's slice, while ``finalize_model_grads`` divides every gradient by the global batch's
tokens counted once: the z-loss trained at 1 / (TP x CP) of its coefficient. Measured on the parity case
``tp2_mixtral_moe_losses`` (TP2 with sequence parallelism): z-loss alone (0.01) moved the exported weights
off the standard backend's, the load-balancing loss alone (0.1) matched within 1.4e-6 as it is, and did not
with its scale doubled (Megatron-LM #5047 doubles both; not carried here for that reason). This patch
gives back the factor the router divides by, in the per-token loss mode only. ``backends.mca.platform``
applies it (its table says when it can go).
"""

from __future__ import annotations


def patch_moe_z_loss_scale_per_token() -> None:
    from megatron.core.transformer.moe.router import TopKRouter

    original = TopKRouter.apply_z_loss

    def apply_z_loss(self, logits, padding_mask=None):
        config, size = self.config, self.tp_cp_group.size()
        coeff = config.moe_z_loss_coeff
        if coeff is None or not config.calculate_per_token_loss or size == 1:
            return original(self, logits, padding_mask=padding_mask)
        config.moe_z_loss_coeff = coeff * size  # the router divides it by the tp_cp size again
        try:
            return original(self, logits, padding_mask=padding_mask)
        finally:
            config.moe_z_loss_coeff = coeff

    TopKRouter.apply_z_loss = apply_z_loss
