"""pref_loss orpo and simpo (roll.preference): each loss equals an independent computation of its definition on
one batch (TRL 1.16's own trl.experimental ORPO / CPO loss functions on the same mean log-probs where the
definition is TRL's, LLaMA-Factory's NLL term by hand where it is not); log1mexp against 50-digit decimals;
the standard backend trains them with no reference model, step 1 at the hand formula from HF's model; the
rules of their keys."""

from __future__ import annotations

import decimal
import logging
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from roll import preference
from roll.config.finetuning import FinetuningArguments
from roll.errors import ConfigError

pytestmark = pytest.mark.filterwarnings("ignore:You are importing from 'trl.experimental'")

TRL_FLOAT32 = 1e-6
"""Relative gap allowed to TRL's ORPO, which casts the log-probs to float32 before its odds term (roll keeps the
float64 of the sums): measured 7e-8 absolute on losses of 1 to 10. A definition error (another NLL, gamma
divided by beta) moves the loss by 1e-2 and more on this batch."""

# Three pairs: log-prob sums and response tokens of different lengths (the per-pair NLL mean and the batch's
# token mean differ only then).
CHOSEN = torch.tensor([-6.0, -25.2, -1.1], dtype=torch.float64)
CHOSEN_TOKENS = torch.tensor([3, 12, 1])
REJECTED = torch.tensor([-9.5, -11.0, -30.0], dtype=torch.float64)
REJECTED_TOKENS = torch.tensor([2, 7, 10])
A_C, A_R = CHOSEN / CHOSEN_TOKENS, REJECTED / REJECTED_TOKENS  # each response's mean token log-prob, by hand


def _trl_self(**fields) -> SimpleNamespace:
    """What TRL's loss methods read from their trainer."""
    return SimpleNamespace(accelerator=SimpleNamespace(device="cpu"), **fields)


def test_orpo_is_llamafactorys_nll_plus_trls_odds_ratio_term():
    """The odds-ratio term and its metrics are TRL's ORPOTrainer.odds_ratio_loss on the same means; the NLL term
    is LLaMA-Factory's (each chosen response's mean token NLL), not TRL's (one token mean over the batch)."""
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    beta = 0.25
    losses, metrics = preference.reference_free_losses(CHOSEN, REJECTED, CHOSEN_TOKENS, REJECTED_TOKENS,
                                                       loss_type="orpo", beta=beta)
    trl_terms, chosen_rewards, rejected_rewards, ratio, log_odds = ORPOTrainer.odds_ratio_loss(
        _trl_self(beta=beta), A_C, A_R)  # TRL's terms are beta * log sigmoid(log_odds): the loss subtracts them
    assert losses.tolist() == pytest.approx((-A_C - trl_terms.double()).tolist(), rel=TRL_FLOAT32)
    assert metrics["rewards/chosen"].tolist() == pytest.approx(chosen_rewards.tolist(), rel=TRL_FLOAT32)
    assert metrics["rewards/rejected"].tolist() == pytest.approx(rejected_rewards.tolist(), rel=TRL_FLOAT32)
    assert metrics["log_odds_ratio"].mean().item() == pytest.approx(ratio.item(), rel=TRL_FLOAT32)
    assert metrics["log_odds_chosen"].mean().item() == pytest.approx(log_odds.item(), rel=TRL_FLOAT32)
    assert metrics["nll_loss"].tolist() == pytest.approx((-A_C).tolist(), rel=1e-12)
    assert metrics["logps/chosen"].tolist() == pytest.approx(A_C.tolist(), rel=1e-12)
    assert metrics["rewards/accuracies"].tolist() == [1.0, 0.0, 1.0]
    # TRL's NLL (a token mean over the batch) is another loss on this batch, by 0.4
    token_mean = -CHOSEN.sum() / CHOSEN_TOKENS.sum()
    assert abs(losses.mean() - (token_mean - trl_terms.double().mean())) > 0.1


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_simpo_is_trls_cpo_simpo_without_its_nll_term(label_smoothing):
    """TRL's CPOTrainer.cpo_loss with loss_type simpo (AlphaPO off; its cpo_alpha NLL term is added outside it),
    with and without label smoothing; gamma is an absolute margin whatever beta."""
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    beta, gamma = 2.0, 0.7
    losses, metrics = preference.reference_free_losses(
        CHOSEN, REJECTED, CHOSEN_TOKENS, REJECTED_TOKENS, loss_type="simpo", beta=beta, gamma=gamma,
        label_smoothing=label_smoothing)
    trl_losses, chosen_rewards, rejected_rewards = CPOTrainer.cpo_loss(
        _trl_self(beta=beta, alpha=0.0, loss_type="simpo", simpo_gamma=gamma, label_smoothing=label_smoothing),
        A_C, A_R)
    assert losses.tolist() == pytest.approx(trl_losses.tolist(), rel=1e-12)
    assert metrics["rewards/margins"].tolist() == pytest.approx((chosen_rewards - rejected_rewards).tolist())
    assert set(metrics) == set(preference.METRICS["simpo"])
    for beta in (2.0, 10.0):  # equal means: the loss is -log sigmoid(-gamma), beta or not
        equal, _ = preference.reference_free_losses(CHOSEN, CHOSEN, CHOSEN_TOKENS, CHOSEN_TOKENS,
                                                    loss_type="simpo", beta=beta, gamma=gamma)
        assert equal.tolist() == pytest.approx([math.log1p(math.exp(gamma))] * 3, rel=1e-12)


