"""scripts/replay_policy.py on hand-made records: fixed settings replay to their own rate, a
policy over a slow and a fast setting ends near the fast one, and bad input is a clear error."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import replay_policy  # noqa: E402  (scripts/ is not a package)

from inference.adaptive import AdaptivePolicy  # noqa: E402


def steps(gains: list[int], seconds: float, drafted=None) -> list[list]:
    """Recorded steps gaining `gains` tokens each; `drafted` a static chain's paths."""
    out, position = [], 0
    for n in gains:
        accepted = [0] * (n - 1) if drafted else []
        out.append([position, n, seconds, drafted, accepted])
        position += n
    return out


def record(prompts: int = 6) -> dict:
    """Plain decoding (1 token, 1 s) and a 2-node chain gaining 1 or 3 tokens (1.2 s): 2 tokens
    a step on average, 1.67 tok/s against plain's 1."""
    chain = [[0], [0, 0]]
    per_prompt = []
    for _ in range(prompts):
        gains = [1, 3] * 20
        per_prompt.append([steps([1] * sum(gains), 1.0), steps(gains, 1.2, chain)])
    return {"arms": [None, {"choices": chain}], "prompts": per_prompt}


def test_a_fixed_setting_replays_to_its_own_rate():
    rec = record()
    assert replay_policy.fixed_rate(rec, 0) == pytest.approx(1.0)
    assert replay_policy.fixed_rate(rec, 1) == pytest.approx(2 / 1.2)
    for arm in (0, 1):  # a one-setting policy takes the recorded steps as they are
        make, _ = replay_policy.POLICIES["per-arm averages"]
        policy = make([rec["arms"][arm]])
        rate = replay_policy.replay(rec, policy, [arm], list(range(6)))
        assert rate == pytest.approx(replay_policy.fixed_rate(rec, arm))


def test_a_policy_over_both_ends_near_the_faster_setting(tmp_path, capsys):
    rec = record()
    result = replay_policy.compare(rec, [0, 1], orders=3)
    assert result["best"] == pytest.approx(2 / 1.2)
    for rate in result["policies"].values():  # warmup and re-tries of plain decoding only
        assert 0.9 * result["best"] < rate <= result["best"]
    path = tmp_path / "steps.json"
    path.write_text(json.dumps(rec))
    assert replay_policy.main([str(path), "--subset", "0,1", "--subset", "1"]) == 0
    out = capsys.readouterr().out
    assert "settings [0, 1]:" in out and "settings [1]:" in out
    assert "fixed plain: 1.00 tok/s (0.600)" in out  # plain decoding named as bench_arms does
    assert "adaptive, per-arm averages: 1.67 tok/s (1.000 of the best)" in out  # [1] alone


def test_busy_replays_every_setting_slower_on_each_orders_second_prompt(tmp_path, capsys):
    """Six prompts of equal work, the second of each order twice as slow: every fixed rate is
    6/7 of its recorded one, and the policies are replayed under the same load."""
    rec = record()
    result = replay_policy.compare(rec, [0, 1], orders=3, busy=2.0)
    assert result["fixed"] == {0: pytest.approx(6 / 7), 1: pytest.approx(2 / 1.2 * 6 / 7)}
    for rate in result["policies"].values():
        assert 0.9 * result["best"] < rate <= result["best"]
    path = tmp_path / "steps.json"
    path.write_text(json.dumps(rec))
    assert replay_policy.main([str(path), "--busy", "2"]) == 0
    out = capsys.readouterr().out
    assert "with the second prompt 2x slower:" in out and out.count("settings [0, 1]:") == 2


def test_tokens_a_last_step_gains_past_the_kept_length_are_not_counted():
    """A generation of 5 tokens: plain decoding's 5 steps, a chain's steps of 3 and 3 (its last
    step gained a token that max_new_tokens cut). Fixed or replayed, the chain makes 5 tokens in
    its 2 s, with the length recorded or (older records) read from plain decoding's steps."""
    chain = [[0], [0, 0]]
    per_prompt = [steps([1] * 5, 1.0), steps([3, 3], 1.0, chain)]
    old = {"arms": [None, {"choices": chain}], "prompts": [per_prompt]}
    new = {**old, "lengths": [5]}
    for rec in (old, new):
        assert replay_policy.lengths(rec) == [5]
        assert replay_policy.fixed_rate(rec, 1) == pytest.approx(5 / 2)
        make, _ = replay_policy.POLICIES["shared path rates (default)"]
        assert replay_policy.replay(rec, make([{"choices": chain}]), [1], [0]) == pytest.approx(
            5 / 2
        )
    # a setting whose output parted from plain decoding's and ended sooner (bf16 on a GPU):
    # replayed to its own end, not charged its last step's time again for each missing token
    short = {
        "arms": old["arms"],
        "prompts": [[per_prompt[0], steps([3], 1.0, chain)]],
        "lengths": [5],
    }
    make, _ = replay_policy.POLICIES["per-arm averages"]
    assert replay_policy.replay(short, make([{"choices": chain}]), [1], [0]) == pytest.approx(3.0)
    # the record's length wins over the settings' steps (here no setting ended exactly)
    only_chain = {"arms": [{"choices": chain}], "prompts": [[per_prompt[1]]]}
    assert replay_policy.fixed_rate(only_chain, 0) == pytest.approx(6 / 2)
    assert replay_policy.fixed_rate({**only_chain, "lengths": [5]}, 0) == pytest.approx(5 / 2)


