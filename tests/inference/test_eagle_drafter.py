"""The EAGLE drafter: the dynamic tree rebuilt from a reference that reads no drafter state (which
nodes are expanded, which candidates are kept), the draft's outputs at each frontier (its tree
mask and positions), the size bounds, depth 0 and a one-node tree."""

import pytest
import torch

from heads import EagleConfig, EagleDraft
from inference import Sampling, SpeculativeGenerator
from inference.drafters.eagle import EagleDrafter
from tests.conftest import make_tiny_llama
from tests.inference.test_drafter_trees import _draft_reference, proposals


def _opinionated_draft(base, version: int) -> EagleDraft:
    draft = EagleDraft(EagleConfig.from_base(base.config, version=version))
    torch.manual_seed(3)
    for p in draft.parameters():  # a draft with opinions, so that ranks and scores differ
        p.data.normal_(0, 0.5)
    return draft


def _token_paths(draft) -> set[tuple[int, ...]]:
    parents, tokens = draft.tree.parents.tolist(), draft.tokens.tolist()
    out = set()
    for node in range(1, len(parents)):
        path, j = [], node
        while j > 0:
            path.append(tokens[j])
            j = parents[j]
        out.add(tuple(reversed(path)))
    return out


class _Reference:
    """The draft's outputs after any path of tokens below the root, computed from the whole
    sequence without a draft cache (the node's ancestors fed causally)."""

    def __init__(self, drafter, base, sequence):
        self.drafter, self.base, self.sequence = drafter, base, sequence
        out, self.features = _draft_reference(drafter, base, sequence)
        self.hidden = {(): out[-1]}

    def __call__(self, path: tuple[int, ...]) -> torch.Tensor:
        if path not in self.hidden:
            fed = [self(path[:i]) for i in range(len(path))]  # root, then each ancestor
            ids = torch.cat([self.sequence[1:], torch.tensor(path)])[None]
            feats = torch.cat([self.features, torch.stack(fed)])[None]
            emb = self.base.get_input_embeddings()(ids)
            self.hidden[path] = self.drafter.draft(emb, feats, torch.arange(ids.shape[1])[None])[
                0, -1
            ]
        return self.hidden[path]

    def children(self, path, score, k):
        lp = self.drafter._log_probs(self(path)[None])[0]
        top = lp.topk(k)
        ids = self.drafter.draft.to_base_ids(top.indices)
        return [(path + (int(t),), score + v) for t, v in zip(ids, top.values)]


@torch.no_grad()
def _eagle2_tree(drafter, base, sequence, top_k, depth, total_tokens):
    """EAGLE-2's tree by its definition: the root's top k; then depth - 1 times the top k
    children of each frontier node (the top k of the last level by cumulative log-probability);
    keep the total_tokens - 1 best candidates."""
    ref = _Reference(drafter, base, sequence)
    level = ref.children((), torch.zeros(()), top_k)
    candidates = list(level)
    frontier = level
    for _ in range(1, depth):
        level = [c for path, score in frontier for c in ref.children(path, score, top_k)]
        candidates += level
        frontier = sorted(level, key=lambda c: -float(c[1]))[:top_k]
    kept = sorted(candidates, key=lambda c: -float(c[1]))[: total_tokens - 1]
    return {path for path, _ in kept}


@pytest.mark.parametrize("total_tokens", [6, 11])
def test_a_dynamic_tree_is_eagle2s_tree_of_the_draft_outputs(total_tokens):
    # 11: every candidate kept, so the tree shows which level-2 nodes were expanded (the best
    # two by cumulative log-probability); 6: the reranking keeps the best five of ten.
    base = make_tiny_llama()
    drafter = EagleDrafter(_opinionated_draft(base, 3), base, 2, 3, total_tokens)
    seen, _ = proposals(EagleDrafter, SpeculativeGenerator(base, drafter, adaptive=False))
    for sequence, proposal in seen:
        assert proposal.tree.num_nodes == total_tokens <= drafter.max_nodes
        want = _eagle2_tree(drafter, base, sequence, 2, 3, total_tokens)
        assert _token_paths(proposal) == want


