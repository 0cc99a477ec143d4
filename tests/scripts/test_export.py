"""scripts/export.py: the converter flags it prints, its exit codes and messages, run as a
script and as main()."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from heads import MedusaConfig, MedusaHeads

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
import export  # noqa: E402  (scripts/ is not a package)


@pytest.mark.filterwarnings("ignore:these heads record")
def test_the_trtllm_export_says_the_converter_flags_of_other_counts(medusa_dir, tmp_path, capsys):
    assert export.main([str(medusa_dir[0]), "--to", "trtllm", "--out", str(tmp_path / "t")]) == 0
    assert "--num_medusa_heads 2 --num_medusa_layers 1" in capsys.readouterr().out
    assert export.main([str(medusa_dir[0]), "--to", "tgi", "--out", str(tmp_path / "g")]) == 0
    assert "--num_medusa_heads" not in capsys.readouterr().out


def test_cli(medusa_dir, tmp_path):
    src, _ = medusa_dir

    def run_script(target: str, out: Path) -> subprocess.CompletedProcess:
        argv = [sys.executable, "scripts/export.py", str(src), "--to", target, "--out", str(out)]
        return subprocess.run(argv, capture_output=True, text=True)

    (tmp_path / "a-file").write_text("")
    refused = run_script("vllm", tmp_path / "a-file")
    assert refused.returncode == 2 and "is a file: give a folder" in refused.stderr
    ok = run_script("tgi", tmp_path / "o")
    assert ok.returncode == 0, ok.stderr
    # a base name without an owner: the warning is one line, without the library's source
    assert ok.stderr.startswith("warning: these heads record ")
    assert ok.stderr.count("\n") == 1 and "UserWarning" not in ok.stderr
    bad = run_script("sglang", tmp_path / "p")
    assert bad.returncode == 2 and "SGLang has no Medusa" in bad.stderr


def test_the_cli_says_why_a_source_cannot_be_read(tmp_path, capsys):
    missing = tmp_path / "missing"
    assert export.main([str(missing), "--to", "vllm", "--out", str(tmp_path / "o")]) == 2
    assert f"export failed: heads folder not found: {missing}" in capsys.readouterr().err
    (tmp_path / "listed").mkdir()
    (tmp_path / "listed" / "config.json").write_text("[1, 2]")
    assert (
        export.main([str(tmp_path / "listed"), "--to", "vllm", "--out", str(tmp_path / "o")]) == 2
    )
    err = capsys.readouterr().err
    assert err.startswith("export failed: ") and "not an object of settings" in err


def test_the_cli_says_the_converter_flags_of_four_heads_of_two_layers(tiny_llama, tmp_path, capsys):
    for layers, said in ((2, True), (1, False)):
        heads = MedusaHeads(
            MedusaConfig.from_base(tiny_llama.config, num_heads=4, num_layers=layers)
        ).init_from_base(tiny_llama)
        heads.save_pretrained(tmp_path / f"m{layers}")
        argv = [
            str(tmp_path / f"m{layers}"),
            "--to",
            "trtllm",
            "--out",
            str(tmp_path / f"t{layers}"),
        ]
        assert export.main(argv) == 0
        out = capsys.readouterr().out
        assert ("--num_medusa_heads 4 --num_medusa_layers 2" in out) == said
        assert ("--num_medusa_heads" in out) == said


BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_the_base_name_given_is_the_one_tgi_loads(medusa_dir, tmp_path, capsys):
    out = tmp_path / "g"
    assert (
        export.main([str(medusa_dir[0]), "--to", "tgi", "--out", str(out), "--base-name", BASE])
        == 0
    )
    assert json.loads((out / "config.json").read_text())["base_model_name_or_path"] == BASE
    assert capsys.readouterr().out == f"wrote tgi layout to {out}\n"


def test_a_base_name_for_another_engine_than_tgi_is_refused(medusa_dir, tmp_path, capsys):
    argv = [str(medusa_dir[0]), "--to", "vllm", "--out", str(tmp_path / "v"), "--base-name", BASE]
    assert export.main(argv) == 2
    assert capsys.readouterr().err.startswith("export failed: ")
    assert not (tmp_path / "v").exists()