def test_a_dynamic_trees_ranked_paths_feed_the_shared_rates_only_when_told():
    """Steps recorded with `static` false (a dynamic tree's root ranking) feed the path rates,
    never the arm's shape; the variant without them feeds nothing."""
    dynamic, position = [], 0
    for n in [1, 2] * 10:  # the top-1 at the root right on every other step
        dynamic.append([position, n, 1.0, [[0], [1]], [0] if n == 2 else [], False])
        position += n
    rec = {"arms": [{"top_k": 2, "depth": 2, "total_tokens": 4}], "prompts": [[dynamic]]}
    for told in (True, False):
        make, _ = replay_policy.POLICIES["shared path rates (default)"]
        policy = make(rec["arms"])
        replay_policy.replay(rec, policy, [0], [0], dynamic_paths=told)
        assert policy.arms[0].nodes is None and policy.arms[0].tries == 20
        if told:  # 20 samples: a running mean
            assert policy._paths[(0,)] == [pytest.approx(0.5), 20]
            assert policy._paths[(1,)] == [0.0, 20]
        else:
            assert not policy._paths


def test_bad_records_and_subsets_are_clear_errors(tmp_path, capsys):
    path = tmp_path / "steps.json"
    path.write_text('{"arms": [null]}')
    assert replay_policy.main([str(path)]) == 2
    assert "not a record of `scripts/bench_arms.py --record`" in capsys.readouterr().err
    assert replay_policy.main([str(tmp_path / "missing.json")]) == 2
    path.write_text(json.dumps({**record(1), "lengths": [80, 80]}))
    assert replay_policy.main([str(path)]) == 2
    assert "its lengths and prompts differ in number" in capsys.readouterr().err
    rec = {"arms": [None, {"choices": "chain-2"}], "prompts": [[[[0, 1, 1.0, None, []]]]]}
    path.write_text(json.dumps(rec))  # the steps of one setting of two
    assert replay_policy.main([str(path)]) == 2
    assert "a prompt holds the steps of other than its 2 settings" in capsys.readouterr().err
    path.write_text(json.dumps({"arms": [None], "prompts": [[[[0, 1, 1.0]]]]}))
    assert replay_policy.main([str(path)]) == 2
    assert "a step holds fewer than 5 fields" in capsys.readouterr().err
    path.write_text(json.dumps(record(1)))
    for bad, message in [
        (["--subset", "0,2"], "--subset indices must be in 0..1"),
        (["--subset", "a"], "--subset takes indices"),
        (["--orders", "0"], "--orders must be >= 1"),
        (["--busy", "0"], "--busy must be > 0"),
    ]:
        with pytest.raises(SystemExit) as e:
            replay_policy.main([str(path), *bad])
        assert e.value.code == 2 and message in capsys.readouterr().err


CHAIN = [[0], [0, 0]]


class Scripted:
    """Stands in for a policy: chooses the arms of a script, records what it is told."""

    def __init__(self, choices):
        self.choices, self.told, self.greedy = list(choices), [], False

    def choose(self):
        return self.choices.pop(0)

    def update(self, *step, proposed=True):
        self.told.append((*step, proposed))


def test_a_step_that_began_earlier_counts_from_here_and_feeds_no_paths():
    """Plain decoding, then the chain joined mid-step (its tokens from here on, its whole time,
    no paths, no proposal of its own), then a chain step of its own whose token past the kept
    length is told but not counted."""
    chain = steps([3, 3], 1.2, CHAIN)
    rec = {"arms": [None, {"choices": CHAIN}], "prompts": [[steps([1] * 5, 1.0), chain]]}
    rec["lengths"] = [5]
    for told_dynamic in (True, False):  # a static tree's paths are fed either way
        policy = Scripted([0, 1, 1])
        rate = replay_policy.replay(rec, policy, [0, 1], [0], dynamic_paths=told_dynamic)
        assert rate == pytest.approx(5 / 3.4)
        assert policy.greedy is True
        assert policy.told == [
            (0, 1, 1.0, None, (), True, True),  # a 6-field record's step counts as drafted
            (1, 2, 1.2, None, (), True, False),
            (1, 3, 1.2, [(0,), (0, 0)], (0, 0), True, True),
        ]


