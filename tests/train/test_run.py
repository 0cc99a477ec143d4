"""train/run.py, the trainers' shared driver, outside the slow runs: exit codes and usage,
warnings and locks around a run, the accelerator asked for, the base's dtype and packing, the
held-out evaluation, the trainee's checkpoint state, metrics.jsonl on resume, save_final."""

import json
import warnings
from contextlib import suppress
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from torch import nn

from heads import MedusaConfig, MedusaHeads, load_heads
from heads.cpu import PackedLinear, can_prepack
from tests.conftest import make_tiny_llama
from tests.train.conftest import TINY_MEDUSA
from tests.train.test_lock import hold_lock
from train.checkpoint import TrainingDiverged
from train.config import load_recipe
from train.features import ExampleDataset
from train.lock import lock_output
from train.outputs import MetricsLog, save_final
from train.run import (
    Trainee,
    assert_trainable,
    evaluate,
    load_frozen_base,
    make_accelerator,
    parse_args,
    run_training,
)
from train.zero import fill_deepspeed_config, keep_rotary_in_fp32

QUIET = SimpleNamespace(print=lambda *a, **k: None, is_main_process=True, log=lambda *a, **k: None)


def test_a_diverged_loss_exits_1_with_its_message(capsys):

    def diverged(recipe):
        raise TrainingDiverged("loss is nan at step 3; training stopped")

    with pytest.raises(SystemExit) as exit_:
        run_training(diverged, [str(TINY_MEDUSA)], "medusa")
    assert exit_.value.code == 1
    assert "error: loss is nan at step 3; training stopped" in capsys.readouterr().err


def test_a_run_frees_its_output_folder_however_it_ends(tmp_path):
    """Another process may write the folder once the run is over (a script calling main)."""

    out = tmp_path / "out"
    out.mkdir()

    def done(recipe):
        lock_output("output.dir", out)

    def diverged(recipe):
        lock_output("output.dir", out)
        raise TrainingDiverged("loss is nan at step 1; training stopped")

    for training in (done, diverged):
        with suppress(SystemExit):
            run_training(training, [str(TINY_MEDUSA)], "medusa")
        holder = hold_lock(out)  # takes the lock: this process released it
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("argv, code", [([], 2), (["-h"], 0), (["--help"], 0)])
def test_the_usage_line_and_its_exit_status(argv, code, capsys):
    """Asked for, the help goes to stdout; for a command without its recipe, to stderr. It
    names every section's keys."""
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv, "medusa")
    assert exit_.value.code == code
    said = capsys.readouterr()
    text = said.out if argv else said.err
    assert text.startswith("usage: accelerate launch train/medusa.py RECIPE.yaml")
    assert "\n  training: mode, feature_cache, epochs, max_steps," in text
    assert "\n  logging: report_to, project, log_every_steps\n" in text


def test_the_main_process_keeps_its_warnings(monkeypatch):

    monkeypatch.delenv("RANK", raising=False)

    def warns(recipe):
        warnings.warn("said by the first process", UserWarning, stacklevel=1)

    with pytest.warns(UserWarning, match="said by the first process"):
        run_training(warns, [str(TINY_MEDUSA)], "medusa")


@pytest.fixture
def accelerators(monkeypatch):
    """make_accelerator's Accelerator replaced by one that keeps what it was asked for; set
    `.processes` to the number of processes it joins. No GPU, one process unless set."""
    import train.run

    made = SimpleNamespace(kwargs=[], processes=1, printed=[])

    class Recording:
        def __init__(self, **kwargs):
            made.kwargs.append(kwargs)
            self.num_processes = made.processes
            self.state = SimpleNamespace(deepspeed_plugin=None)

        def print(self, *args, **kwargs):
            made.printed.append(" ".join(map(str, args)))

        def init_trackers(self, project, config=None):
            pass

    monkeypatch.setattr(train.run, "Accelerator", Recording)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return made


def test_a_single_process_is_not_told_cpu_and_several_without_a_gpu_are(accelerators, monkeypatch):

    make_accelerator(load_recipe(None, []))
    assert accelerators.kwargs[-1]["cpu"] is False
    monkeypatch.setenv("WORLD_SIZE", "2")
    accelerators.processes = 2
    make_accelerator(load_recipe(None, []))
    assert accelerators.kwargs[-1]["cpu"] is True  # joined with gloo


