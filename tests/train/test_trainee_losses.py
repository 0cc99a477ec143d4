"""The trainees' losses (train/medusa.py, train/eagle.py) against dense references on a tiny
Llama, EAGLE-3's training-time-test mask, and a step's weighing of its target tokens."""

from __future__ import annotations

import contextlib

import pytest
import torch

from heads import MedusaConfig, MedusaHeads
from tests.train.dense_losses import medusa_loss, soft_cross_entropy
from train.config import load_recipe
from train.eagle import ttt_mask
from train.losses import shift_left
from train.medusa import MedusaTrainee


@pytest.mark.parametrize("soft", [True, False])
def test_medusa_recipe_loss_equals_medusa_loss(tiny_llama, soft):
    """train/medusa.py computes its loss on the valid rows only; it must equal the dense
    reference on the full vocabulary, padding included."""
    from heads import MedusaConfig, MedusaHeads
    from train.config import load_recipe
    from train.medusa import MedusaTrainee

    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig.from_base(tiny_llama.config, num_heads=3))
    heads = heads.init_from_base(tiny_llama)
    for block in heads.blocks:  # a fresh block is the identity; make the heads differ
        torch.nn.init.normal_(block.layers[0].weight, std=0.3)
    recipe = load_recipe(None, ["heads.num_heads=3", f"training.soft_labels={str(soft).lower()}"])
    trainee = MedusaTrainee(tiny_llama, heads, recipe)
    ids = torch.randint(3, 256, (2, 9))
    attention = torch.tensor([[1] * 9, [1] * 6 + [0] * 3])
    mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1, 1], [0, 1, 1, 1, 1, 1, 0, 0, 0]])
    with torch.no_grad():
        loss, metrics = trainee({"input_ids": ids, "loss_mask": mask, "attention_mask": attention})
        hidden = tiny_llama.model(input_ids=ids, attention_mask=attention).last_hidden_state
        base_logits = tiny_llama.lm_head(hidden)  # (B,T,V): row t predicts token t+1
        probs = base_logits.softmax(-1) if soft else None
        expected, _ = medusa_loss(heads(hidden), ids, mask, 0.8, probs)
        head_top = heads(hidden).topk(5, dim=-1).indices  # (K,B,T,5)
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)
    # top-k against the base's greedy token at t+k+2 (what greedy verification accepts), not
    # the data's token there: random ids are almost never the base's choice
    for k in range(3):
        valid = shift_left(mask, k + 2).bool()
        greedy = shift_left(base_logits.argmax(-1), k + 1)  # (B,T)
        top1 = (head_top[k, ..., 0] == greedy)[valid]
        top5 = (head_top[k] == greedy[..., None]).any(-1)[valid]
        assert metrics[f"head{k}/top1"] == (int(top1.sum()), top1.numel())
        assert metrics[f"head{k}/top5"] == (int(top5.sum()), top5.numel())


def test_medusa_top1_is_scored_against_the_base_greedy_token_not_the_answer(tiny_llama):
    """An answer whose every token is head 0's top-1 there (built left to right): scored
    against the answer, head 0 would be always right; against the base's greedy token, which
    a random base seldom agrees with, it is not."""
    from heads import MedusaConfig, MedusaHeads
    from train.config import load_recipe
    from train.medusa import MedusaTrainee

    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig.from_base(tiny_llama.config, num_heads=1))
    heads = heads.init_from_base(tiny_llama)
    torch.nn.init.normal_(heads.blocks[0].layers[0].weight, std=0.3)
    ids = torch.randint(3, 256, (1, 12))
    with torch.no_grad():
        for t in range(10):  # token t+2 := head 0's top-1 at t (hidden t reads ids <= t)
            hidden = tiny_llama.model(input_ids=ids[:, : t + 1]).last_hidden_state
            ids[0, t + 2] = heads(hidden)[0, 0, t].argmax()
        mask = torch.tensor([[0, 0] + [1] * 10])
        trainee = MedusaTrainee(tiny_llama, heads, load_recipe(None, ["heads.num_heads=1"]))
        _, metrics = trainee(
            {"input_ids": ids, "loss_mask": mask, "attention_mask": torch.ones_like(ids)}
        )
    right, rows = metrics["head0/top1"]
    assert rows == 10 and right < rows


@contextlib.contextmanager
def _no_full_lm_head(model):
    """Fail if the base's whole lm_head runs (the greedy token was given with the features)."""

    def refuse(*args, **kwargs):
        raise AssertionError("the full lm_head ran although the greedy tokens were given")

    model.lm_head.forward = refuse
    try:
        yield
    finally:
        del model.lm_head.forward


