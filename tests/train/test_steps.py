"""The optimizer steps of a run (train/steps.py; target: tests/train/test_steps.py): each epoch
in its own seeded order, whole steps split evenly across processes, and the run's step count."""

from types import SimpleNamespace

from train.config import load_recipe
from train.steps import count_steps, epoch_batches


def processes(n: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(num_processes=n, process_index=r, print=print) for r in range(n)]


def test_each_epoch_takes_the_examples_in_another_seeded_order():
    recipe = load_recipe(None, ["training.micro_batch_size=2"])
    [one] = processes(1)
    epochs = [epoch_batches(20, recipe, epoch, one) for epoch in (0, 1, 2)]
    for batches in epochs:
        assert sorted(i for batch in batches for i in batch) == list(range(20))
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]
    assert epoch_batches(20, recipe, 1, one) == epochs[1]  # a resumed run sees the same


def test_two_processes_take_disjoint_shares_of_whole_steps():
    """Micro-batches of 3 on 2 processes: a step takes 6 examples; of 22, 18 fit 3 steps."""
    recipe = load_recipe(None, ["training.micro_batch_size=3"])
    shares = [epoch_batches(22, recipe, 0, p) for p in processes(2)]
    assert [[len(b) for b in batches] for batches in shares] == [[3, 3, 3], [3, 3, 3]]
    taken = [i for batches in shares for batch in batches for i in batch]
    assert len(set(taken)) == 18


def test_fewer_examples_than_one_step_still_make_one_step():
    recipe = load_recipe(None, ["training.micro_batch_size=3"])
    shares = [epoch_batches(4, recipe, 0, p) for p in processes(2)]
    assert [[len(b) for b in batches] for batches in shares] == [[3], [3]]
    assert {i for batches in shares for batch in batches for i in batch} == {0, 1, 2, 3}
    [one] = processes(1)
    three = load_recipe(None, ["training.micro_batch_size=3", "training.epochs=3"])
    assert count_steps(4, three, one) == (1, 3)


def test_a_step_with_no_target_tokens_divides_its_loss_by_one_not_zero():
    """Answers cut to their first token leave a step nothing to predict: its loss sum is 0 and
    stays 0 (not 0/0)."""
    from train.steps import step_norms

    recipe = load_recipe(None, ["training.gradient_accumulation_steps=2"])
    dataset = SimpleNamespace(examples=[{"loss_mask": [0, 0, 1]}, {"loss_mask": [1]}])
    one = SimpleNamespace(device="cpu", num_processes=1, reduce=lambda t, op: t)
    assert step_norms(dataset, [[1], [1], [0], [1]], recipe, one) == [1.0, 1.0, 1.0, 1.0]
    assert step_norms(dataset, [[0, 0], [0, 0, 0]], recipe, one) == [2.5, 2.5]
