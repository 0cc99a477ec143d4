"""The decode loop: draft a tree, verify it in one forward of the unmodified base, accept.

This is the only module that calls the base model in a loop. Per step:

1. the drafter proposes a tree rooted at the last chosen token;
2. one forward of the stock transformers model over the N tree nodes, with a 4D additive tree
   mask and `position_ids = prefix_len + depth` (SpecInfer, Miao et al. 2024; Medusa, Cai et
   al. 2024);
3. acceptance (greedy, lossless sampling, or opt-in lossy typical acceptance);
4. the KV cache keeps the prefix plus the accepted path; the accepted nodes' hidden states go to
   the drafter, and the bonus token (drawn from the base at the last accepted node, no extra
   forward) becomes the next root.
"""

from __future__ import annotations

import operator
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import nullcontext

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel

from heads.base import check_model, input_device, layer_inputs
from heads.cpu import repack_stale
from inference.acceptance import (
    Acceptance,
    verify_greedy_walk,
    verify_sampling,
    verify_sampling_walk,
    verify_typical,
    warp_probs,
)
from inference.adaptive import AdaptivePolicy, check_arms
from inference.arguments import (
    check_generation_arguments,
    check_token_ids,
    eos_ids,
    refuse_other_arguments,
    warn_pad_in_prompt,
)
from inference.base_checks import (
    PositionRules,
    base_logits,
    check_base_takes_trees,
    position_rules,
    warn_unapplied_logits_settings,
)
from inference.draft import Draft, Drafter, Sampling
from inference.drafters import make_drafter
from inference.kv_cache import keep_accepted
from inference.mask import grouped_kv_attention, tree_attention_mask, tree_position_ids
from inference.output import GenerationOutput
from inference.prompt import prompt_ids, prompt_tensor
from inference.stopping import Stopping
from inference.tree import rank_paths, tree_from_parents

# A CPU reads the whole lm_head weight once per call whatever its rows: SmolLM2's (49k x 576,
# prepacked) took 4.2-5.9 ms for 1 to 16 rows, 10.6 ms for 32 and 18.9 ms for 64 (2 cores,
# median of 30). Row by row a step makes tau one-row calls, so one N-row call is cheaper when
# cost(N) < tau * cost(1): from tau 1.4 at 16 rows, 2.5 at 32. Trees up to this many nodes
# compute every row in one call; larger ones only the rows visited.
DENSE_LOGITS_MAX_NODES = 16