def _restricted(probs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The base's distribution over a draft vocabulary `ids`, renormalised (the soft label)."""
    kept = probs[..., ids]
    return kept / kept.sum(-1, keepdim=True)


def test_medusa_recipe_loss_with_a_reduced_vocabulary(tiny_llama):
    """With a draft vocabulary the soft label is the base's distribution restricted to it and
    renormalised, and a row whose greedy token the vocabulary lacks trains nothing; the
    recipe's loss must equal that dense reference."""
    from heads import MedusaConfig, MedusaHeads
    from train.config import load_recipe
    from train.features import greedy_tokens
    from train.medusa import MedusaTrainee

    batch, hidden, greedy = _two_answers(tiny_llama)
    mask = batch["loss_mask"]
    # the greedy tokens of the first row in the map, the second row's out of it (but for those
    # it shares with the first)
    others = torch.tensor([t for t in range(256) if t not in set(greedy.flatten().tolist())])
    token_map = torch.cat([greedy[0].unique(), others[torch.randperm(len(others))]])[:40]
    token_map = token_map.sort().values
    config = MedusaConfig.from_base(tiny_llama.config, num_heads=2, truncated_vocab_size=40)
    heads = MedusaHeads(config).init_from_base(tiny_llama, token_map)
    for block in heads.blocks:
        torch.nn.init.normal_(block.layers[0].weight, std=0.3)
    trainee = MedusaTrainee(tiny_llama, heads, load_recipe(None, ["heads.num_heads=2"]))
    drafted = torch.isin(greedy, token_map)  # (B,T)
    assert drafted[0].all() and not drafted[1].all()
    with torch.no_grad():
        loss, metrics = trainee(batch)
        probs = _restricted(tiny_llama.lm_head(hidden).softmax(-1), token_map)  # (B,T,40)
        logits = heads(hidden)  # (K,B,T,40)
        # Offline: features with the greedy tokens; the step then computes the draft rows only.
        offline = dict(batch, hidden=hidden, top=greedy_tokens(tiny_llama, hidden))
        with _no_full_lm_head(tiny_llama):  # the draft vocabulary's rows only
            loss_offline, metrics_offline = trainee(offline)
    answer_tokens = shift_left(mask, 1).sum()  # each head's sum is divided by these
    expected = _restricted_medusa_loss(logits, probs, mask, drafted, answer_tokens)
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)
    assert float(loss_offline) == pytest.approx(float(expected), rel=1e-5)
    assert metrics_offline == metrics  # the same hits and rows