@pytest.mark.parametrize("loss_type", ["orpo", "simpo"])
def test_pref_ftx_adds_each_chosen_responses_mean_nll(loss_type):
    plain, _ = preference.reference_free_losses(CHOSEN, REJECTED, CHOSEN_TOKENS, REJECTED_TOKENS,
                                                loss_type=loss_type, beta=0.5, gamma=0.5)
    with_ftx, _ = preference.reference_free_losses(CHOSEN, REJECTED, CHOSEN_TOKENS, REJECTED_TOKENS,
                                                   loss_type=loss_type, beta=0.5, gamma=0.5, ftx=0.3)
    assert (with_ftx - plain).tolist() == pytest.approx((0.3 * -A_C).tolist(), rel=1e-12)


def _log1mexp_decimal(x: float) -> float:
    """log(1 - e^x) with 50 significant digits."""
    with decimal.localcontext() as context:
        context.prec = 50
        return float((1 - decimal.Decimal(x).exp()).ln())


def test_log1mexp_is_accurate_and_finite_where_log1p_of_minus_exp_is_not():
    points = [-1e-20, -1e-9, -1e-3, -0.3, -0.69, -0.7, -2.0, -40.0]
    x = torch.tensor(points, dtype=torch.float64)
    assert preference.log1mexp(x).tolist() == pytest.approx([_log1mexp_decimal(p) for p in points], rel=1e-14)
    assert torch.log1p(-torch.exp(x[:1])).item() == -math.inf  # LLaMA-Factory's form at a mean log-prob near 0
    # A mean of exactly 0 (a pair without response tokens: the mca backend's filler pairs): finite loss and grads
    logps = torch.tensor([0.0, -4.0], dtype=torch.float64, requires_grad=True)
    losses, _ = preference.reference_free_losses(logps[:1], logps[1:], torch.tensor([0]), torch.tensor([2]),
                                                 loss_type="orpo", beta=0.1)
    losses.sum().backward()
    assert torch.isfinite(losses).all() and torch.isfinite(logps.grad).all(), (losses, logps.grad)


def test_the_keys_of_the_reference_free_losses(caplog):
    """simpo_gamma belongs to simpo (default 0.5); orpo and simpo refuse a ref_model and build no reference;
    label smoothing only where the loss has a smoothed form (sigmoid, simpo)."""
    assert FinetuningArguments(stage="dpo", pref_loss="simpo").simpo_gamma == 0.5
    assert FinetuningArguments(stage="dpo", pref_loss="simpo", simpo_gamma=0.0).simpo_gamma == 0.0
    assert FinetuningArguments(stage="dpo", pref_loss="orpo").reference_free
    assert not FinetuningArguments(stage="dpo", pref_loss="ipo").reference_free
    assert FinetuningArguments(stage="dpo", pref_loss="simpo", pref_label_smoothing=0.1).pref_label_smoothing == 0.1
    refused = [dict(pref_loss="sigmoid", simpo_gamma=0.5), dict(pref_loss="simpo", simpo_gamma=-1.0),
               dict(pref_loss="orpo", ref_model="some/model"), dict(pref_loss="simpo", ref_model="some/model"),
               dict(pref_loss="orpo", pref_label_smoothing=0.1), dict(pref_loss="ipo", pref_label_smoothing=0.1)]
    for keys in refused:
        with pytest.raises(ConfigError) as error:
            FinetuningArguments(stage="dpo", **keys)
        assert any(key in str(error.value) for key in keys if key != "pref_loss"), error.value
    with caplog.at_level(logging.WARNING):
        FinetuningArguments(stage="dpo", pref_loss="orpo", ref_free=True)
    assert "ref_free=true has no effect with pref_loss orpo" in caplog.text