@pytest.mark.parametrize("version", [1, 3])
def test_each_frontier_forward_gives_the_drafts_output_after_the_nodes_whole_path(version):
    # Four levels: the third frontier attends to two cached ancestors and skips cached
    # non-ancestors; outputs compared directly (a wrong mask can leave the top tokens alone).
    base = make_tiny_llama()
    drafter = EagleDrafter(_opinionated_draft(base, version), base, 2, 4, 15)
    calls = []  # per frontier forward: (frontier, candidate tokens, parents, outputs)
    forward = EagleDrafter._forward_frontier

    def spy(self, d, frontier, all_tokens, all_parents, frontier_hidden, cached):
        out = forward(self, d, frontier, all_tokens, all_parents, frontier_hidden, cached)
        calls.append((frontier.tolist(), all_tokens.tolist(), all_parents.tolist(), out.clone()))
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(EagleDrafter, "_forward_frontier", spy)
        seen, _ = proposals(EagleDrafter, SpeculativeGenerator(base, drafter, adaptive=False))
    assert len(calls) == 3 * len(seen)  # depth - 1 forwards per proposal
    with torch.no_grad():
        for i, (sequence, _) in enumerate(seen):
            ref = _Reference(drafter, base, sequence)
            for frontier, tokens, parents, out in calls[3 * i : 3 * i + 3]:
                for row, c in enumerate(frontier):
                    path, j = [], c
                    while j >= 0:
                        path.append(tokens[j])
                        j = parents[j] - 1
                    want = ref(tuple(reversed(path)))
                    error = float((out[row] - want).norm() / want.norm())
                    assert error < 1e-3, (path, error)


def test_max_nodes_is_the_largest_tree_the_settings_can_make():
    base = make_tiny_llama()
    drafter = EagleDrafter(
        EagleDraft(EagleConfig.from_base(base.config, version=1)), base, 2, 3, 100
    )
    assert drafter.max_nodes == drafter.total_tokens == 1 + 2 + 2 * 2 * 2
    drafter.configure(top_k=3, depth=2, total_tokens=100)
    assert drafter.max_nodes == 1 + 3 + 3 * 3


def _observe_prompt(drafter, base, sequence):
    hidden = base.model(input_ids=sequence[None]).last_hidden_state[0]
    drafter.reset()
    drafter.observe(sequence, hidden, None, int(sequence[-1]))


@torch.no_grad()
@pytest.mark.parametrize(
    "options", [{"depth": 0, "total_tokens": 5}, {"depth": 3, "total_tokens": 1}]
)
def test_a_root_only_tree_takes_no_frontier_forward(options):
    """depth 0 (a valid setting: plain decoding through the drafter) and total_tokens 1 both
    draft the root alone: one draft forward per step (feeding the accepted tokens), none over a
    frontier."""
    base = make_tiny_llama()
    draft = EagleDraft(EagleConfig.from_base(base.config, version=1))
    drafter = EagleDrafter(draft, base, top_k=2, **options)
    assert drafter.max_nodes == 1
    calls = []
    hook = draft.register_forward_hook(lambda *_: calls.append(1))
    sequence = torch.randint(3, 256, (9,), generator=torch.Generator().manual_seed(0))
    _observe_prompt(drafter, base, sequence)
    proposal = drafter.propose(sequence, Sampling())
    hook.remove()
    assert proposal.tokens.tolist() == [int(sequence[-1])]
    assert len(calls) == 1
    prompt = sequence[None, :6]
    gen = SpeculativeGenerator(base, draft, top_k=2, **options)
    ref = base.generate(prompt, max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert torch.equal(gen.generate(prompt, max_new_tokens=6, eos_token_id=[]).sequences, ref)