def test_eagle3_first_step_loss_against_a_dense_reference(tiny_llama):
    """TTT step 0 of the EAGLE-3 recipe: soft CE of the draft's logits at t against the base's
    distribution at t+1 over the draft vocabulary, renormalised, on positions whose target
    x_{t+2} is an assistant token and whose greedy token the draft vocabulary holds; and its
    top-1 compares with the base's greedy token (on every such position)."""
    from heads import EagleConfig, EagleDraft
    from train.config import load_recipe
    from train.eagle import EagleTrainee
    from train.features import base_features

    torch.manual_seed(2)
    aux_ids = [0, 1, 1]
    ids = torch.randint(3, 256, (2, 8))
    attention = torch.ones(2, 8, dtype=torch.long)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0, 1, 1]])
    batch = {"input_ids": ids, "loss_mask": mask, "attention_mask": attention}
    with torch.no_grad():
        greedy = tiny_llama(input_ids=ids).logits.argmax(-1)  # (B,T)
    # the first row's greedy tokens in the draft vocabulary, the second's out of it (but for
    # those it shares with the first)
    others = torch.tensor([t for t in range(256) if t not in set(greedy.flatten().tolist())])
    vocab = torch.cat([greedy[0].unique(), others[torch.randperm(len(others))]])[:48]
    vocab = vocab.sort().values
    drafted = shift_left(torch.isin(greedy, vocab), 1)  # row t's target: the base's at t+1
    config = EagleConfig.from_base(
        tiny_llama.config, version=3, draft_vocab_size=48, aux_layer_ids=aux_ids
    )
    draft = EagleDraft(config)
    draft.set_vocab_map(vocab)
    recipe = load_recipe(None, ["heads.type=eagle", "heads.ttt_steps=1"])
    trainee = EagleTrainee(tiny_llama, draft, recipe)
    with torch.no_grad():
        loss, metrics = trainee(batch)
        feats = base_features(tiny_llama, ids, attention, tuple(aux_ids), greedy=True)
        # Offline: the features and greedy tokens given; the step computes the draft rows only.
        with _no_full_lm_head(tiny_llama):  # the draft vocabulary's rows only
            loss_offline, metrics_offline = trainee(dict(batch, **feats))
        base_logits = tiny_llama.lm_head(feats["hidden"])  # (B,T,V): predicts x_{t+1}
        embeds = tiny_llama.get_input_embeddings()(shift_left(ids, 1))
        pos = torch.arange(8).expand(2, 8)
        out = draft(embeds, draft.fuse(feats["aux"]), pos)  # plain causal: step 0
        logits = draft.compute_logits(out)  # (B,T,48)
    target = _restricted(shift_left(base_logits, 1).softmax(-1), vocab)  # p_{t+1}
    valid = shift_left(mask, 2).bool()
    trained = valid & drafted
    assert trained.any() and (valid & ~drafted).any()
    answer_tokens = shift_left(mask, 1).sum()  # the sum is divided by these, not by valid's
    expected = -(target[trained] * logits[trained].log_softmax(-1)).sum() / answer_tokens
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)
    right = draft.to_base_ids(logits[valid].argmax(-1)) == shift_left(base_logits, 1)[valid].argmax(
        -1
    )
    assert metrics["step0/top1"] == (int(right.sum()), right.numel())
    # top 4: the base's token among the draft's 4 highest logits, mapped to base ids
    ranked = draft.to_base_ids(logits[valid].argsort(-1, descending=True)[:, :4])
    in_top4 = (ranked == shift_left(base_logits, 1)[valid].argmax(-1)[:, None]).any(-1)
    assert metrics["step0/top4"] == (int(in_top4.sum()), in_top4.numel())
    assert metrics["step0/top4"][0] >= metrics["step0/top1"][0]
    assert torch.equal(feats["top"], base_logits.argmax(-1))
    assert float(loss_offline) == pytest.approx(float(expected), rel=1e-5)
    assert metrics_offline == metrics  # the same hits and rows


