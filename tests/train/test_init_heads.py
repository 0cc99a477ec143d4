"""`training.init_heads`: a recipe starts from trained heads instead of a fresh init."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

import train.eagle
import train.medusa
from heads import EagleConfig, EagleDraft, MedusaConfig, MedusaHeads
from tests.conftest import make_tiny_llama
from tests.train.conftest import TINY_EAGLE, TINY_MEDUSA, load_tiny_base, run
from tests.train.test_recipes import assert_base_untouched, heads_tensors, read_metrics
from train.init_heads import read_init_heads

# One update at a vanishing rate: the saved heads are the loaded ones, up to ~1e-12.
STILL = ["training.max_steps=1", "training.learning_rate=1.0e-12", "training.eval_every_steps=1"]


def assert_same_tensors(out, source) -> None:
    got, want = heads_tensors(out), heads_tensors(source)
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.allclose(got[name], tensor, atol=1e-6), name


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["medusa", "eagle3"])
def test_a_run_starts_from_the_given_heads(kind, request, tiny_task, tmp_path, capsys):
    """The trained heads load whole (weights and draft vocabulary): a run that barely moves them
    saves them again and evaluates as they did at the end of their own run."""
    module, recipe, extra, first, second = {
        "medusa": (train.medusa, TINY_MEDUSA, [], "eval/head0/top1", "eval/head1/top1"),
        "eagle3": (
            train.eagle,
            TINY_EAGLE,
            ["heads.ttt_steps=2"],
            "eval/step0/top1",
            "eval/step1/top1",
        ),
    }[kind]
    source, _, _ = request.getfixturevalue(f"{kind}_run")
    out = tmp_path / "out"
    run(module, recipe, tiny_task, out, *extra, *STILL, f"training.init_heads={source / 'heads'}")
    assert f"from {source / 'heads'} (training.init_heads)" in capsys.readouterr().out
    assert_same_tensors(out, source)
    # The vocabulary came with the heads, none was chosen from the data.
    assert not (out / "draft_vocab.safetensors").exists()
    _, source_eval = read_metrics(source)
    _, first_eval = read_metrics(out)
    trained = source_eval[max(source_eval)]
    assert trained[first] > 0.5  # the source learnt: the test can tell a fresh init
    for key in (first, second, "eval/sim_tau"):
        assert first_eval[1][key] == pytest.approx(trained[key], abs=1e-6)


@pytest.mark.slow
def test_shared_medusa_heads_start_without_touching_the_base(tiny_task, tmp_path):
    """Heads saved in bf16 with a shared lm_head: the blocks load (cast to fp32), while the
    lm_head stays the frozen base's, even when the folder holds other rows under its name."""
    shared = ["heads.shared_lm_head=true", "heads.draft_vocab_size=null"]
    source, out = tmp_path / "source", tmp_path / "out"
    run(
        train.medusa,
        TINY_MEDUSA,
        tiny_task,
        source,
        *shared,
        "training.max_steps=2",
        "output.heads_dtype=bfloat16",
    )
    tensors = heads_tensors(source)
    assert tensors["blocks.0.layers.0.weight"].dtype == torch.bfloat16
    shape = load_tiny_base(tiny_task).get_output_embeddings().weight.shape
    tensors["lm_head.weight"] = torch.zeros(shape, dtype=torch.bfloat16)
    save_file(tensors, source / "heads" / "model.safetensors")
    base = run(
        train.medusa,
        TINY_MEDUSA,
        tiny_task,
        out,
        *shared,
        *STILL,
        f"training.init_heads={source / 'heads'}",
    )
    assert_base_untouched(base, tiny_task)  # the zero rows were not written into it
    got = heads_tensors(out)
    for name, tensor in tensors.items():
        if name != "lm_head.weight":
            assert torch.allclose(got[name], tensor.float(), atol=1e-6), name


@pytest.mark.slow
@pytest.mark.parametrize(
    "override, message",
    [
        ("heads.draft_vocab_size=128", "draft_vocab_size: 256 there, 128 here"),
        ("heads.version=1", "version: 3 there, 1 here"),
    ],
)
def test_heads_of_another_shape_are_refused(
    override, message, eagle3_run, tiny_task, tmp_path, capsys
):
    source, _, _ = eagle3_run
    with pytest.raises(SystemExit) as exit_:
        run(
            train.eagle,
            TINY_EAGLE,
            tiny_task,
            tmp_path / "out",
            override,
            f"training.init_heads={source / 'heads'}",
        )
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"training.init_heads={source / 'heads'} is not the heads this recipe builds" in err
    assert message in err


@pytest.mark.slow
def test_medusa_heads_do_not_start_an_eagle_run(medusa_run, tiny_task, tmp_path, capsys):
    source, _, _ = medusa_run
    with pytest.raises(SystemExit):
        run(
            train.eagle,
            TINY_EAGLE,
            tiny_task,
            tmp_path / "o",
            f"training.init_heads={source}/heads",
        )
    err = capsys.readouterr().err
    assert f"training.init_heads={source}/heads holds Medusa heads" in err
    assert (
        "this recipe trains an EAGLE-3 draft: go on training them with train/medusa.py and a "
        "recipe of heads.type=medusa" in err
    )


def test_a_missing_folder_is_named_before_the_run_starts(tiny_task, tmp_path, capsys):
    with pytest.raises(SystemExit):
        run(train.eagle, TINY_EAGLE, tiny_task, tmp_path / "o", f"training.init_heads={tmp_path}/x")
    assert f"heads folder not found: {tmp_path}/x" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # said with the recipe's checks, before the base loads


