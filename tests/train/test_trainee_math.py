"""The trainees' arithmetic on hand-made inputs: the metrics (top-k widths, the rows sim_tau and
walk_tau count), Medusa-2's KL and warm-up, the heads' inputs (the adapted base's states, EAGLE's
training-time-test steps), EAGLE-1's loss terms, the draft vocabulary. Training a tiny task
(tests/train/test_recipes.py) would miss these: a wrong metric or input still trains something."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import train.eagle
from heads import EagleConfig, EagleDraft, MedusaConfig, MedusaHeads
from tests.conftest import make_tiny_llama
from tests.train.dense_losses import medusa_loss
from train.config import load_recipe
from train.eagle import EagleTrainee
from train.features import base_features, frequent_tokens, greedy_tokens
from train.losses import shift_left, sim_tau, walk_accept_length
from train.medusa import MedusaTrainee


# a step right after a wrong step is never accepted in the walk
def test_the_walk_accepts_no_step_after_a_wrong_one():
    correct = torch.zeros(2, 1, 3, dtype=torch.bool)  # K=2, B=1, T=3
    correct[1, 0, 0] = True  # row 0: step 0 wrong, step 1 right -> accepts 1 token only
    start = torch.ones(1, 3, dtype=torch.bool)
    assert walk_accept_length(correct, start) == (3, 3)


# no steps -> every row accepts the bonus token only: tau 1
def test_sim_tau_without_steps_is_one_per_row():
    rows = torch.tensor([[True, False, True]])
    assert sim_tau([], rows) == (2, 2)


# medusa_loss's divisor: rows whose NEXT token is a target (text corpus: first token a target)
def test_medusa_loss_divides_by_rows_whose_next_token_is_a_target():
    V = 5
    labels = torch.tensor([[0, 1, 2, 3]])
    mask = torch.ones(1, 4)
    loss, _ = medusa_loss(torch.zeros(1, 1, 4, V), labels, mask)
    assert float(loss) == pytest.approx(2 / 3 * math.log(V), rel=1e-6)


def _medusa(tiny_llama, num_heads=1, extra=()):
    heads = MedusaHeads(MedusaConfig.from_base(tiny_llama.config, num_heads=num_heads))
    heads.init_from_base(tiny_llama)
    recipe = load_recipe(None, [f"heads.num_heads={num_heads}", *extra])
    return heads, MedusaTrainee(tiny_llama, heads, recipe)


# head top5 counts a greedy token ranked 5th
def test_medusa_top5_counts_the_greedy_token_ranked_fifth(tiny_llama):
    torch.manual_seed(0)
    heads, trainee = _medusa(tiny_llama)
    ids = torch.randint(3, 256, (1, 12))
    mask = torch.tensor([[0, 0] + [1] * 10])
    with torch.no_grad():
        greedy = tiny_llama(input_ids=ids).logits.argmax(-1)[0]  # row t: token t+1
    valid = shift_left(shift_left(mask.bool(), 1, False), 1, False)[0]
    target = greedy[1:][valid[:-1]]  # greedy token t+2 at each valid row t

    def logits(k, rows):
        z = torch.zeros(len(target), 256)
        ahead = torch.stack([(target + d) % 256 for d in (1, 2, 3, 4)], -1)
        z.scatter_(1, ahead, 10.0)  # four other tokens ahead of it
        z[torch.arange(len(target)), target] = 5.0  # the greedy token 5th
        return z

    heads.head_logits = logits
    with torch.no_grad():
        _, metrics = trainee({"input_ids": ids, "loss_mask": mask, "attention_mask": ids > 0})
    n = len(target)
    assert metrics["head0/top5"] == (n, n) and metrics["head0/top1"] == (0, n)


# Medusa sim_tau over the rows whose next token is a target; oracle heads: 1 + heads in range
def test_medusa_sim_tau_counts_the_rows_before_the_answer_and_top1_tokens_only(tiny_llama):
    torch.manual_seed(0)
    heads, trainee = _medusa(tiny_llama, num_heads=2)
    ids = torch.randint(3, 256, (1, 10))
    mask = torch.tensor([[0, 0, 0, 0] + [1] * 6])
    with torch.no_grad():
        greedy = tiny_llama(input_ids=ids).logits.argmax(-1)  # row t: token t+1
    nxt = shift_left(mask.bool(), 1, False)
    want = [shift_left(greedy, k + 1)[shift_left(nxt, k + 1, False)] for k in range(2)]
    heads.head_logits = lambda k, rows: torch.nn.functional.one_hot(want[k], 256).float()
    with torch.no_grad():
        _, metrics = trainee.eval()(
            {"input_ids": ids, "loss_mask": mask, "attention_mask": ids > 0}
        )
    # rows 3..8 predict the answer: rows 3-6 both heads in range (3), row 7 head 0 only (2), row 8 (1)
    assert metrics["sim_tau"] == (3 * 4 + 2 + 1, 6)

    # a head's token is accepted only as its top-1, not anywhere in its top-5
    def second(k, rows):
        z = torch.nn.functional.one_hot(want[k], 256).float()
        if k == 1:  # head 1 ranks another token first, the greedy one second
            z[torch.arange(len(want[1])), (want[1] + 1) % 256] = 2.0
        return z

    heads.head_logits = second
    with torch.no_grad():
        _, metrics = trainee.eval()(
            {"input_ids": ids, "loss_mask": mask, "attention_mask": ids > 0}
        )
    assert metrics["head1/top1"] == (0, 6) and metrics["head1/top5"] == (6, 6)  # rows 1..6
    # rows 3..8: head 0 right and head 1 wrong on rows 3-7 (2), row 8 (1)
    assert metrics["sim_tau"] == (5 * 2 + 1, 6)


def _medusa2(tiny_llama, *overrides: str):
    """(adapted base, trainee, recipe): one Medusa head beside a LoRA adapter whose B is not
    zero (the base it reads is changed from the start)."""
    import copy

    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    lora = LoraConfig(
        r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False, lora_dropout=0.0
    )
    adapted = get_peft_model(copy.deepcopy(tiny_llama), lora)
    heads, _ = _medusa(tiny_llama)
    recipe = load_recipe(None, ["heads.num_heads=1", "heads.lora_r=4", *overrides])
    return adapted, MedusaTrainee(adapted, heads, recipe), recipe


# KL(original || adapted), and the ramp weighs the heads' loss only
def test_medusa2_kl_is_original_to_adapted_and_not_ramped(tiny_llama):
    adapted, trainee, recipe = _medusa2(tiny_llama, "heads.heads_loss_warmup_steps=10")
    ids = torch.randint(3, 256, (1, 20))
    mask = torch.tensor([[0, 0] + [1] * 18])
    batch = {"input_ids": ids, "loss_mask": mask, "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        trainee.eval()
        full, metrics = trainee(batch, 0)
        trainee.training = True
        ramped, _ = trainee(batch, 0)
        p = tiny_llama(input_ids=ids).logits.softmax(-1)[0, 1:-1]  # rows 1..18 predict targets
        hidden = adapted.get_base_model().model(input_ids=ids).last_hidden_state
        q = tiny_llama.lm_head(hidden).log_softmax(-1)[0, 1:-1]
    want = float((p * (p.log() - q)).sum(-1).mean())
    total, n = metrics["kl"]
    assert total / n == pytest.approx(want, rel=1e-4)
    kl = recipe.heads.kl_weight * total / n
    assert float(ramped) == pytest.approx(0.1 * (float(full) - kl) + kl, rel=1e-4)


# Medusa-2 heads read the ADAPTED base's hidden states
def test_medusa2_heads_read_the_adapted_hidden_states(tiny_llama):
    adapted, trainee, _ = _medusa2(tiny_llama)
    heads = trainee.heads
    seen = []
    real = heads.head_logits
    heads.head_logits = lambda k, rows: (seen.append(rows), real(k, rows))[1]
    ids = torch.randint(3, 256, (1, 12))
    mask = torch.tensor([[0, 0] + [1] * 10])
    with torch.no_grad():
        trainee.eval()(
            {"input_ids": ids, "loss_mask": mask, "attention_mask": torch.ones_like(ids)}
        )
        hidden = adapted.get_base_model().model(input_ids=ids).last_hidden_state[0, :-2]
    torch.testing.assert_close(seen[0], hidden)


def _eagle3(tiny_llama, ttt_steps, extra=()):
    torch.manual_seed(4)
    config = EagleConfig.from_base(
        tiny_llama.config, version=3, draft_vocab_size=256, aux_layer_ids=[0, 1, 1]
    )
    draft = EagleDraft(config)
    draft.set_vocab_map(torch.arange(256))
    recipe = load_recipe(None, ["heads.type=eagle", f"heads.ttt_steps={ttt_steps}", *extra])
    return draft, EagleTrainee(tiny_llama, draft, recipe)


def _batch():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 256, (2, 10), generator=g)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1, 1, 0, 0]])
    attn = torch.tensor([[1] * 10, [1] * 8 + [0] * 2])
    return {"input_ids": ids, "loss_mask": mask, "attention_mask": attn}


# what each TTT step is fed (token x_{t+1+j}, positions t+j, own previous output)
def test_ttt_step_j_reads_token_t_plus_1_plus_j_at_position_t_plus_j_and_its_own_output(tiny_llama):
    draft, trainee = _eagle3(tiny_llama, 3)
    calls = []
    pre = draft.register_forward_pre_hook(lambda m, a, kw: calls.append((a, kw)), with_kwargs=True)
    outs = []
    post = draft.register_forward_hook(lambda m, a, o: outs.append(o))
    batch = _batch()
    loss, _ = trainee.train()(batch)
    pre.remove()
    post.remove()
    assert len(calls) == 3
    embed = tiny_llama.get_input_embeddings()
    for j, (args, _) in enumerate(calls):
        embeds, hidden, pos = args
        torch.testing.assert_close(embeds, embed(shift_left(batch["input_ids"], j + 1)))
        assert torch.equal(pos, torch.arange(10).expand(2, 10) + j)
        if j:
            assert hidden is outs[j - 1]  # the previous step's output, in the graph (no detach)


# decay^j weighs step j: with decay 0 only step 0 counts
def test_ttt_decay_zero_trains_step_zero_only(tiny_llama):
    batch = _batch()
    with torch.no_grad():
        one = float(_eagle3(tiny_llama, 1)[1](batch)[0])
        three = float(_eagle3(tiny_llama, 3, ["training.loss_decay=0.0"])[1](batch)[0])
    assert three == pytest.approx(one, rel=1e-6)


# step top4 counts a base token ranked 4th, not 5th
def test_eagle3_top4_misses_the_base_token_ranked_fifth(tiny_llama):
    draft, trainee = _eagle3(tiny_llama, 1)
    batch = _batch()
    with torch.no_grad():
        greedy = tiny_llama(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).logits.argmax(-1)
    valid = shift_left(shift_left(batch["loss_mask"].bool(), 1, False), 1, False)
    target = shift_left(greedy, 1)[valid]

    def fifth(out):
        z = torch.zeros(out.shape[0], 256)
        ahead = torch.stack([(target + d) % 256 for d in (1, 2, 3, 4)], -1)
        z.scatter_(1, ahead, 10.0)
        z[torch.arange(len(target)), target] = 5.0
        return z

    draft.compute_logits = fifth
    with torch.no_grad():
        _, metrics = trainee(batch)
    assert metrics["step0/top4"] == (0, len(target))


def _eagle1(tiny_llama):
    draft = EagleDraft(EagleConfig.from_base(tiny_llama.config, version=1))
    recipe = load_recipe(None, ["heads.type=eagle", "heads.version=1", "heads.feature_noise=0"])
    return draft, recipe, EagleTrainee(tiny_llama, draft, recipe).eval()


# EAGLE-1 feature loss is per element, the weights are the recipe's, sim_tau per row
def test_eagle1_weighs_a_per_element_feature_loss_and_counts_sim_tau_per_row(tiny_llama):
    draft, recipe, trainee = _eagle1(tiny_llama)
    ids = torch.randint(10, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros_like(ids)
    mask[:, 5:] = 1
    with torch.no_grad():
        true = tiny_llama.model(input_ids=ids).last_hidden_state
    off = 0.1
    draft.forward = lambda embeds, x, pos, **kw: shift_left(true, 1) + off
    with torch.no_grad():
        loss, metrics = trainee(
            {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask}
        )
    total, n = metrics["feature_loss"]
    assert total / n == pytest.approx(0.5 * off**2, rel=1e-4)  # SmoothL1 mean over H
    tok = metrics["token_loss"][0] / metrics["token_loss"][1]
    w = recipe.heads
    assert float(loss) == pytest.approx(
        w.feature_loss_weight * total / n + w.token_loss_weight * tok, rel=1e-4
    )
    draft.forward = lambda embeds, x, pos, **kw: shift_left(true, 1)  # perfect: every step right
    with torch.no_grad():
        _, metrics = trainee(
            {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask}
        )
    # rows 4..14 predict the answer; all but the last (no x_{t+2}) accept 2
    assert metrics["sim_tau"] == (2 * 10 + 1, 11)


# the draft vocabulary: target tokens only, ties to the lower id, sorted
def test_frequent_tokens_counts_targets_breaks_ties_low_and_sorts():
    examples = [
        {"input_ids": [9, 9, 9, 9, 7, 7, 3, 5, 5], "loss_mask": [0, 0, 0, 0, 1, 1, 1, 1, 1]}
    ]
    assert frequent_tokens(examples, 1, 10).tolist() == [5]  # 9 is prompt only; 5 ties 7: lower
    assert frequent_tokens(examples, 3, 10).tolist() == [3, 5, 7]  # sorted, not by count


# aux features are the hidden states ENTERING the layers (index 0 = embeddings)
def test_aux_features_are_the_inputs_of_the_layers(tiny_llama):
    ids = torch.randint(3, 256, (1, 6))
    feats = base_features(tiny_llama, ids, torch.ones_like(ids), (0, 1, 1))
    H = tiny_llama.config.hidden_size
    torch.testing.assert_close(feats["aux"][..., :H], tiny_llama.get_input_embeddings()(ids))


# EAGLE-1's feature noise is on the input features only, never on the targets
def test_eagle1_noise_leaves_the_targets_clean(tiny_llama):
    draft = EagleDraft(EagleConfig.from_base(tiny_llama.config, version=1))
    recipe = load_recipe(None, ["heads.type=eagle", "heads.version=1", "heads.feature_noise=0.5"])
    trainee = EagleTrainee(tiny_llama, draft, recipe).train()
    ids = torch.randint(10, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[0] * 4 + [1] * 8])
    with torch.no_grad():
        true = tiny_llama.model(input_ids=ids).last_hidden_state
    seen = []
    draft.forward = lambda embeds, x, pos, **kw: (seen.append(x), shift_left(true, 1))[1]
    with torch.no_grad():
        _, metrics = trainee(
            {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask}
        )
    assert not torch.equal(seen[0], true)  # the input was noised
    assert metrics["feature_loss"][0] == 0.0  # the clean next feature is a perfect prediction


# hard labels map base ids to draft indices of a reduced vocabulary
def test_medusa_hard_labels_with_a_reduced_vocabulary(tiny_llama):
    token_map = torch.tensor([3, 7, 9, 12])
    config = MedusaConfig.from_base(tiny_llama.config, num_heads=1, truncated_vocab_size=4)
    heads = MedusaHeads(config).init_from_base(tiny_llama, token_map=token_map)
    trainee = MedusaTrainee(
        tiny_llama, heads, load_recipe(None, ["heads.num_heads=1", "training.soft_labels=false"])
    )
    ids = torch.tensor([[5, 6, 7, 9, 12, 3, 7, 9]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]])
    z = torch.tensor([0.0, 1.0, 2.0, 3.0])
    heads.head_logits = lambda k, rows: z.expand(rows.shape[0], 4)
    with torch.no_grad():
        loss, _ = trainee(
            {"input_ids": ids, "loss_mask": mask, "attention_mask": torch.ones_like(ids)}
        )
    logp = z.log_softmax(-1)
    index = {3: 0, 7: 1, 9: 2, 12: 3}
    targets = ids[0, 2:].tolist()  # head 0 at rows 0..5 learns tokens 2..7
    want = -sum(logp[index[t]] for t in targets) / int(shift_left(mask, 1).sum())
    assert float(loss) == pytest.approx(float(want), rel=1e-6)


def test_greedy_tokens_cover_every_row_when_the_last_chunk_is_short():
    base = make_tiny_llama(seed=1)
    hidden = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(0))  # (B, T, H)
    expected = base.lm_head(hidden).argmax(-1)  # (B, T)
    for rows in (2, 4, 5, 1024):  # chunks of 2+2+1, 4+1, 5, 5
        assert torch.equal(greedy_tokens(base, hidden, rows=rows), expected)


# the held-out split passes norm=1.0 (a sum): the KL pair is still (sum, rows)
def test_medusa2_kl_pair_is_a_sum_over_rows_whatever_the_divisor(tiny_llama):
    _, trainee, _ = _medusa2(tiny_llama)
    ids = torch.randint(3, 256, (1, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[0, 0] + [1] * 18])
    batch = {"input_ids": ids, "loss_mask": mask, "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        trainee.eval()
        mean_total, rows = trainee(batch)[1]["kl"]  # divided by its own 18 rows
        summed = trainee(batch, norm=1.0)[1]["kl"]  # as `evaluate` calls it
        stepped = trainee(batch, norm=7.0)[1]["kl"]  # a step's mean count, as training does
    assert rows == 18
    assert summed[1] == stepped[1] == 18
    assert summed[0] == pytest.approx(mean_total, rel=1e-5)
    assert stepped[0] == pytest.approx(mean_total, rel=1e-5)


# a batch without a target token costs 0 and no NaN, Medusa-2's KL term included
def test_medusa2_batch_without_answer_tokens_costs_nothing(tiny_llama):
    _, trainee, _ = _medusa2(tiny_llama)
    ids = torch.randint(3, 256, (1, 8), generator=torch.Generator().manual_seed(2))
    batch = {
        "input_ids": ids,
        "loss_mask": torch.zeros_like(ids),
        "attention_mask": torch.ones_like(ids),
    }
    with torch.no_grad():
        loss, metrics = trainee.eval()(batch)
    assert float(loss) == 0.0
    assert metrics["kl"] == (0.0, 0)


# the walk over the rows is a held-out metric only: a training step never runs it
@pytest.mark.parametrize("kind", ["medusa", "eagle3", "eagle1"])
def test_training_steps_leave_the_walk_to_the_held_out_split(tiny_llama, kind):
    if kind == "medusa":
        trainee = _medusa(tiny_llama, num_heads=2)[1]
    elif kind == "eagle3":
        trainee = _eagle3(tiny_llama, 2)[1]
    else:
        trainee = _eagle1(tiny_llama)[2]
    batch = _batch()
    with torch.no_grad():
        held_out = trainee.eval()(batch)[1]
        trained = trainee.train()(batch)[1]
    assert "walk_tau" in held_out and "walk_tau" not in trained
    assert held_out["sim_tau"][1] == trained["sim_tau"][1] == 15  # rows 1..8 and 0..6


# EAGLE-1's walk starts where the root and the first target are answer tokens
def test_eagle1_walk_of_a_perfect_draft_takes_two_tokens_a_step(tiny_llama):
    draft, _, trainee = _eagle1(tiny_llama)
    ids = torch.randint(10, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros_like(ids)
    mask[:, 5:] = 1  # an answer of 11 tokens: the prefill gives the first, 10 are decoded
    with torch.no_grad():
        true = tiny_llama.model(input_ids=ids).last_hidden_state
    draft.forward = lambda embeds, x, pos, **kw: shift_left(true, 1)  # every step right
    with torch.no_grad():
        _, metrics = trainee(
            {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask}
        )
    assert metrics["walk_tau"] == (10, 5)  # 5 steps of the draft's token and the bonus token


# noise is a training augmentation: the held-out loss of EAGLE-1 reads the clean features
def test_eagle1_held_out_loss_is_that_without_noise(tiny_llama):
    batch = _batch()

    def loss(noise: float, training: bool = False) -> float:
        torch.manual_seed(0)
        draft = EagleDraft(EagleConfig.from_base(tiny_llama.config, version=1))
        recipe = load_recipe(
            None, ["heads.type=eagle", "heads.version=1", f"heads.feature_noise={noise}"]
        )
        with torch.no_grad():
            return float(EagleTrainee(tiny_llama, draft, recipe).train(training)(batch, 3)[0])

    assert loss(0.5) == loss(0.0)
    assert loss(0.5, training=True) != loss(0.0)  # the noise does change a training step's


# two processes at the same step and micro-batch draw different noise
def test_eagle1_noise_differs_between_processes(tiny_llama, monkeypatch):
    batch = _batch()

    def loss_on(process_index: int) -> float:
        monkeypatch.setattr(
            train.eagle, "PartialState", lambda: SimpleNamespace(process_index=process_index)
        )
        torch.manual_seed(0)
        draft = EagleDraft(EagleConfig.from_base(tiny_llama.config, version=1))
        recipe = load_recipe(
            None, ["heads.type=eagle", "heads.version=1", "heads.feature_noise=0.5"]
        )
        with torch.no_grad():
            return float(EagleTrainee(tiny_llama, draft, recipe).train()(batch, 3)[0])

    assert loss_on(0) == loss_on(0)  # seeded: a process draws the same again
    assert loss_on(1) != loss_on(0)


# a resumed run's trainee starts afresh: at a step, it draws the noise the uninterrupted run drew
def test_eagle1_noise_of_a_step_does_not_depend_on_the_steps_before(tiny_llama):
    batch = _batch()
    recipe = load_recipe(None, ["heads.type=eagle", "heads.version=1", "heads.feature_noise=0.5"])

    def losses(steps: list[int]) -> list[float]:
        torch.manual_seed(0)
        draft = EagleDraft(EagleConfig.from_base(tiny_llama.config, version=1))
        trainee = EagleTrainee(tiny_llama, draft, recipe).train()
        with torch.no_grad():
            return [float(trainee(batch, step)[0]) for step in steps]

    uninterrupted = losses([3, 3, 4, 4])  # two micro-batches a step
    assert losses([4, 4]) == uninterrupted[2:]  # resumed at step 4
