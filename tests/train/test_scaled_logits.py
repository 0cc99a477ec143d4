"""Heads that train on a base whose forward scales its logits after the lm_head (Granite divides
them, Cohere multiplies them, Gemma-2 soft-caps them): their logits are scaled as the soft labels
are."""

import pytest
import torch

from tests.train.dense_losses import medusa_loss
from train.losses import shift_left


def _scaled_base(kind: str):
    """A tiny base whose forward transforms its lm_head's logits, and that transform written out
    here (not read from headstart's code): Granite divides, Cohere multiplies, Gemma-2 soft-caps."""
    import transformers

    from tests.conftest import TINY

    config, model, scale = {
        "granite": ("GraniteConfig", "GraniteForCausalLM", lambda x: x / 8.0),
        "cohere": ("CohereConfig", "CohereForCausalLM", lambda x: x * 0.0625),
        "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", lambda x: torch.tanh(x / 2.0) * 2.0),
    }[kind]
    extra = {
        "granite": {"logits_scaling": 8.0},
        "cohere": {"logit_scale": 0.0625},
        "gemma2": {"final_logit_softcapping": 2.0, "head_dim": 16},
    }[kind]
    torch.manual_seed(0)
    config = getattr(transformers, config)(**TINY, **extra)
    config._attn_implementation = "eager" if kind == "gemma2" else "sdpa"
    base = getattr(transformers, model)(config).eval().requires_grad_(False)
    with torch.no_grad():  # peaky logits, as a trained base's, so a wrong scale costs much
        base.get_output_embeddings().weight.mul_(40)
    return base, scale


@pytest.mark.parametrize("kind", ["granite", "cohere", "gemma2"])
def test_medusa_heads_train_on_logits_scaled_as_the_bases(kind):
    """The soft labels are the base's scaled distribution: the heads' logits are scaled the same
    way, so that a fresh head is the base's distribution and a shared, frozen lm_head can match."""
    from heads import MedusaConfig, MedusaHeads
    from train.config import load_recipe
    from train.medusa import MedusaTrainee

    base, scale = _scaled_base(kind)
    heads = MedusaHeads(MedusaConfig.from_base(base.config, num_heads=2)).init_from_base(base)
    for block in heads.blocks:
        torch.nn.init.normal_(block.layers[0].weight, std=0.3)
    trainee = MedusaTrainee(base, heads, load_recipe(None, ["heads.num_heads=2"]))
    ids = torch.randint(3, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[0, 0, 0] + [1] * 9])
    with torch.no_grad():
        loss, _ = trainee({"input_ids": ids, "loss_mask": mask, "attention_mask": ids > 0})
        hidden = base.model(input_ids=ids).last_hidden_state
        probs = base(input_ids=ids).logits.softmax(-1)
        expected, _ = medusa_loss(scale(heads(hidden)), ids, mask, 0.8, probs)
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)


@pytest.mark.parametrize("kind", ["granite", "cohere", "gemma2"])
def test_eagle1_draft_predicting_the_next_feature_is_at_its_loss_minimum(kind):
    """EAGLE-1's logits are the base lm_head's of the predicted feature, scaled as the base's
    forward scales them: a draft that predicts f_{t+1} exactly has the targets' entropy as its
    token loss and no gradient (raw logits pushed it away from the true feature)."""
    from heads import EagleConfig, EagleDraft
    from train.config import load_recipe
    from train.eagle import EagleTrainee

    base, scale = _scaled_base(kind)
    draft = EagleDraft(EagleConfig.from_base(base.config, version=1))
    recipe = load_recipe("recipes/tiny-eagle.yaml", ["heads.version=1"])
    trainee = EagleTrainee(base, draft, recipe).eval()
    ids = torch.randint(10, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros_like(ids)
    mask[:, 6:] = 1
    with torch.no_grad():
        true = base.model(input_ids=ids).last_hidden_state
        logits = scale(base.lm_head(true))[0]
    perfect = shift_left(true, 1).clone().requires_grad_(True)
    draft.forward = lambda embeds, x, pos, **kwargs: perfect  # predicts f_{t+1} exactly
    loss, metrics = trainee(
        {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask}
    )
    loss.backward()
    # rows t with f_{t+1} predicted and x_{t+2} a target: the targets are p(. | f_{t+1})
    rows = shift_left(shift_left(mask.bool(), 1, False), 1, False)[0]
    p = logits[1:][rows[:-1]].softmax(-1)
    entropy = float(-(p * p.clamp_min(1e-30).log()).sum(-1).mean())
    total, count = metrics["token_loss"]
    assert count == int(rows.sum())
    assert total / count == pytest.approx(entropy, rel=1e-4)
    assert float(perfect.grad.norm()) < 1e-5