def test_training_says_how_many_processes_it_runs_on(accelerators, monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    make_accelerator(load_recipe(None, []))
    assert accelerators.printed == ["training on 1 process"]
    monkeypatch.setenv("WORLD_SIZE", "2")
    accelerators.processes = 2
    make_accelerator(load_recipe(None, []))
    assert accelerators.printed[-1] == "training on 2 processes"


def test_one_process_of_a_launch_asking_for_several_says_how_to_start_them(
    accelerators, monkeypatch
):
    # `accelerate launch --num_processes 2` without --multi_gpu, or with --cpu, on a machine
    # without a GPU: one process, with the rendezvous address set for the two asked for
    monkeypatch.setenv("ACCELERATE_USE_CPU", "False")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    make_accelerator(load_recipe(None, []))
    assert accelerators.printed == [
        "training on 1 process: if accelerate launch was asked for several, it started one; "
        "several on a machine without a GPU need --multi_gpu --num_processes N (--cpu starts one)"
    ]
    accelerators.processes = 4  # joined otherwise (accelerate's MPI launch sets no WORLD_SIZE)
    make_accelerator(load_recipe(None, []))
    assert accelerators.printed[-1] == "training on 4 processes"


def test_processes_that_accelerate_did_not_join_are_refused(accelerators, monkeypatch):

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="2 processes were launched but accelerate joined 1"):
        make_accelerator(load_recipe(None, []))


def test_the_recipes_seed_is_set(accelerators):

    make_accelerator(load_recipe(None, ["training.seed=123"]))
    got = torch.rand(4)
    torch.manual_seed(123)
    assert torch.equal(got, torch.rand(4))


def test_one_of_a_trackers_packages_is_enough(accelerators, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec

    def tensorboardx_only(name, *args):
        if name in ("tensorboard", "tensorboardX"):
            return None if name == "tensorboard" else SimpleNamespace(name=name)
        return find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", tensorboardx_only)
    make_accelerator(load_recipe(None, ["logging.report_to=tensorboard"]))
    assert accelerators.kwargs[-1]["log_with"] == "tensorboard"


def test_the_frozen_base_loads_in_the_dtype_asked_and_prepacked(tiny_base):

    recipe = load_recipe(TINY_MEDUSA, [f"model.name_or_path={tiny_base}"])  # model.dtype float32
    base, _ = load_frozen_base(recipe, Accelerator(cpu=True))
    assert base.dtype == torch.float32
    # the trainers' base dtype (base_dtype_for_training) over the recipe's
    assert load_frozen_base(recipe, Accelerator(cpu=True), "bfloat16")[0].dtype == torch.bfloat16
    # on a CPU, as decoding loads it (eval_heads scores as decoding runs)
    assert any(isinstance(m, PackedLinear) for m in base.modules()) == can_prepack()


def test_a_draft_vocabulary_of_the_whole_vocabulary_is_taken(tiny_base, capsys):

    vocab = load_recipe(TINY_MEDUSA, [f"model.name_or_path={tiny_base}"])
    vocab = load_frozen_base(vocab, Accelerator(cpu=True))[0].config.vocab_size
    recipe = load_recipe(
        TINY_MEDUSA, [f"model.name_or_path={tiny_base}", f"heads.draft_vocab_size={vocab}"]
    )
    load_frozen_base(recipe, Accelerator(cpu=True))
    recipe = load_recipe(
        TINY_MEDUSA, [f"model.name_or_path={tiny_base}", f"heads.draft_vocab_size={vocab + 1}"]
    )
    with pytest.raises(SystemExit) as exit_:
        load_frozen_base(recipe, Accelerator(cpu=True))
    assert (
        exit_.value.code == 2 and f"draft_vocab_size={vocab + 1} is more" in capsys.readouterr().err
    )


class CountingTrainee(nn.Module):
    """A trainee whose loss is 1 per target token (a token after the first, in the loss mask)."""

    def forward(self, batch, norm):
        return batch["loss_mask"][:, 1:].sum().float() * norm, {}


def test_the_held_out_loss_is_per_target_token_and_training_goes_on_after(capsys):

    examples = [  # a text chunk is all targets; a chat answer follows its prompt
        {"input_ids": [5, 6, 7, 8], "loss_mask": [1, 1, 1, 1], "labels": [5, 6, 7, 8]},
        {"input_ids": [5, 6, 7, 8, 9], "loss_mask": [0, 0, 1, 1, 1], "labels": [5, 6, 7, 8, 9]},
    ]
    model = CountingTrainee().train()
    recipe = load_recipe(TINY_MEDUSA, ["training.micro_batch_size=1"])
    assert evaluate(model, ExampleDataset(examples), recipe, 0, "cpu") == {"eval/loss": 1.0}
    assert model.training  # evaluate runs mid-training: the trainee trains on afterwards


def test_the_trainable_count_is_checked_both_ways():

    model = nn.Linear(4, 4)
    model.bias.requires_grad_(False)
    assert_trainable(model, 16, QUIET)
    for expected in (20, 12):
        with pytest.raises(RuntimeError, match=f"16 trainable parameters, expected {expected}"):
            assert_trainable(model, expected, QUIET)


class Pair(Trainee):
    """A trainee over a tiny Llama (frozen or not) and heads with a buffer (EAGLE-3's vocab
    map is one)."""

    def __init__(self, frozen: bool = True):
        super().__init__()
        self.base = make_tiny_llama().requires_grad_(not frozen)
        self.heads = nn.Linear(4, 4)
        self.heads.register_buffer("d2t", torch.arange(4))


def test_a_trainee_checkpoint_holds_the_heads_and_their_buffers_only():
    trainee = Pair()
    state = trainee.state_dict()
    assert set(state) == {"heads.weight", "heads.bias", "heads.d2t"}
    Pair().load_state_dict(state)
    with pytest.raises(RuntimeError, match=r"missing \['heads.d2t'\]"):
        Pair().load_state_dict({k: v for k, v in state.items() if k != "heads.d2t"})
    with pytest.raises(RuntimeError, match=r"unexpected \['heads.extra'\]"):
        Pair().load_state_dict({**state, "heads.extra": torch.zeros(1)})


def test_a_frozen_base_stays_in_eval_mode_and_an_adapted_one_trains():
    frozen, adapted = Pair(frozen=True).train(), Pair(frozen=False).train()
    assert frozen.heads.training and not frozen.base.training
    assert adapted.heads.training and adapted.base.training


def test_metrics_logged_past_the_resumed_step_and_torn_lines_are_dropped(tmp_path):

    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3, 4)]
    path.write_text("".join(lines) + "\n" + '{"step": 5, "lo')  # a blank line; a kill mid-write
    recipe = load_recipe(TINY_MEDUSA, [f"output.dir={tmp_path}"])
    log = MetricsLog(recipe, QUIET, start_step=3)
    assert path.read_text() == "".join(lines[:3])
    log.log({"loss": 0.2}, 4)
    assert path.read_text().splitlines()[-1] == '{"step": 4, "loss": 0.2}'
    MetricsLog(recipe, QUIET)  # a fresh run starts a new file
    assert path.read_text() == ""