def test_a_seven_field_record_says_which_steps_drafted():
    """Since 2026-12-07 a step records whether it drafted (a lookup that found nothing did
    not): the replay tells the policy so."""
    dry = [[i, 1, 1.0, None, [], True, False] for i in range(3)]
    rec = {"arms": [{"num_tokens": 3}], "prompts": [[dry]], "lengths": [3]}
    policy = Scripted([0, 0, 0])
    replay_policy.replay(rec, policy, [0], [0], dynamic_paths=True)
    assert [step[-1] for step in policy.told] == [False, False, False]


def test_five_field_records_are_static_trees_paths_and_all():
    rec = record(1)  # steps of 5 fields, as recorded before commit eeb0b09
    make, told = replay_policy.POLICIES["shared path rates of static trees' steps only"]
    policy = make([rec["arms"][1]])
    replay_policy.replay(rec, policy, [1], [0], dynamic_paths=told)
    assert policy.arms[0].nodes == frozenset({(0,), (0, 0)})
    assert policy._paths[(0,)][1] == 40


def test_busy_slows_the_second_prompt_of_the_order_not_the_first():
    """Prompt 0: 2 tokens, prompt 1: 4, at 1 s each; the second of order [0, 1] twice as slow:
    6 tokens in 2 + 8 s."""
    rec = {"arms": [None], "prompts": [[steps([1] * 2, 1.0)], [steps([1] * 4, 1.0)]]}
    make, _ = replay_policy.POLICIES["per-arm averages"]
    assert replay_policy.replay(rec, make([None]), [0], [0, 1], busy=2.0) == pytest.approx(0.6)
    assert replay_policy.replay(rec, make([None]), [0], [1, 0], busy=2.0) == pytest.approx(0.75)


def test_each_policy_is_replayed_over_orders_of_their_own(monkeypatch):
    orders = []
    real = replay_policy.replay

    def spy(record, policy, subset, order, *args):
        orders.append(tuple(order))
        return real(record, policy, subset, order, *args)

    monkeypatch.setattr(replay_policy, "replay", spy)
    replay_policy.compare(record(), [0, 1], orders=3)
    assert len(orders) == 3 * len(replay_policy.POLICIES)
    assert all(sorted(o) == list(range(6)) for o in orders)
    assert len(set(orders)) == 3  # three shuffles, not one three times


def test_the_policies_are_the_ones_they_are_named_for(monkeypatch):
    """On a record of a dynamic tree's steps, only the static-trees-only variant learns no path
    rates; per-arm averages keeps each arm's own; the short average smooths the seconds; the
    former policy never backs off an arm for its drafts never being accepted."""
    dynamic, position = [], 0
    for n in [1, 2] * 10:
        dynamic.append([position, n, 1.0, [[0], [1]], [0] if n == 2 else [], False])
        position += n
    rec = {"arms": [{"top_k": 2, "depth": 2, "total_tokens": 4}], "prompts": [[dynamic]]}
    policies = []
    real = replay_policy.replay

    def spy(record, policy, *args):
        policies.append(policy)
        return real(record, policy, *args)

    monkeypatch.setattr(replay_policy, "replay", spy)
    result = replay_policy.compare(rec, [0], orders=1)
    assert list(result["policies"]) == list(replay_policy.POLICIES)
    assert [bool(p._paths) for p in policies] == [True, False, True, True, True]
    assert [p.pooled for p in policies] == [False, True, True, True, True]
    assert [p.time_smoothing for p in policies] == [None, None, None, None, 0.25]
    default = AdaptivePolicy.idle_after
    assert [p.idle_after for p in policies] == [default, default, default, sys.maxsize, default]


def test_a_record_without_tokens_renders_zero_shares(tmp_path, capsys):
    path = tmp_path / "steps.json"
    path.write_text(json.dumps({"arms": [None], "prompts": [[[]]], "lengths": [0]}))
    assert replay_policy.main([str(path), "--orders", "1"]) == 0
    assert "fixed plain: 0.00 tok/s (0.000)" in capsys.readouterr().out


def test_a_record_without_prompts_is_a_clear_error(tmp_path, capsys):
    path = tmp_path / "steps.json"
    path.write_text(json.dumps({"arms": [None], "prompts": []}))
    assert replay_policy.main([str(path)]) == 2
    assert "it holds no prompts" in capsys.readouterr().err


def test_a_negative_subset_index_is_refused(tmp_path, capsys):
    path = tmp_path / "steps.json"
    path.write_text(json.dumps(record(1)))
    with pytest.raises(SystemExit) as e:
        replay_policy.main([str(path), "--subset", "-1"])
    assert e.value.code == 2 and "--subset indices must be in 0..1" in capsys.readouterr().err