class SpeculativeGenerator:
    """Lossless speculative generation for a frozen base with any drafter.

    Args:
        base: a transformers causal LM (unmodified; sdpa or eager attention).
        heads_or_drafter: MedusaHeads, EagleDraft, a small draft model with the same
            vocabulary, a `Drafter`, or None for n-gram prompt lookup; or a list of these,
            verified together as the union of their trees (`[heads, None]`: the heads plus
            n-gram prompt lookup).
        lazy_logits: compute the base's lm_head only for the tree nodes the verifier visits,
            one row per call, instead of for every node in one call. The default (None) does
            so on a CPU for trees over `DENSE_LOGITS_MAX_NODES` nodes; True for every tree,
            False never.
        adaptive: choose, step by step, the drafter setting or plain decoding with the most
            measured tokens/s (`inference.adaptive`). True uses the drafter's `default_arms`
            (with `drafter_options`: those settings and plain decoding), a list gives the arms
            (`[None, {}]`: a drafter object's settings and plain decoding); the default is on
            unless options or drafter objects fix the settings.
            The measurements carry over from one generate call to the next (`.policy`; set it
            to None, or assign other `.arms`, to start afresh). Every arm is lossless; with
            sampling, the same seed reproduces the same text only with fixed settings (arm
            choices follow timings).
        **drafter_options: e.g. `choices="cpu-8"` (Medusa), `top_k=4, depth=4, total_tokens=12`
            (EAGLE), `num_tokens=4` (draft model, n-gram), `choices=[[0], [1], [0, 0]]`
            (a draft model's static tree).
    """

    def __init__(
        self,
        base: PreTrainedModel,
        heads_or_drafter=None,
        *,
        lazy_logits: bool | None = None,
        adaptive: bool | list[dict | None] | None = None,
        **drafter_options,
    ) -> None:
        check_model(base)
        check_base_takes_trees(base)
        warn_unapplied_logits_settings(base)
        # load_base's prepacked CPU weights, changed since (an adapter merged into the base)
        repack_stale(base)
        if isinstance(heads_or_drafter, nn.Module):
            repack_stale(heads_or_drafter)
        self.base = base
        self.drafter = make_drafter(base, heads_or_drafter, **drafter_options)
        self._configured: dict | None = None  # the adaptive arm's options the drafter holds
        # the base's logits as its forward computes them (lm_head, and Granite's / Cohere's scale)
        self.lm_head = base_logits(base)
        device = self._device = input_device(base)
        # Trees of more nodes than this verify row by row (lazily); None: never.
        self.dense_logits_max_nodes: int | None
        if lazy_logits is None:
            self.dense_logits_max_nodes = DENSE_LOGITS_MAX_NODES if device.type == "cpu" else None
        else:
            self.dense_logits_max_nodes = 1 if lazy_logits else None
        # Adaptive by default, unless the caller fixed the drafter's settings (options, or a
        # drafter object built by the caller).
        if adaptive is None:
            members = (
                heads_or_drafter
                if isinstance(heads_or_drafter, (list, tuple))
                else [heads_or_drafter]
            )
            adaptive = not drafter_options and not any(isinstance(m, Drafter) for m in members)
        self.arms = None
        if adaptive is True:
            # with options: those settings, or plain decoding where they do not pay. A drafter
            # object takes the drafter's own arms: it may be built for what options cannot say
            # (an n-gram drafter's corpus)
            self.arms = [None, {}] if drafter_options else self.drafter.default_arms(device)
        elif adaptive:
            self.arms = adaptive
        # Built at the first generation and kept: later calls start from what it measured.
        self.policy: AdaptivePolicy | None = None
        self._root_only = tree_from_parents([-1], device=device)

    @property
    def arms(self) -> list[dict | None] | None:
        """The adaptive policy's settings (None: plain decoding; `{}`: the drafter as built), or
        None for fixed settings. Assigning others starts the measurements afresh."""
        return self._arms

    @arms.setter
    def arms(self, arms: Sequence[dict | None] | None) -> None:
        if arms is not None:
            arms = check_arms(arms)
            for options in arms:  # now, not when the policy first tries the arm
                if options:
                    try:
                        self.drafter.check_options(**options)
                    except (TypeError, ValueError, NotImplementedError) as e:
                        raise ValueError(f"adaptive arm {options}: {e}") from e
        self._arms = arms

    # -- one forward of the base --------------------------------------------------------------
    def _forward(self, input_ids, cache, attention_mask=None, position_ids=None):
        """(T,) tokens -> (last hidden (T,H), aux (T,3H) or None)."""
        aux_ids = self.drafter.aux_layer_ids
        masked = attention_mask is not None  # a tree: one token or a prompt is the model's own
        with (
            layer_inputs(self.base, aux_ids) as entering,  # EAGLE-3's, and only those
            grouped_kv_attention(self._device) if masked else nullcontext(),
        ):
            out = self.base.model(
                input_ids=input_ids[None],
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=True,
            )
        # a base dispatched over devices (accelerate's device_map) gives each layer's states
        # on its layer's device: the loop and the drafter work on the device of its inputs
        hidden = out.last_hidden_state[0].to(self._device)
        aux = (
            torch.cat([entering[i][0].to(self._device) for i in aux_ids], dim=-1)
            if aux_ids
            else None
        )
        return hidden, aux

    def _tree_fits(self, prefix: int, nodes: int, max_positions: int, rules: PositionRules) -> bool:
        """Whether a tree of `nodes` may verify after `prefix` cached tokens, or a plain step
        must: near the end of the base's context (plain steps to it), past a draft model's
        own, across a longrope switch (`PositionRules`: HF's one-token steps rotate the tokens
        before it with the short factors), and at the Phi-3 family's recompute."""
        return not (
            prefix + nodes + 1 > max_positions
            or not self.drafter.fits(prefix + 1)  # the root is not cached yet
            or prefix == rules.recompute_at
            or any(prefix < p <= prefix + nodes - 1 for p in rules.crossings)
        )

    def _verify(
        self, draft, hidden: torch.Tensor, sampling: Sampling, acceptance: str
    ) -> Acceptance:
        """Accept a prefix path of the draft tree from the base's last hidden states (N,H)."""
        tokens, tree = draft.tokens, draft.tree
        if acceptance == "typical" and not sampling.greedy:
            return verify_typical(
                tokens,
                self.lm_head(hidden),
                tree,
                sampling.temperature,
                generator=sampling.generator,
            )
        if self.dense_logits_max_nodes is not None and tree.num_nodes > self.dense_logits_max_nodes:
            rows: dict[int, torch.Tensor] = {}

            def row(i: int) -> torch.Tensor:
                if i not in rows:
                    logits = self.lm_head(hidden[i])
                    rows[i] = logits if sampling.greedy else self._warp(logits, sampling)
                return rows[i]

            if sampling.greedy:
                return verify_greedy_walk(tokens, tree, row)
            return verify_sampling_walk(
                tokens,
                tree,
                row,
                draft.draft_probs,
                draft.sampled,
                sampling.generator,
                draft.q_rows,
            )
        logits = self.lm_head(hidden)
        if sampling.greedy:  # the rows on the accepted path only: on a CPU one argmax over
            # (N, V) costs more than tau over (V,) (0.45 against 0.07 ms a row for SmolLM2)
            return verify_greedy_walk(tokens, tree, logits.__getitem__)
        return verify_sampling(
            tokens,
            self._warp(logits, sampling),
            tree,
            draft.draft_probs,
            draft.sampled,
            sampling.generator,
            draft.q_rows,
        )

    @staticmethod
    def _warp(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
        return warp_probs(logits.float(), sampling.temperature, sampling.top_k, sampling.top_p)

    def _choose(self, logits: torch.Tensor, sampling: Sampling) -> int:
        if sampling.greedy:
            return int(logits.argmax())
        return int(torch.multinomial(self._warp(logits, sampling), 1, generator=sampling.generator))

    @torch.no_grad()
    def stream(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = 0,
        eos_token_id: int | Sequence[int] | None = None,
        stop_strings: Sequence[str] | None = None,
        tokenizer=None,
        acceptance: str = "lossless",
        stats: dict | None = None,
        attention_mask: torch.Tensor | None = None,
        **others,
    ) -> Iterator[list[int]]:
        """Yield the new tokens of every step (the first yield is the prefill's token).

        `stats`, when given, receives `accepted_lengths`, `tree_sizes`, `timings` and `finished` as
        it goes.
        See `generate` for the arguments. Streams of one generator share its drafter: several
        interleaved stay exact, but each drafts from the state the others left (the drafter
        keeps one sequence's), so they speculate worse than one at a time; give each
        concurrent stream its own generator.
        """
        refuse_other_arguments(others, "stream")
        ids = prompt_ids(input_ids, attention_mask)
        max_new_tokens, stop_strings = check_generation_arguments(
            max_new_tokens, temperature, top_k, top_p, acceptance, stop_strings, tokenizer, seed
        )
        check_token_ids(ids, self.base)
        max_positions = self.base.config.max_position_embeddings
        rules = position_rules(self.base.config)
        if len(ids) > max_positions:
            raise ValueError(
                f"the prompt has {len(ids)} tokens, more than the base's context of "
                f"{max_positions} positions: shorten it"
            )
        device = self._device
        ids = ids.to(device)
        eos = eos_ids(self.base, eos_token_id)
        warn_pad_in_prompt(self.base, ids, attention_mask, eos)
        generator = None
        if seed is not None:
            generator = torch.Generator(device=device).manual_seed(operator.index(seed))
        sampling = Sampling(temperature, top_k, top_p, generator)
        stats = {} if stats is None else stats
        stats.update(accepted_lengths=[], tree_sizes=[], finished=False)
        timings = stats["timings"] = dict.fromkeys(
            ("base", "draft", "other", "total", "prefill_base", "prefill_draft"), 0.0
        )
        t_start = time.perf_counter()

        cache = DynamicCache(config=self.base.config)
        t0 = time.perf_counter()
        hidden, aux = self._forward(ids, cache)
        root = self._choose(self.lm_head(hidden[-1]), sampling)
        timings["base"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        self.drafter.reset()
        self.drafter.observe(ids, hidden, aux, root)
        timings["draft"] += time.perf_counter() - t0
        timings["prefill_base"], timings["prefill_draft"] = timings["base"], timings["draft"]
        sequence = torch.cat([ids, ids.new_tensor([root])])
        stopping = Stopping(ids.tolist(), max_new_tokens, eos, stop_strings or [], tokenizer)
        first, done = stopping.cut([root])
        stats["finished"] = stopping.finished
        yield first
        if self.arms and (
            self.policy is None or [a.options for a in self.policy.arms] != list(self.arms)
        ):  # first call, or the caller changed `.arms`: measure afresh
            self.policy = AdaptivePolicy.from_options(self.arms)
        policy = self.policy if self.arms else None
        if policy:
            policy.greedy = sampling.greedy
        # The drafter is shared by every stream of this generator: which settings it holds is
        # the generator's to know, not this stream's (another may have configured it since).
        self._configured = None
        paths_of = paths = tree_nodes = None  # the latest static tree's nodes as paths of ranks
        after_plain = True  # the prefill, like a plain step, leaves the drafter to catch up
        drafted_yet = False
        while not done:
            prefix = cache.get_seq_length()
            arm = policy.choose() if policy else -1
            options = policy.arms[arm].options if policy else {}
            reconfigured = bool(options) and options is not self._configured
            if reconfigured:
                self.drafter.configure(**options)
                self._configured = options
            nodes = 1 if options is None else self.drafter.max_nodes
            if options is not None and not self._tree_fits(prefix, nodes, max_positions, rules):
                options, nodes, arm = None, 1, None
            recompute = prefix == rules.recompute_at
            if options is not None and (after_plain or reconfigured):
                # Feeding the plain steps' tokens to a drafter with its own cache costs more the
                # longer the run of plain steps: not a cost of this step's setting. So does a
                # union member's, switched on again by this setting after steps without it.
                t0 = time.perf_counter()
                if after_plain:
                    self.drafter.catch_up(sequence)
                else:
                    self.drafter.catch_up_switched_on(sequence)
                caught_up = time.perf_counter() - t0
                timings["draft"] += caught_up
                if not drafted_yet:  # the drafter's first pass over the prompt
                    timings["prefill_draft"] += caught_up
            drafted_yet = drafted_yet or options is not None
            after_plain = options is None
            t_step = t0 = time.perf_counter()
            if prefix + nodes + 1 > max_positions:
                warnings.warn(
                    f"generation stopped at the base's context length ({max_positions} positions) "
                    f"after {len(stopping.generated)} of max_new_tokens={max_new_tokens} tokens",
                    stacklevel=3,
                )
                break
            if options is None:  # plain decoding: the root alone, one token per step
                draft = Draft(
                    self._root_only, sequence[-1:], torch.zeros(1, dtype=torch.bool, device=device)
                )
            else:
                draft = self.drafter.propose(sequence, sampling)
            timings["draft"] += time.perf_counter() - t0
            mask = positions = None  # one token: the model's own causal path (and fast kernels)
            if draft.tree.num_nodes > 1:
                mask = tree_attention_mask(draft.tree, prefix, hidden.dtype)
                positions = tree_position_ids(draft.tree, prefix)
            t0 = time.perf_counter()
            if recompute:  # the whole sequence, the root last, in one forward
                cache = DynamicCache(config=self.base.config)
                hidden, aux = self._forward(sequence, cache)
                hidden, aux = hidden[-1:], None if aux is None else aux[-1:]
            else:
                hidden, aux = self._forward(draft.tokens, cache, mask, positions)
            acc = self._verify(draft, hidden, sampling, acceptance)
            timings["base"] += time.perf_counter() - t0
            keep_accepted(cache, prefix, acc.nodes)
            accepted = draft.tokens[acc.nodes]
            t0 = time.perf_counter()
            self.drafter.observe(
                accepted,
                hidden[acc.nodes],
                None if aux is None else aux[acc.nodes],
                acc.bonus_token,
            )
            timings["draft"] += time.perf_counter() - t0
            new = accepted[1:].tolist() + [acc.bonus_token]
            if policy and arm is not None:
                seconds = time.perf_counter() - t_step
                drafted, deepest, static, proposed = None, (), True, draft.tree.num_nodes > 1
                if sampling.greedy and options is not None:  # paths of ranks, if any
                    if draft.tree is not paths_of:
                        paths_of, paths = draft.tree, rank_paths(draft.tree)
                        tree_nodes = paths and paths[1:]  # the drafted nodes, root left out
                    if paths is not None:
                        drafted, deepest = tree_nodes, paths[int(acc.nodes[-1])]
                    elif draft.root_ranking is not None:  # a dynamic tree: its root's top k
                        ranking = draft.root_ranking.tolist()  # new[0]: the base's token there
                        drafted, static = [(j,) for j in range(len(ranking))], False
                        deepest = (ranking.index(new[0]),) if new[0] in ranking else ()
                policy.update(arm, len(new), seconds, drafted, deepest, static, proposed)
            new, done = stopping.cut(new)
            stats["finished"] = stopping.finished
            stats["accepted_lengths"].append(len(new))
            stats["tree_sizes"].append(draft.tree.num_nodes)
            sequence = torch.cat([sequence, sequence.new_tensor(new)])
            yield new
        timings["total"] = time.perf_counter() - t_start
        timings["other"] = timings["total"] - timings["base"] - timings["draft"]

    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = 0,
        eos_token_id: int | Sequence[int] | None = None,
        stop_strings: Sequence[str] | None = None,
        tokenizer=None,
        acceptance: str = "lossless",
        attention_mask: torch.Tensor | None = None,
        streamer=None,
        **others,
    ) -> GenerationOutput:
        """Generate up to `max_new_tokens` tokens after `input_ids` ((1,T) or (T,)).

        temperature 0 is greedy: the output equals `base.generate(do_sample=False)` token for
        token (without logits settings of its generation_config such as repetition_penalty,
        which the generator does not apply: it warns when the base has some). temperature > 0
        samples from the base's warped distribution (temperature, then top_k, then top_p)
        exactly, whatever the drafter proposes. `acceptance="typical"` is
        Medusa's typical acceptance: faster at high temperature but LOSSY (opt-in).
        `eos_token_id` defaults to the base's generation config; `stop_strings` need `tokenizer`.
        `attention_mask` (a tokenizer's, so `generate(**inputs)` works) must be all ones: one
        sequence, no padding. `streamer` (transformers' `TextStreamer`,
        `TextIteratorStreamer` or another with `put` and `end`) is given the prompt, then each
        step's new tokens, then `end()`, as HF `generate` gives them. HF `generate`'s other
        arguments are refused with what to give instead.
        """
        refuse_other_arguments(others, "generate")
        if streamer is not None and not all(
            callable(getattr(streamer, m, None)) for m in ("put", "end")
        ):
            raise TypeError(
                f"streamer={streamer!r} has no put() and end(): give a transformers streamer "
                "(TextStreamer(tokenizer), TextIteratorStreamer) or iterate over gen.stream()"
            )
        stats: dict = {}
        prompt = prompt_tensor(input_ids)  # (1,T) or (T,); stream refuses other shapes
        new: list[int] = []
        steps = self.stream(
            input_ids,
            max_new_tokens,
            temperature,
            top_p,
            top_k,
            seed,
            eos_token_id,
            stop_strings,
            tokenizer,
            acceptance,
            stats,
            attention_mask,
        )
        for i, step in enumerate(steps):
            if streamer is not None:
                if i == 0:  # after stream's checks of the prompt and arguments
                    streamer.put(prompt.reshape(1, -1).cpu())
                streamer.put(torch.tensor(step, dtype=torch.long))
            new.extend(step)
        if streamer is not None:
            streamer.end()
        tail = torch.tensor([new], dtype=torch.long, device=self._device)
        sequences = torch.cat([prompt.reshape(1, -1).to(self._device), tail], dim=1)
        keys = ("accepted_lengths", "timings", "finished", "tree_sizes")
        return GenerationOutput(sequences, *(stats[k] for k in keys))