def test_a_plain_run_removes_an_earlier_medusa2_adapter_from_its_heads(tiny_llama, tmp_path):

    (tmp_path / "heads" / "lora").mkdir(parents=True)  # an earlier Medusa-2 run in this dir
    (tmp_path / "heads" / "lora" / "adapter_config.json").write_text("{}")
    recipe = load_recipe(None, [f"output.dir={tmp_path}"])
    heads = MedusaHeads(MedusaConfig.from_base(tiny_llama.config, num_heads=2))
    folder = save_final(recipe, heads, Accelerator(cpu=True), {})
    assert not (folder / "lora").exists()
    assert not load_heads(folder).config.base_lora


def test_a_deepspeed_config_takes_the_recipes_micro_batch_and_gradient_clipping():
    """DeepSpeed clips in its engine (accelerate's clip_grad_norm_ only reads the norm there),
    and accelerate fills an "auto" clipping with 1.0: the recipe's max_grad_norm goes in, and a
    value the config sets itself is said to rule."""
    recipe = load_recipe(TINY_MEDUSA, ["training.max_grad_norm=0.5", "training.micro_batch_size=3"])
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto"}
    assert fill_deepspeed_config(config, recipe) == []
    assert config == {"train_micro_batch_size_per_gpu": 3, "gradient_clipping": 0.5}
    config = {"train_micro_batch_size_per_gpu": 2}  # no clipping named: the recipe's
    assert fill_deepspeed_config(config, recipe) == [] and config["gradient_clipping"] == 0.5
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0}
    [note] = fill_deepspeed_config(config, recipe)
    assert "gradient_clipping 1.0 is applied, not training.max_grad_norm 0.5" in note
    assert config == {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0}


def test_rope_frequencies_cast_with_the_model_are_set_back_to_float32():
    """DeepSpeed's bf16 engine casts the model it wraps whole, RoPE's inverse frequencies too:
    set back to float32, as transformers (and the serving engines) compute them, for the base
    and the EAGLE draft; a model already in float32 is left as it is."""
    from heads import EagleConfig, EagleDraft

    base = make_tiny_llama(rope_theta=500000.0)
    draft = EagleDraft(EagleConfig.from_base(base.config, version=3, draft_vocab_size=32))
    want = {
        name: b.clone()
        for name, b in [*base.named_buffers(), *draft.named_buffers()]
        if name.endswith("inv_freq")
    }
    model = nn.ModuleDict({"base": base, "draft": draft})
    assert keep_rotary_in_fp32(model) == 0
    model.bfloat16()
    assert all(b.dtype == torch.bfloat16 for n, b in model.named_buffers() if n.endswith("freq"))
    assert keep_rotary_in_fp32(model) == 2
    for name, b in [*base.named_buffers(), *draft.named_buffers()]:
        if name.endswith("inv_freq"):
            assert b.dtype == torch.float32 and torch.equal(b, want[name]), name
