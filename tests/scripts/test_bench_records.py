"""scripts/bench.py's records and report: what a method's timed runs add up to (and what its
untimed warm-up leaves them), and how the identical share reads."""

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import bench  # noqa: E402  (scripts/ is not a package)
import bench_report  # noqa: E402


def test_every_timed_run_is_checked_and_pooled(smollm2_tokenizer):
    """With --runs R each run's tokens are compared with the baseline's (an adaptive
    generator's trees, and so its steps, may differ between runs), and tau pools every run."""
    from bench_methods import Method, Run

    runs: dict[str, int] = {}

    def method(name: str, kind: str, outputs: list[Run]) -> Method:
        def generate(ids, seed, max_new_tokens=None):
            runs[name] = runs.get(name, 0) + 1
            return outputs[(runs[name] - 1) % len(outputs)]

        return Method(name, kind, generate, torch.device("cpu"), True)

    timings = {"base": 0.0, "draft": 0.0, "other": 0.0, "total": 1.0}
    methods = [
        method("baseline", "baseline", [Run([1, 2, 3, 4])]),
        method("steady", "ngram", [Run([1, 2, 3, 4], [2, 2], timings)]),
        method(  # the second run parts from the baseline
            "parting",
            "ngram",
            [Run([1, 2, 3, 4], [4], timings), Run([1, 2, 3, 9], [1, 1, 1, 1], timings)],
        ),
    ]
    prompts = [bench.BenchPrompt(0, 0, "c", "x", [], ["Hi"])]
    records = bench.run_bench(prompts, methods, smollm2_tokenizer, 2, 0)
    by_name = {r["method"]: r for r in records}
    assert by_name["steady"]["identical"] is True and by_name["steady"]["tau"] == 2.0
    assert by_name["parting"]["identical"] is False
    assert by_name["parting"]["tau"] == 8 / 5 and by_name["parting"]["steps"] == 2.5
    assert by_name["parting"]["accepted_lengths"] == {"1": 4, "4": 1}
    # HF's 4 tokens: the prefill's, then 3 steps of one (the prefill's is no verify step)
    assert by_name["baseline"]["steps"] == 3.0 and by_name["baseline"]["tau"] == 1.0


def test_an_identical_share_below_one_never_reads_100():
    from bench_report import identical_share

    assert identical_share(1.0, 480) == "100%"
    assert identical_share(479 / 480, 480) == "99.7% (479/480)"
    assert identical_share(None, 3) == "n/a"


def test_sampled_runs_of_other_lengths_keep_tokens_and_time_together():
    """At temperature > 0 a method's timed runs may stop at other lengths: a record's tokens,
    seconds and tokens/s all come from one run, the one of median tokens/s."""
    from bench_methods import Method, Run

    method = Method("eagle", "heads", lambda *a, **k: None, torch.device("cpu"), False)
    timings = {"base": 0.0, "draft": 0.0, "other": 0.0, "total": 1.0}
    # 22 tokens in 0.079 s (278/s), 14 in 0.042 s (333/s), 14 in 0.050 s (280/s)
    timed = [
        (0.079, Run(list(range(22)), [2] * 11, timings)),
        (0.042, Run(list(range(14)), [2] * 7, timings)),
        (0.050, Run(list(range(14)), [2] * 7, timings)),
    ]
    prompt = bench.BenchPrompt(0, 0, "c", "x", [], ["Hi"])
    record = bench_report.make_record(prompt, 0, method, 5, timed, None)
    assert (record["new_tokens"], record["seconds"]) == (14, 0.050)
    assert record["tokens_per_s"] == 14 / 0.050
    assert record["seconds_runs"] == [0.079, 0.042, 0.050]
    # an even count: the lower middle run (here the slower of two)
    record = bench_report.make_record(prompt, 0, method, 5, timed[:2], None)
    assert (record["new_tokens"], record["seconds"]) == (22, 0.079)


def test_the_warm_up_leaves_no_measurements_in_an_adaptive_policy(smollm2_tokenizer):
    # bench_arms does the same: what the policy measured while untimed must not steer the timed
    # prompts (they pay for trying the arms, as a user's first prompts do)
    import bench_methods

    from heads import MedusaConfig, MedusaHeads
    from inference import SpeculativeGenerator
    from tests.conftest import make_tiny_llama

    tok = smollm2_tokenizer
    base = make_tiny_llama(vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    heads = MedusaHeads(MedusaConfig.from_base(base.config, num_heads=2)).init_from_base(base)
    gen = SpeculativeGenerator(base, heads)
    settings = {"max_new_tokens": 32, "temperature": 0.0, "top_p": 1.0, "eos": []}
    method = bench_methods.Method(
        "medusa", "medusa", bench_methods._spec_runner(gen, settings), torch.device("cpu"), True
    )
    prompt = bench.BenchPrompt(0, 0, "writing", "test", [], ["Write a poem."])
    bench._warm_up(prompt, [method], tok, seed=0)
    assert gen.policy is None
    method.generate(bench.first_turn_ids(prompt, tok), 0)
    assert sum(a["steps"] for a in gen.policy.summary()) > 0  # kept from prompt to prompt
