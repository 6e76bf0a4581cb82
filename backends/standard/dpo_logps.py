"""TRL's DPO log-probabilities by roll.loss, the arithmetic the mca backend's DPO uses.

TRL 1.16's DPOTrainer patches the policy (and reference) model with a fused LM head
(``trl.trainer.utils.add_fused_lm_head``): ``model(..., labels=..., fused_lm_head=True)`` returns per-token
log-probs computed in tiles by its own kernel, whose log-sum-exp and sums differ in their rounding from the
mca backend's. ``use_roll_log_probs`` re-patches the same model so that call computes the logits with the
model's own forward and the log-probs with ``roll.loss.token_log_probs``, returned as float64 so that TRL's
per-sequence ``sum(dim=1)`` is the float64 sum the mca backend takes (``roll.loss.sequence_sums``). The
fields TRL logs from (entropy, mean logits, top-1, and for WPO weights ``log_sum_sq_probs``) are computed
from the same logits without gradient. Remove with TRL's fused head if TRL lets a trainer supply its own.

``record``, when given, receives each call's ``(log_probs, mask)``: DPO's ``pref_ftx`` term reads the policy's
(TRL's loss runs the policy before the reference, so it is the first of a step's calls).
"""

from __future__ import annotations

import functools
import types

import torch

from roll import loss as roll_loss


def use_roll_log_probs(model: torch.nn.Module, record: list | None = None) -> None:
    """Route ``fused_lm_head=True`` calls of ``model`` (already patched by TRL) through roll.loss (``record``:
    see the module docstring)."""
    from trl.trainer.utils import FusedCausalLMOutput

    trl_forward = model.forward

    @functools.wraps(type(model).forward)
    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None,
                **kwargs):
        if not fused_lm_head:
            return trl_forward(*args, labels=labels, shift_labels=shift_labels,
                               num_items_in_batch=num_items_in_batch, **kwargs)
        kwargs["use_cache"] = False
        outputs = trl_forward(*args, **kwargs)  # TRL's unfused path: the model's forward, no labels, no loss
        logits = outputs.logits
        if shift_labels is not None:
            labels, (log_probs, mask) = shift_labels, roll_loss.token_log_probs(logits, shift_labels)
        else:  # the labels shift, not the logits (a slice would be copied); the last logits predict nothing
            log_probs, mask = roll_loss.causal_log_probs(logits, labels)
            logits, labels = logits[:, :-1], labels[:, 1:]
        log_probs = log_probs.double()
        if record is not None:
            record.append((log_probs, mask))
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        loss = -log_probs.sum() / count
        aux_loss = getattr(outputs, "aux_loss", None)
        if aux_loss is not None:
            loss = loss + getattr(self.config.get_text_config(), "router_aux_loss_coef", 0.0) * aux_loss
        return FusedCausalLMOutput(loss=loss, log_probs=log_probs, label_mask=mask, aux_loss=aux_loss,
                                   **_logged_fields(logits, labels, mask))

    model.forward = types.MethodType(forward, model)


@torch.no_grad()
def _logged_fields(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """TRL's per-token metric fields, 0 where the label is ignored: entropy, mean logit, whether the label
    is the top-1 token, ``log(sum_v p_v^2)``."""
    log_p = torch.log_softmax(logits.float(), dim=-1)
    fields = {"entropy": -(log_p.exp() * log_p).sum(-1), "mean_logits": logits.float().mean(-1),
              "log_sum_sq_probs": torch.logsumexp(2 * log_p, dim=-1)}
    fields = {name: value.masked_fill(~mask, 0.0) for name, value in fields.items()}
    fields["is_top1"] = (logits.argmax(-1) == labels) & mask
    return fields