def test_eagle3_loss_reads_a_draft_vocabulary_in_any_order(tiny_llama):
    """vLLM and SGLang read any one-to-one d2t; other trainers may write one in frequency order.
    The same draft with its vocabulary rows permuted (lm_head rows and d2t together) is the same
    draft, and the recipe's loss and top-1 hits must not change (`training.init_heads` from such
    a folder trains it)."""
    from heads import EagleConfig, EagleDraft
    from train.config import load_recipe
    from train.eagle import EagleTrainee

    torch.manual_seed(4)
    config = EagleConfig.from_base(
        tiny_llama.config, version=3, draft_vocab_size=48, aux_layer_ids=[0, 1, 1]
    )
    sorted_draft = EagleDraft(config)
    vocab = torch.randperm(256)[:48].sort().values
    sorted_draft.set_vocab_map(vocab)
    perm = torch.randperm(48)
    permuted = EagleDraft(config)
    permuted.load_state_dict(sorted_draft.state_dict())
    permuted.set_vocab_map(vocab[perm])
    with torch.no_grad():
        permuted.lm_head.weight.copy_(sorted_draft.lm_head.weight[perm])
    assert not torch.equal(permuted.d2t, sorted_draft.d2t)
    recipe = load_recipe(None, ["heads.type=eagle", "heads.ttt_steps=2"])
    ids = torch.randint(3, 256, (2, 10))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0, 1, 1, 1, 1]])
    batch = {"input_ids": ids, "loss_mask": mask, "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        loss, metrics = EagleTrainee(tiny_llama, sorted_draft, recipe)(batch)
        loss_permuted, metrics_permuted = EagleTrainee(tiny_llama, permuted, recipe)(batch)
    assert float(loss_permuted) == pytest.approx(float(loss), rel=1e-5)
    assert metrics_permuted == metrics
    assert metrics["step0/top1"][1] > 0  # rows were compared


def test_ttt_mask_step_2_with_padding():
    # B=2, T=3; the second example's last position is padding.
    key_pad = torch.tensor([[False, False, False], [False, False, True]])
    mask = ttt_mask(3, 2, key_pad, torch.float32)
    assert mask.shape == (2, 1, 3, 9)  # (B,1,T,(step+1)T): step 0's keys, then steps 1 and 2
    allowed = [
        [  # causal over step 0 | own position in step 1 | own position in step 2
            [1, 0, 0, 1, 0, 0, 1, 0, 0],
            [1, 1, 0, 0, 1, 0, 0, 1, 0],
            [1, 1, 1, 0, 0, 1, 0, 0, 1],
        ],
        [  # the padded key (position 2) is blocked in every step's block
            [1, 0, 0, 1, 0, 0, 1, 0, 0],
            [1, 1, 0, 0, 1, 0, 0, 1, 0],
            [1, 1, 0, 0, 0, 0, 0, 0, 0],
        ],
    ]
    blocked = torch.finfo(torch.float32).min
    expected = torch.where(torch.tensor(allowed, dtype=torch.bool), 0.0, blocked)[:, None]
    assert torch.equal(mask, expected)


def test_ttt_mask_step_0_is_causal():
    mask = ttt_mask(4, 0, torch.zeros(1, 4, dtype=torch.bool), torch.bfloat16)
    assert mask.dtype == torch.bfloat16 and mask.shape == (1, 1, 4, 4)
    assert torch.equal(mask[0, 0] == 0, torch.ones(4, 4, dtype=torch.bool).tril())


def _trainee(kind: str, base):
    from heads import EagleConfig, EagleDraft, MedusaConfig, MedusaHeads
    from train.config import load_recipe
    from train.eagle import EagleTrainee
    from train.medusa import MedusaTrainee

    torch.manual_seed(3)
    if kind == "eagle3":
        config = EagleConfig.from_base(
            base.config, version=3, draft_vocab_size=64, aux_layer_ids=[0, 1, 1]
        )
        draft = EagleDraft(config)
        draft.set_vocab_map(torch.randperm(256)[:64].sort().values)
        return EagleTrainee(
            base, draft, load_recipe(None, ["heads.type=eagle", "heads.ttt_steps=2"])
        )
    soft = str(kind == "medusa-soft").lower()
    heads = MedusaHeads(MedusaConfig.from_base(base.config, num_heads=2)).init_from_base(base)
    for block in heads.blocks:  # a fresh block is the identity; make the heads differ
        torch.nn.init.normal_(block.layers[0].weight, std=0.3)
    return MedusaTrainee(base, heads, load_recipe(None, [f"training.soft_labels={soft}"]))


def _conversations(seed: int) -> list[dict[str, list[int]]]:
    """Four random conversations of different lengths, their answers at the end (the last all
    answer: a text corpus, whose first token is no row's target)."""
    g = torch.Generator().manual_seed(seed)
    examples = []
    for length, answer in [(16, 11), (7, 3), (11, 2), (5, 5)]:
        ids = torch.randint(3, 256, (length,), generator=g).tolist()
        mask = [0] * (length - answer) + [1] * answer
        examples.append({"input_ids": ids, "loss_mask": mask, "labels": ids})
    return examples


@pytest.mark.parametrize("kind", ["medusa-hard", "medusa-soft", "eagle3"])
def test_a_step_weighs_every_target_token_the_same_however_it_is_split(kind):
    """An optimizer step's gradient is that of its conversations' loss per target token, whether
    they come as one micro-batch or as several of other lengths, each divided by the step's
    mean target count (`step_norms`) and averaged as accelerate averages accumulated ones; a
    mean per micro-batch would weigh the tokens of the short answer more."""
    from tests.conftest import make_tiny_llama
    from train.data import pad_batch

    trainee = _trainee(kind, make_tiny_llama(seed=5)).train()
    examples = _conversations(seed=0)
    params = [p for p in trainee.heads.parameters() if p.requires_grad]

    def gradient(micro_batches, norm):
        trainee.zero_grad()
        total = 0.0
        for mb in micro_batches:
            loss, _ = trainee(pad_batch(mb, 0), 0, norm)
            (loss / len(micro_batches)).backward()  # accelerate's mean over accumulation
            total += float(loss.detach()) / len(micro_batches)
        return total, [p.grad.clone() for p in params]

    whole, whole_grad = gradient([examples], None)  # one micro-batch: its mean per token
    targets = sum(sum(e["loss_mask"][1:]) for e in examples)
    split, split_grad = gradient([[e] for e in examples], targets / len(examples))
    assert split == pytest.approx(whole, rel=1e-5)
    for a, b in zip(split_grad, whole_grad):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    _, means_grad = gradient([[e] for e in examples], None)  # each micro-batch its own mean
    off = torch.cat([(a - b).flatten() for a, b in zip(means_grad, whole_grad)]).norm()
    assert off > 0.05 * torch.cat([b.flatten() for b in whole_grad]).norm()


@pytest.mark.parametrize("kind", ["medusa-hard", "medusa-soft", "eagle3"])
def test_held_out_loss_is_per_target_token_whatever_the_batch_size(kind):
    """The held-out loss weighs every target token the same, as training does: evaluated one
    conversation at a time it equals the loss of all of them as one batch, not the mean of the
    conversations' means (which weighs a short answer's tokens more)."""
    from tests.conftest import make_tiny_llama
    from train.config import load_recipe
    from train.data import pad_batch
    from train.features import ExampleDataset
    from train.run import evaluate

    trainee = _trainee(kind, make_tiny_llama(seed=5))
    examples = _conversations(seed=1)
    dataset = ExampleDataset(examples)

    def held_out(micro_batch_size):
        recipe = load_recipe(None, [f"training.micro_batch_size={micro_batch_size}"])
        return evaluate(trainee, dataset, recipe, 0, "cpu")["eval/loss"]

    whole, one_by_one = held_out(len(examples)), held_out(1)
    assert one_by_one == pytest.approx(whole, rel=1e-5)
    with torch.no_grad():  # each conversation's own mean per target token
        means = [float(trainee.eval()(pad_batch([e], 0))[0]) for e in examples]
    assert sum(means) / len(means) != pytest.approx(whole, rel=1e-2)


def test_step_norms_are_the_mean_target_count_of_each_steps_micro_batches():
    """Two processes, two micro-batches per step: each micro-batch's divisor is its step's
    target tokens over both processes' four micro-batches."""
    from types import SimpleNamespace

    from train.config import load_recipe
    from train.steps import step_norms

    recipe = load_recipe(None, ["training.gradient_accumulation_steps=2"])
    masks = [[0] * 3 + [1] * n for n in (1, 2, 4)] + [[1] * 9]  # a text corpus: all targets
    dataset = SimpleNamespace(examples=[{"loss_mask": mask} for mask in masks])
    other = torch.tensor([10, 20])  # the other process's step counts
    accelerator = SimpleNamespace(
        device="cpu", num_processes=2, reduce=lambda t, op: t + other if op == "sum" else None
    )
    # the first token has no row before it to predict it: the last example has 8 targets
    batches = [[0], [1, 2], [3], [3, 0]]  # 1 | 6 ; 8 | 9 targets: steps of 7 and 17 here
    norms = step_norms(dataset, batches, recipe, accelerator)
    assert norms == [17 / 4, 17 / 4, 37 / 4, 37 / 4]


def test_medusa2_is_scored_against_the_adapted_base_greedy_token(tiny_llama):
    """Medusa-2 heads are served on the base with its adapter merged, so verification accepts
    the adapted base's greedy token: a head that always proposes that token scores 1.0 (against
    the original base's token, which the adapter changes, it would not)."""
    import copy

    from peft import LoraConfig, get_peft_model

    from heads import MedusaConfig, MedusaHeads
    from train.config import load_recipe
    from train.medusa import MedusaTrainee

    torch.manual_seed(0)
    adapted_base = get_peft_model(
        copy.deepcopy(tiny_llama),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj", "o_proj"], init_lora_weights=False),
    )
    heads = MedusaHeads(MedusaConfig.from_base(tiny_llama.config, num_heads=1))
    heads.init_from_base(tiny_llama)
    recipe = load_recipe(None, ["heads.num_heads=1", "heads.lora_r=4"])
    trainee = MedusaTrainee(adapted_base, heads, recipe)
    ids = torch.randint(3, 256, (1, 40))
    mask = torch.tensor([[0, 0] + [1] * 38])
    with torch.no_grad():
        hidden = adapted_base.get_base_model().model(input_ids=ids).last_hidden_state
        adapted = tiny_llama.lm_head(hidden).argmax(-1)[0]  # (T,): row t's greedy token t+1
        original = tiny_llama(input_ids=ids).logits.argmax(-1)[0]
    valid = shift_left(shift_left(mask.bool(), 1, False), 1, False)[0]  # target t+2 an answer
    oracle = adapted[1:][valid[:-1]]  # the adapted greedy token t+2 at each valid row t
    assert (oracle != original[1:][valid[:-1]]).any()  # the adapter changed some choices
    heads.head_logits = lambda k, rows: torch.nn.functional.one_hot(oracle, 256).float()
    with torch.no_grad():
        _, metrics = trainee({"input_ids": ids, "loss_mask": mask, "attention_mask": ids > 0})
    assert metrics["head0/top1"] == (len(oracle), len(oracle))


def test_medusa2_kl_reads_the_adapted_logits_as_the_forward_returns_them():
    """Granite divides its logits after the lm_head: the KL term compares the original and the
    adapted base's distributions both so scaled, so an adapter that changes nothing costs 0."""
    from peft import LoraConfig, get_peft_model
    from transformers import GraniteConfig, GraniteForCausalLM

    from heads import MedusaConfig, MedusaHeads
    from tests.conftest import TINY
    from train.config import load_recipe
    from train.medusa import MedusaTrainee

    torch.manual_seed(0)
    config = GraniteConfig(**TINY, logits_scaling=8.0)
    config._attn_implementation = "sdpa"
    granite = GraniteForCausalLM(config).eval().requires_grad_(False)
    heads = MedusaHeads(MedusaConfig.from_base(granite.config, num_heads=1))
    heads.init_from_base(granite)
    unchanged = get_peft_model(granite, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    recipe = load_recipe(None, ["heads.num_heads=1", "heads.lora_r=4"])
    trainee = MedusaTrainee(unchanged, heads, recipe)
    ids = torch.randint(3, 256, (1, 40))
    mask = torch.tensor([[0, 0] + [1] * 38])
    with torch.no_grad():
        _, metrics = trainee({"input_ids": ids, "loss_mask": mask, "attention_mask": ids > 0})
    total, count = metrics["kl"]
    assert count == 38 and abs(total / count) < 1e-5


def test_medusa_rows_whose_greedy_token_is_the_first_draft_token_train(tiny_llama):
    """The draft vocabulary is the greedy tokens of the rows the heads read, so every such row
    trains, those whose greedy token is the vocabulary's first (draft index 0) included."""
    batch, hidden, greedy = _two_answers(tiny_llama)
    mask = batch["loss_mask"]
    read = shift_left(mask, 1).bool()  # rows whose next token is a target
    read[:, 0] = False  # head k's label for t is row t + k + 1: row 0 is no head's
    token_map = greedy[read].unique()  # sorted: those rows' greedy tokens
    assert (read & (greedy == token_map[0])).any()
    drafted = torch.isin(greedy, token_map)  # (B,T)
    V = token_map.numel()
    config = MedusaConfig.from_base(tiny_llama.config, num_heads=2, truncated_vocab_size=V)
    heads = MedusaHeads(config).init_from_base(tiny_llama, token_map)
    for block in heads.blocks:
        torch.nn.init.normal_(block.layers[0].weight, std=0.3)
    trainee = MedusaTrainee(tiny_llama, heads, load_recipe(None, ["heads.num_heads=2"]))
    with torch.no_grad():
        loss, _ = trainee(batch)
        kept = tiny_llama.lm_head(hidden).softmax(-1)[..., token_map]
        probs = kept / kept.sum(-1, keepdim=True)  # (B,T,V): the restricted soft labels
        logits = heads(hidden)  # (K,B,T,V)
    answer_tokens = shift_left(mask, 1).sum()
    expected = _restricted_medusa_loss(logits, probs, mask, drafted, answer_tokens)
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)


def _restricted_medusa_loss(logits, probs, mask, drafted, answer_tokens):
    """Two heads' dense soft loss over a reduced vocabulary: rows whose greedy token
    (`drafted` (B,T)) the vocabulary lacks train nothing. logits (K,B,T,V), probs (B,T,V)."""
    return sum(
        0.8**k
        * soft_cross_entropy(
            logits[k],
            shift_left(probs, k + 1),
            shift_left(mask, k + 2) * shift_left(drafted, k + 1),
            answer_tokens,
        )
        for k in range(2)
    )


def _two_answers(tiny_llama):
    """(batch of two padded answers, the base's final hidden states (B,T,H), its greedy tokens
    (B,T))."""
    torch.manual_seed(1)
    ids = torch.randint(3, 256, (2, 9))
    attention = torch.tensor([[1] * 9, [1] * 7 + [0] * 2])
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1, 0, 0]])
    batch = {"input_ids": ids, "loss_mask": mask, "attention_mask": attention}
    with torch.no_grad():
        hidden = tiny_llama.model(input_ids=ids, attention_mask=attention).last_hidden_state
        greedy = tiny_llama.lm_head(hidden).argmax(-1)  # (B,T)
    return batch, hidden, greedy