def _recipe(folder, lora_r=0):
    return SimpleNamespace(
        training=SimpleNamespace(init_heads=str(folder)), heads=SimpleNamespace(lora_r=lora_r)
    )


def _refusal(capsys, config, base, folder) -> str:
    with pytest.raises(SystemExit) as exit_:
        read_init_heads(_recipe(folder), config, base)
    assert exit_.value.code == 2
    return capsys.readouterr().err


@pytest.fixture(scope="module")
def base4():
    return make_tiny_llama(num_hidden_layers=4)


@pytest.fixture(scope="module")
def eagle3_folder(base4, tmp_path_factory):
    folder = tmp_path_factory.mktemp("eagle3") / "heads"
    config = EagleConfig.from_base(base4.config, draft_vocab_size=128)  # aux ids (1, 2, 3)
    EagleDraft(config).save_pretrained(folder)
    return folder


def test_the_same_eagle3_draft_loads(base4, eagle3_folder):
    config = EagleConfig.from_base(base4.config, draft_vocab_size=128)
    tensors, where = read_init_heads(_recipe(eagle3_folder), config, base4)
    assert where == str(eagle3_folder) and "fc.weight" in tensors


def test_a_draft_of_other_aux_layers_is_refused(capsys, base4, eagle3_folder):
    """Same shapes, other base layers read: its fc was trained on other states (I1)."""
    config = EagleConfig.from_base(base4.config, draft_vocab_size=128, aux_layer_ids=[0, 1, 2])
    err = _refusal(capsys, config, base4, eagle3_folder)
    assert "is not the heads this recipe builds" in err
    assert "aux_layer_ids: [1, 2, 3] there, [0, 1, 2] here" in err


def test_a_draft_of_another_draft_vocabulary_is_refused(capsys, base4, eagle3_folder):
    """(I2)"""
    config = EagleConfig.from_base(base4.config, draft_vocab_size=64)
    err = _refusal(capsys, config, base4, eagle3_folder)
    assert "draft_vocab_size: 128 there, 64 here" in err


def test_medusa_heads_of_another_base_depth_are_refused(capsys, base4, tmp_path):
    """Heads of the same shapes whose base had another layer count: `check_base` (I3)."""
    base2 = make_tiny_llama()  # 2 layers, same hidden and vocabulary sizes
    assert base2.config.num_hidden_layers == 2
    heads = MedusaHeads(MedusaConfig.from_base(base2.config, num_heads=2)).init_from_base(base2)
    heads.save_pretrained(tmp_path / "heads")
    config = MedusaConfig.from_base(base4.config, num_heads=2)
    err = _refusal(capsys, config, base4, tmp_path / "heads")
    assert "num_hidden_layers=2" in err and "has num_hidden_layers=4" in err


def test_an_eagle1_draft_with_an_fc_bias_does_not_start_one_without(capsys, base4, tmp_path):
    """EAGLE-1's fc bias (the reference's) is part of the shape: `fc_bias` is compared (I4)."""
    biased = EagleConfig.from_base(base4.config, version=1, fc_bias=True)
    draft = EagleDraft(biased)
    assert draft.fc.bias is not None
    draft.fc.bias.data.fill_(0.5)  # a zero bias is read as none (an SGLang export's)
    draft.save_pretrained(tmp_path / "heads")
    config = EagleConfig.from_base(base4.config, version=1)
    err = _refusal(capsys, config, base4, tmp_path / "heads")
    assert "fc_bias: True there, False here" in err


def test_an_eagle3_draft_does_not_start_a_medusa_run(capsys, base4, tmp_path):
    EagleDraft(EagleConfig.from_base(base4.config, draft_vocab_size=128)).save_pretrained(
        tmp_path / "heads"
    )
    err = _refusal(
        capsys, MedusaConfig.from_base(base4.config, num_heads=2), base4, tmp_path / "heads"
    )
    assert (
        f"training.init_heads={tmp_path / 'heads'} holds an EAGLE-3 draft, and this recipe trains "
        "Medusa heads: go on training them with train/eagle.py and a recipe of heads.type=eagle, "
        "heads.version=3, or leave init_heads out to start fresh" in err
    )


def test_medusa_heads_of_another_count_are_refused_by_name(capsys, base4, tmp_path):
    heads = MedusaHeads(MedusaConfig.from_base(base4.config, num_heads=2)).init_from_base(base4)
    heads.save_pretrained(tmp_path / "heads")
    err = _refusal(
        capsys, MedusaConfig.from_base(base4.config, num_heads=3), base4, tmp_path / "heads"
    )
    assert "is not the heads this recipe builds (num_heads: 2 there, 3 here)" in err


def test_only_medusa2_heads_say_they_start_without_their_adapter(base4, tmp_path):
    config = MedusaConfig.from_base(base4.config, num_heads=2)
    MedusaHeads(config).init_from_base(base4).save_pretrained(tmp_path / "medusa1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        read_init_heads(_recipe(tmp_path / "medusa1"), config, base4)
    medusa2 = MedusaConfig.from_base(base4.config, num_heads=2, base_lora="base_lora")
    (tmp_path / "medusa2" / "base_lora").mkdir(parents=True)  # training writes the adapter first
    MedusaHeads(medusa2).init_from_base(base4).save_pretrained(tmp_path / "medusa2")
    with pytest.warns(
        UserWarning,
        match="adapter in their 'base_lora' folder; this run starts them on the base with no adapter",
    ):
        read_init_heads(_recipe(tmp_path / "medusa2"), config, base4)
