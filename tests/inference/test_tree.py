"""Trees from parents and from Medusa choices, checked against hand-drawn trees."""

import pytest
import torch

from inference.tree import (
    DEFAULT_ACCURACIES,
    PRESETS,
    StaticTree,
    build_static_tree,
    chain_choices,
    check_ranks,
    expected_accept_length,
    get_preset,
    rank_paths,
    tree_from_choices,
    tree_from_parents,
)

# root
# ├── 1 (0,) ── 3 (0,0) ── 6 (0,0,0)
# │          └─ 4 (0,1)
# └── 2 (1,) ── 5 (1,0)
CHOICES = [(0, 1), (1,), (0,), (0, 0, 0), (1, 0), (0, 0)]  # deliberately unsorted


def test_rank_paths_give_back_the_choices_of_a_static_tree_only():
    tree = tree_from_choices(CHOICES)
    assert rank_paths(tree) == [(), (0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    assert rank_paths(tree_from_parents([-1, 0, 0, 1])) is None  # a dynamic tree has no ranks


def test_tree_from_choices_hand_drawn():
    tree = tree_from_choices(CHOICES)
    assert tree.num_nodes == 7 and tree.depth == 3
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 2, 3]
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert tree.ranks.tolist() == [-1, 0, 1, 0, 1, 0, 0]
    expected_ancestors = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0, 0],
            [1, 1, 0, 1, 0, 0, 0],
            [1, 1, 0, 0, 1, 0, 0],
            [1, 0, 1, 0, 0, 1, 0],
            [1, 1, 0, 1, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(tree.ancestors, expected_ancestors)
    # one path per leaf, leaves (4, 5, 6) in index order
    assert tree.paths.tolist() == [[0, 1, 4, -1], [0, 2, 5, -1], [0, 1, 3, 6]]
    assert tree.children(0) == [1, 2] and tree.children(1) == [3, 4] and tree.children(6) == []


def test_static_tree_levels_hand_drawn():
    plan = StaticTree.build(CHOICES)
    levels = [(nodes.tolist(), frontier.tolist()) for nodes, frontier in plan.levels]
    # depth 1: nodes 1, 2, both with children; depth 2: 3, 4, 5, of which only 3 has a child
    assert levels == [([1, 2], [1, 2]), ([3, 4, 5], [3]), ([6], [])]
    assert plan.top == 2  # ranks 0 and 1
    assert StaticTree.build("chain-2").levels[-1][1].numel() == 0  # a leaf level has no frontier


def test_tree_from_parents_matches_choices_and_keeps_dtype_device():
    tree = tree_from_parents(torch.tensor([-1, 0, 0, 1, 1, 2, 3]))
    ref = tree_from_choices(CHOICES)
    for name in ("parents", "depths", "ancestors", "paths"):
        assert torch.equal(getattr(tree, name), getattr(ref, name))
    assert tree.ranks is None
    assert tree.parents.dtype == tree.depths.dtype == tree.paths.dtype == torch.long


def test_root_only_tree():
    tree = tree_from_parents([-1])
    assert tree.depth == 0 and tree.paths.tolist() == [[0]]
    assert tree.ancestors.tolist() == [[True]]


@pytest.mark.parametrize(
    "parents, match",
    [
        ([], "parents\\[0\\]"),
        ([0, 0], "parents\\[0\\]"),
        ([-1, 0, 2], "parents\\[2\\]"),
        ([-1, -1], "parents\\[1\\]"),
    ],
)
def test_tree_from_parents_rejects_bad_parents(parents, match):
    with pytest.raises(ValueError, match=match):
        tree_from_parents(parents)


def test_choices_validation():
    with pytest.raises(ValueError, match=r"\(0, 1, 2\) needs its prefix \(0, 1\)"):
        tree_from_choices([(0,), (0, 1, 2)])
    with pytest.raises(ValueError, match="duplicate"):
        tree_from_choices([(0,), (0,)])
    with pytest.raises(ValueError, match="negative"):
        tree_from_choices([(0,), (0, -1)])


def test_chain_choices():
    assert chain_choices(3) == [(0,), (0, 0), (0, 0, 0)]
    assert tree_from_choices(chain_choices(3)).parents.tolist() == [-1, 0, 1, 2]


def test_build_static_tree_hand_computed():
    # values: (0,) .5, (0,0) .3, (1,) .2, (0,1) .15, (1,0) .12, (1,1) .06
    acc = [[0.5, 0.2], [0.6, 0.3]]
    assert build_static_tree(acc, 1) == []
    assert build_static_tree(acc, 4) == [(0,), (1,), (0, 0)]
    assert build_static_tree(acc, 6) == [(0,), (1,), (0, 0), (0, 1), (1, 0)]
    assert expected_accept_length(acc, [(0,), (1,), (0, 0)]) == pytest.approx(2.0)
    assert len(build_static_tree(acc, 7)) == 6
    with pytest.raises(ValueError, match="num_nodes"):
        build_static_tree(acc, 8)


def test_build_static_tree_needs_parent_first():
    # (1, 0) is worth more than (1,) here (accuracy > 1 is not physical, but it isolates the
    # rule): it may only enter after its parent.
    acc = [[0.5, 0.1], [2.0]]
    assert build_static_tree(acc, 3) == [(0,), (0, 0)]
    assert build_static_tree(acc, 4) == [(0,), (1,), (0, 0)]


@pytest.mark.parametrize(
    "name, nodes",
    [("chain-3", 4), ("chain-4", 5), ("cpu-8", 8), ("cpu-16", 16), ("cpu-24", 24), ("gpu-60", 60)],
)
def test_presets_have_advertised_sizes(name, nodes):
    tree = tree_from_choices(get_preset(name))
    assert tree.num_nodes == nodes
    assert tree.depth <= len(DEFAULT_ACCURACIES)


def test_presets_grow_expected_length_and_unknown_name_lists_valid_ones():
    lengths = [
        expected_accept_length(DEFAULT_ACCURACIES, PRESETS[n])
        for n in ("cpu-8", "cpu-16", "cpu-24", "gpu-60")
    ]
    assert lengths == sorted(lengths) and 2 < lengths[0] < lengths[-1] < 4
    with pytest.raises(ValueError, match="cpu-16"):
        get_preset("cpu-17")


@pytest.mark.parametrize("name, nodes", [("cpu-8", 8), ("cpu-16", 16), ("gpu-60", 60)])
@pytest.mark.parametrize("num_heads", [2, 3])
def test_sized_presets_fit_fewer_heads(name, nodes, num_heads):
    tree = tree_from_choices(get_preset(name, num_heads))
    assert tree.num_nodes == nodes
    assert tree.depth <= num_heads
    assert get_preset(name, 4) == PRESETS[name]


def test_sized_preset_too_big_for_one_head_names_it():
    assert tree_from_choices(get_preset("cpu-8", 1)).depth == 1  # head 0's top 7
    with pytest.raises(ValueError, match="'cpu-16' does not fit 1 head"):
        get_preset("cpu-16", 1)


def test_check_ranks_refuses_a_rank_equal_to_the_vocabulary_size():
    tree = tree_from_choices([(0,), (1,), (2,), (3,)])  # needs the rank-3 token: 4 tokens
    check_ranks(tree, 4, "the heads")
    with pytest.raises(ValueError, match="rank-3 token, but the vocabulary of the heads has 3"):
        check_ranks(tree, 3, "the heads")


def test_build_static_tree_ties_go_to_the_shallower_choice():
    # (0,), (1,) and (0, 0) are all worth 0.5: after (0,), the shallower (1,) comes first
    accuracies = [[0.5, 0.5], [1.0]]
    assert build_static_tree(accuracies, 3) == [(0,), (1,)]
    assert build_static_tree(accuracies, 4) == [(0,), (1,), (0, 0)]


def test_a_depth_two_choice_without_its_first_rank_is_refused():
    with pytest.raises(ValueError, match=r"choice \(1, 0\) needs its prefix \(1,\)"):
        tree_from_choices([(0,), (1, 0)])