def _hand_losses(model_dir: str, rows: list[dict], loss_type: str, beta: float, gamma: float, ftx: float
                 ) -> tuple[float, float]:
    """(the loss, rewards/chosen) of ``rows`` by hand from HF's model: mean token log-probs of each response
    (log_softmax in float64), the definition written out with math."""
    from transformers import AutoModelForCausalLM

    from tests.unit.test_standard_train import _answer_logp

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    losses, rewards = [], []
    with torch.no_grad():
        for row in rows:
            means = [_answer_logp(model, row[f"{side}_input_ids"], row[f"{side}_labels"])
                     / sum(label != -100 for label in row[f"{side}_labels"][1:]) for side in ("chosen", "rejected")]
            if loss_type == "orpo":
                log_odds = (means[0] - means[1]) - (math.log(-math.expm1(means[0])) - math.log(-math.expm1(means[1])))
                loss = -means[0] - beta * F.logsigmoid(torch.tensor(log_odds, dtype=torch.float64)).item()
            else:
                loss = -F.logsigmoid(torch.tensor(beta * (means[0] - means[1]) - gamma, dtype=torch.float64)).item()
            losses.append(loss + ftx * -means[0])
            rewards.append(beta * means[0])
    return sum(losses) / len(losses), sum(rewards) / len(rewards)


@pytest.mark.parametrize("loss_type,keys", [("orpo", {}), ("simpo", {"simpo_gamma": 0.3, "pref_ftx": 0.5})])
def test_standard_backend_trains_them_without_a_reference(tiny_model_dir, tmp_path, loss_type, keys):
    """No reference model loaded (by roll or by TRL); step 1's loss and rewards/chosen equal the hand formula
    on the first batch's 4 pairs (chosen responses of 1 to 3 sentences: a batch-token-mean NLL misses it)."""
    from tests.unit.test_standard_train import _dpo_rows, _tokenizer, train_in_process

    beta = 2.0 if loss_type == "simpo" else 0.1
    backend, result, models, _ = train_in_process(tiny_model_dir, tmp_path, stage="dpo", max_steps=1,
                                                  pref_loss=loss_type, pref_beta=beta, **keys)
    assert models.ref is None and backend._trainer.ref_model is None
    loss, chosen_reward = _hand_losses(tiny_model_dir, _dpo_rows(_tokenizer(tiny_model_dir), 4), loss_type, beta,
                                       keys.get("simpo_gamma", 0.5), keys.get("pref_ftx", 0.0))
    record = result.log_history[0]
    assert record["loss"] == pytest.approx(loss, rel=1e-5)
    assert record["rewards/chosen"] == pytest.approx(chosen_reward, rel=1e-5)
    assert set(preference.METRICS[loss_type]) <= set(record), record


@pytest.mark.parametrize("loss_type,loads", [("orpo", 1), ("simpo", 1), ("sigmoid", 2)])
def test_mca_backend_loads_no_reference_for_them(tiny_model_dir, tmp_path, monkeypatch, loss_type, loads):
    """McaBackend.load_models converts the policy only (sigmoid: the policy and its reference)."""
    pytest.importorskip("megatron.core")
    from backends.mca.backend import McaBackend
    from backends.mca.models import auto
    from roll.config.parser import resolve

    loaded = []
    monkeypatch.setattr(auto.AutoModel, "from_pretrained", lambda path, *args, **kwargs: loaded.append(path) or [])
    config = resolve({"model_name_or_path": tiny_model_dir, "stage": "dpo", "pref_loss": loss_type,
                      "use_mca": True, "output_dir": str(tmp_path)}, {}, None)
    models = McaBackend(config).load_models("dpo", None)
    assert len(loaded) == loads and (models.ref is None) == (loads == 1), loaded
