"""scripts/convert_marian.py end to end, in a subprocess (which picks its own kernels, so these run once,
not under each linear kernel as the conversion's numeric tests do)."""

import subprocess
import sys
from pathlib import Path

from test_marian_conversion import marian_model

from vanilla_transformer import VanillaTransformerConfig, VanillaTransformerForConditionalGeneration

SCRIPT = str(Path(__file__).resolve().parents[1] / "scripts" / "convert_marian.py")


def test_convert_script_says_when_a_folder_is_not_marian(tmp_path):
    """It once answered a non-Marian folder with "Encoder and decoder have 2 and 16 attention heads"."""
    config = VanillaTransformerConfig(vocab_size=40, d_model=16, d_ff=32, num_heads=2)
    VanillaTransformerForConditionalGeneration(config).save_pretrained(tmp_path / "ours")
    command = [
        sys.executable,
        SCRIPT,
        "--model",
        str(tmp_path / "ours"),
        "--output",
        str(tmp_path / "out"),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 2
    assert "is not a Marian checkpoint: its config.json has model_type 'vanilla_transformer'" in result.stderr
    assert not (tmp_path / "out").exists()
    # A mistyped local path, not the Hub's rules for repo ids (it used to quote those).
    missing = [sys.executable, SCRIPT, "--model", "./nope", "--output", str(tmp_path / "out")]
    result = subprocess.run(missing, capture_output=True, text=True, timeout=300, check=False, cwd=tmp_path)
    assert result.returncode == 2 and "No model folder at ./nope" in result.stderr, result.stderr


def test_convert_script_writes_a_whole_folder_or_nothing(tmp_path):
    """It once wrote a folder without a tokenizer and exited 0, and mixed a new model into an existing
    folder's tokenizer and card."""
    marian_model().save_pretrained(tmp_path / "marian")  # no tokenizer files: it cannot be copied

    def convert(output: Path, *flags: str) -> subprocess.CompletedProcess:
        command = [
            sys.executable,
            SCRIPT,
            "--model",
            str(tmp_path / "marian"),
            "--output",
            str(output),
            *flags,
        ]
        return subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)

    failed = convert(tmp_path / "out")
    assert (
        failed.returncode == 2
        and "has no tokenizer files" in failed.stderr
        and "--no-tokenizer" in failed.stderr
    )
    assert not (tmp_path / "out").exists()
    (tmp_path / "marian" / "source.spm").write_bytes(b"not a sentencepiece model")
    unreadable = convert(tmp_path / "out")
    assert unreadable.returncode == 2 and "could not be loaded" in unreadable.stderr
    assert "--no-tokenizer" in unreadable.stderr and not (tmp_path / "out").exists()
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "tokenizer.json").write_text("{}")
    taken = convert(tmp_path / "taken", "--no-tokenizer")
    assert taken.returncode == 2 and "is not an empty folder" in taken.stderr
    alone = convert(tmp_path / "out", "--no-tokenizer")
    assert alone.returncode == 0, alone.stderr[-2000:]
    assert (tmp_path / "out" / "model.safetensors").is_file() and not (
        tmp_path / "out" / "tokenizer.json"
    ).exists()


def test_convert_script_refuses_a_checkpoint_without_the_encoder(tmp_path):
    """A saved MarianForCausalLM has model_type "marian" and no encoder: transformers filled the missing
    weights with random ones, only warning, and the script wrote the model."""
    from transformers import MarianForCausalLM

    config = marian_model().config
    config.is_decoder, config.is_encoder_decoder = True, False
    MarianForCausalLM(config).save_pretrained(tmp_path / "causal")
    command = [sys.executable, SCRIPT, "--model", str(tmp_path / "causal"), "--output", str(tmp_path / "out")]
    result = subprocess.run([*command, "--no-tokenizer"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "lacks" in result.stderr and "model.encoder." in result.stderr
    assert "not a complete translation model" in result.stderr and not (tmp_path / "out").exists()
