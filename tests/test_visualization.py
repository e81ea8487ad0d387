"""Attention pictures show the model's own weights; positional-encoding pictures show the formula."""

import math
from pathlib import Path

import pytest
import torch

from tests.conftest import TINY_TERMS, assert_same_up_to_rounding, tiny_model
from vanilla_transformer import visualization
from vanilla_transformer.corpus import load_default_corpus
from vanilla_transformer.visualization import (
    MAP_DPI,
    MAX_ENCODING_POSITIONS,
    MAX_MAP_PIXELS,
    MAX_MAP_SIDE,
    MAX_MAP_TOKENS,
    attention_maps,
    plot_attention_grid,
    plot_attention_maps,
    plot_positional_encoding,
    position_similarity,
)

ROOT = Path(__file__).resolve().parents[1]
SOURCE = "In the beginning God created the heaven and the earth."
TARGET = "En el principio creó Dios los cielos y la tierra."


@pytest.fixture(scope="module")
def tokenizer():
    from vanilla_transformer.tokenization import train_bpe_tokenizer

    train = load_default_corpus()["train"].select(range(1500))
    return train_bpe_tokenizer(list(train["en"]) + list(train["es"]), 400)


@pytest.fixture
def model(tokenizer):
    return tiny_model("sdpa", vocab_size=len(tokenizer))


def test_maps_are_the_models_attention_weights(model, tokenizer):
    maps = attention_maps(model, tokenizer, SOURCE, TARGET)
    assert model.config._attn_implementation == "sdpa"  # switched to eager for the call only
    source_length, target_length = len(maps.source_tokens), len(maps.target_tokens)
    assert maps.source_tokens[-1] == maps.target_tokens[-1] == "</s>"
    assert maps.decoder_tokens[0] == "<s>" and maps.decoder_tokens[1:] == maps.target_tokens[:-1]
    assert maps.encoder_self.shape == (2, 4, source_length, source_length)
    assert maps.decoder_self.shape == (2, 4, target_length, target_length)
    assert maps.cross.shape == (2, 4, target_length, source_length)
    for weights in (maps.encoder_self, maps.decoder_self, maps.cross):
        assert (weights >= 0).all()
        torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]))
    above_diagonal = torch.ones(target_length, target_length, dtype=torch.bool).triu(1)
    assert (maps.decoder_self[..., above_diagonal] == 0).all()  # no looking ahead
    assert (maps.decoder_self[..., ~above_diagonal] > 0).all()

    # Independent of the attention code: layer 1's weights from its input and Equation 1.
    input_ids = tokenizer(SOURCE, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        states = model.get_encoder()(input_ids=input_ids, output_hidden_states=True).hidden_states[0][0]
        attention = model.get_encoder().layers[0].self_attn
        heads, width = 4, model.config.d_model // 4
        queries = attention.q_proj(states).view(-1, heads, width).transpose(0, 1)
        keys = attention.k_proj(states).view(-1, heads, width).transpose(0, 1)
        expected = torch.softmax(queries @ keys.transpose(1, 2) / math.sqrt(width), dim=-1)
    assert_same_up_to_rounding(maps.encoder_self[0], expected, TINY_TERMS)


def test_rendered_panels_hold_exactly_those_weights(model, tokenizer, tmp_path, monkeypatch):
    maps = attention_maps(model, tokenizer, SOURCE, TARGET)
    figure = plot_attention_grid(
        maps.decoder_self, maps.decoder_tokens, maps.decoder_tokens, tmp_path / "d.png", title="t"
    )
    panels = [ax for ax in figure.axes if ax.images]
    assert len(panels) == 2 * (4 + 1)  # layers x (heads + mean)
    for index, ax in enumerate(panels):
        layer, column = divmod(index, 5)
        drawn = torch.from_numpy(ax.images[0].get_array().data)
        expected = maps.decoder_self[layer, column] if column < 4 else maps.decoder_self[layer].mean(0)
        torch.testing.assert_close(drawn, expected)
        assert (drawn.triu(1) == 0).all()
        assert [t.get_text() for t in ax.get_xticklabels()] == maps.decoder_tokens
    assert (tmp_path / "d.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    paths = plot_attention_maps(maps, tmp_path / "maps")
    assert sorted(paths) == ["cross_attention", "decoder_self_attention", "encoder_self_attention"]
    assert all(path.stat().st_size > 10_000 for path in paths.values())
    # Each picture of its kind's weights, its rows labelled by the queries and its columns by the keys
    # (the cross-attention rows labelled by the decoder inputs, one token early, passed the checks above).
    drawn = {}
    monkeypatch.setattr(
        visualization,
        "plot_attention_grid",
        lambda w, q, k, path, **_: drawn.setdefault(Path(path).stem, (w, q, k)),
    )
    plot_attention_maps(maps, tmp_path / "again")
    expected = {
        "encoder_self_attention": (maps.encoder_self, maps.source_tokens, maps.source_tokens),
        "decoder_self_attention": (maps.decoder_self, maps.decoder_tokens, maps.decoder_tokens),
        "cross_attention": (maps.cross, maps.target_tokens, maps.source_tokens),
    }
    assert drawn.keys() == expected.keys()
    for name, (weights, queries, keys) in expected.items():
        assert drawn[name][0] is weights and drawn[name][1:] == (queries, keys), name
    assert maps.target_tokens != maps.decoder_tokens  # so that the labels tell the two apart


def test_pictures_too_large_to_render_are_refused_before_any_is_drawn(tmp_path):
    """A grid grows with layers x heads x tokens^2: a base-sized model's 512-token picture would be
    102,190 pixels wide, beyond matplotlib's renderer, and pictures of a few hundred million pixels
    take minutes and gigabytes. Such a picture is refused before any of the three is written, with the
    longest sentence that fits; that one, drawn, is within the limits (the size read from a real PNG)."""
    import re

    from matplotlib.image import imread

    from vanilla_transformer.visualization import AttentionMaps

    def maps(layers: int, heads: int, source: int, target: int) -> AttentionMaps:
        def weights(queries: int, keys: int) -> torch.Tensor:
            return torch.rand(layers, heads, queries, keys).softmax(-1)

        return AttentionMaps(
            source_tokens=["s"] * source,
            decoder_tokens=["d"] * target,
            target_tokens=["t"] * target,
            encoder_self=weights(source, source),
            decoder_self=weights(target, target),
            cross=weights(target, source),
        )

    def pixels(layers: int, heads: int, tokens: int) -> tuple[int, int]:
        """Width and height of a real picture of that many tokens, scaled from a small one's by the
        figure's size, which is linear in the tokens (one row and column of 0.22 inch each)."""
        path = tmp_path / f"{layers}-{heads}-{tokens}.png"
        plot_attention_grid(
            torch.rand(layers, heads, tokens, tokens), ["x"] * tokens, ["x"] * tokens, path, title="t"
        )
        height, width = imread(path).shape[:2]
        return width, height

    # The size a picture has, measured on two drawn ones: 8 tokens more make each panel 1.76 inches wider.
    width_8, height_8 = pixels(2, 3, 8)
    width_16, height_16 = pixels(2, 3, 16)
    assert (width_16 - width_8, height_16 - height_8) == (
        round(1.76 * MAP_DPI * 4),
        round(1.76 * MAP_DPI * 2),
    )

    def size(layers: int, heads: int, tokens: int) -> tuple[int, int]:
        """From the 2-layer, 3-head picture of 8 tokens: its panels, its margin, 0.22 inch per token."""
        panel = width_8 / 4 + 0.22 * MAP_DPI * (tokens - 8)
        return round(panel * (heads + 1)), round(panel * layers + height_8 - 2 * width_8 / 4)

    def fits(layers: int, heads: int, tokens: int) -> bool:
        width, height = size(layers, heads, tokens)
        return max(width, height) <= MAX_MAP_SIDE and width * height <= MAX_MAP_PIXELS

    for layers, heads in ((6, 8), (3, 4)):
        output = tmp_path / f"out-{layers}-{heads}"
        with pytest.raises(ValueError, match=r"give sentences of at most \d+ tokens") as refused:
            plot_attention_maps(maps(layers, heads, source=5, target=MAX_MAP_TOKENS), output)
        assert not output.exists() or not any(output.iterdir())  # not even the encoder's picture
        longest = int(re.search(r"at most (\d+) tokens", str(refused.value)).group(1))
        assert fits(layers, heads, longest) and not fits(layers, heads, longest + 1)
    assert not fits(6, 8, MAX_MAP_TOKENS) and max(size(6, 8, MAX_MAP_TOKENS)) > MAX_MAP_SIDE


def test_token_labels_are_drawn_as_text_not_as_mathtext(tmp_path):
    """Tick labels went through matplotlib's mathtext: a token holding two dollar signs was drawn as a
    formula ("$x$" as an italic x), or ended the script with a parse error ("$$", "$\\frac$")."""
    tokens = ["$x$", "x", "$$", "$\\frac$"]
    figure = plot_attention_grid(torch.rand(1, 1, 4, 4), tokens, tokens, tmp_path / "t.png", title="t")
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    renderer = figure.canvas.get_renderer()
    labels = figure.axes[0].get_yticklabels()  # not rotated
    assert [label.get_text() for label in labels] == tokens
    widths = [label.get_window_extent(renderer).width for label in labels]
    assert widths[0] > 2 * widths[1]  # three characters drawn, not one


def test_without_a_target_the_models_own_translation_is_shown(model, tokenizer):
    maps = attention_maps(model, tokenizer, SOURCE, num_beams=1, max_new_tokens=6)
    generated = model.generate(
        tokenizer(SOURCE, return_tensors="pt")["input_ids"], num_beams=1, max_new_tokens=6
    )
    tokens = tokenizer.convert_ids_to_tokens(generated[0, 1:].tolist())
    if "</s>" in tokens:
        tokens = tokens[: tokens.index("</s>") + 1]
    assert maps.target_tokens == tokens and maps.cross.shape[2] == len(tokens)
    several = attention_maps(model, tokenizer, SOURCE, num_beams=2, num_return_sequences=2, max_new_tokens=6)
    assert several.cross.shape[2] == len(several.target_tokens)  # the best of the returned sequences


def test_a_generated_translation_is_shown_from_the_start_token_it_was_decoded_from(model, tokenizer):
    """The maps of the model's own translation were computed from the model configuration's start token
    even where generation started from another (the generation config's, or a keyword's): the weights
    drawn were not those of the translation shown."""
    model.generation_config.decoder_start_token_id = 7
    maps = attention_maps(model, tokenizer, SOURCE, num_beams=1, max_new_tokens=6)
    input_ids = tokenizer(SOURCE, return_tensors="pt")["input_ids"]
    generated = model.generate(input_ids, num_beams=1, max_new_tokens=6)
    assert generated[0, 0] == 7 and maps.decoder_tokens == tokenizer.convert_ids_to_tokens(generated[0, :-1])
    model.set_attn_implementation("eager")
    with torch.no_grad():
        output = model(input_ids=input_ids, decoder_input_ids=generated[:, :-1], output_attentions=True)
    torch.testing.assert_close(maps.cross, torch.stack([w[0] for w in output.cross_attentions]))
    torch.testing.assert_close(maps.decoder_self, torch.stack([w[0] for w in output.decoder_attentions]))


def test_bad_inputs_get_clear_errors(model, tokenizer, tmp_path):
    for blank in ("  ", "\ufeff", "\u200b \u2060"):  # spaces; a byte-order mark, zero-width characters
        with pytest.raises(ValueError, match="source sentence is empty"):
            attention_maps(model, tokenizer, blank)
        with pytest.raises(ValueError, match="target sentence is empty"):
            attention_maps(model, tokenizer, SOURCE, blank)
    with pytest.raises(ValueError, match="labels"):
        plot_attention_grid(torch.rand(1, 1, 2, 3), ["a"], ["a", "b", "c"], tmp_path / "x.png", title="t")
    with pytest.raises(ValueError, match="even d_model"):
        plot_positional_encoding(tmp_path / "pe.png", d_model=7)
    # Sizes that once ran out of memory: a picture of 10^6 positions, a sentence of 10^4 tokens.
    with pytest.raises(ValueError, match=f"length <= {MAX_ENCODING_POSITIONS}"):
        plot_positional_encoding(tmp_path / "pe.png", length=10**6)
    with pytest.raises(ValueError, match=rf"source sentence is .* tokens long; .* at most {MAX_MAP_TOKENS}"):
        attention_maps(model, tokenizer, "word " * 10_000)
    with pytest.raises(ValueError, match=r"target sentence is .* tokens long"):
        attention_maps(model, tokenizer, SOURCE, "word " * 10_000)
    # The model's own translation too (a source near the limit gets up to 50 tokens more).
    longest = {"max_new_tokens": MAX_MAP_TOKENS + 1, "min_new_tokens": MAX_MAP_TOKENS + 1, "num_beams": 1}
    with pytest.raises(ValueError, match=rf"translated sentence is {MAX_MAP_TOKENS + 1} tokens long"):
        attention_maps(model, tokenizer, SOURCE, **longest)


def test_position_similarity_is_the_papers_formula():
    d_model, length = 64, 40
    similarity = position_similarity(length, d_model)
    frequencies = 10000.0 ** (-torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    offsets = torch.arange(length, dtype=torch.float64)
    expected = torch.cos((offsets[:, None] - offsets[None, :])[..., None] * frequencies).sum(-1) / (
        d_model / 2
    )
    torch.testing.assert_close(similarity, expected, atol=1e-12, rtol=0)
    torch.testing.assert_close(similarity.diagonal(), torch.ones(length, dtype=torch.float64))
    torch.testing.assert_close(similarity[5, 5:25], similarity[10, 10:30])  # depends on the offset only
    assert similarity[10, 11] > similarity[10, 14] > similarity[10, 30]  # near positions more alike


def test_positional_encoding_picture_draws_the_encoding(tmp_path):
    figure = plot_positional_encoding(tmp_path / "pe.png", d_model=32, length=20)
    encoding_panel, similarity_panel = (ax for ax in figure.axes if ax.images)
    drawn = torch.from_numpy(encoding_panel.images[0].get_array().data)
    positions = torch.arange(20, dtype=torch.float64)[:, None]
    two_i = torch.arange(0, 32, 2, dtype=torch.float64)
    torch.testing.assert_close(drawn[:, 0::2], torch.sin(positions / 10000 ** (two_i / 32)))
    torch.testing.assert_close(drawn[:, 1::2], torch.cos(positions / 10000 ** (two_i / 32)))
    torch.testing.assert_close(
        torch.from_numpy(similarity_panel.images[0].get_array().data), position_similarity(20, 32)
    )


def test_script_writes_the_four_pictures(model, tokenizer, tmp_path, run_in_process):
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    pair = ["--source", SOURCE, "--target", TARGET, "--device", "cpu"]
    result = run_in_process(
        "visualize_attention.py", "--model", str(folder), *pair, "--output_dir", str(tmp_path / "out")
    )
    assert result.returncode == 0, result.stderr
    written = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert written == [
        "cross_attention.png",
        "decoder_self_attention.png",
        "encoder_self_attention.png",
        "positional_encoding.png",
    ]
    missing = run_in_process("visualize_attention.py", "--model", str(tmp_path / "nope"), "--source", "x")
    assert missing.returncode == 2 and "No model folder" in missing.stderr


@pytest.mark.slow  # scripts in their own processes under another locale
def test_scripts_print_utf_8_whatever_the_locale(model, tokenizer, tmp_path):
    """Standard output had the locale's encoding (cp1252 on Windows, with output redirected): every token
    this script prints starts with "\u2581", which ended it in a UnicodeEncodeError after its pictures
    were written, as any script printing a sample in another script ended (train.py). Every script
    now writes UTF-8, as translate.py did."""
    import os
    import subprocess
    import sys

    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    environment = {**os.environ, "PYTHONUTF8": "0", "PYTHONIOENCODING": "cp1252"}  # the locale's for argv
    command = [sys.executable, str(ROOT / "scripts" / "visualize_attention.py"), "--model", str(folder)]
    command += ["--source", SOURCE, "--target", TARGET, "--output_dir", str(tmp_path / "out")]
    result = subprocess.run(command, capture_output=True, env=environment, timeout=300, check=False)
    assert result.returncode == 0, result.stderr.decode(errors="replace")[-3000:]
    assert "source: \u2581" in result.stdout.decode("utf-8")
    unconverted = [p.name for p in (ROOT / "scripts").glob("*.py") if "utf8_stdout()" not in p.read_text()]
    assert unconverted == []


def test_script_draws_another_models_attention_and_says_why_not_its_encoding(
    tokenizer, tmp_path, run_in_process
):
    """A MarianMTModel folder (finetune.py writes them) got its attention maps, then an AttributeError: its
    configuration has no position_encoding_layout."""
    from transformers import MarianConfig, MarianMTModel

    config = MarianConfig(
        vocab_size=len(tokenizer),
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.bos_token_id,
    )
    MarianMTModel(config).save_pretrained(tmp_path / "marian")
    tokenizer.save_pretrained(tmp_path / "marian")
    flags = ["--source", SOURCE, "--target", TARGET, "--output_dir", str(tmp_path / "out"), "--device", "cpu"]
    result = run_in_process("visualize_attention.py", "--model", str(tmp_path / "marian"), *flags)
    assert result.returncode == 0, result.stderr
    assert "positional_encoding.png not drawn" in result.stderr and "'marian' model" in result.stderr
    written = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert written == ["cross_attention.png", "decoder_self_attention.png", "encoder_self_attention.png"]


def test_script_says_how_long_a_sentence_a_many_headed_model_can_draw(tokenizer, tmp_path, run_in_process):
    """8 layers of 16 heads: a sentence of 100 tokens would make a picture too large to render."""
    folder = tmp_path / "model"
    tiny_model(
        "sdpa", vocab_size=len(tokenizer), num_heads=16, num_encoder_layers=8, num_decoder_layers=8
    ).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    source = " ".join([SOURCE] * 8)
    assert 100 < len(tokenizer(source)["input_ids"]) <= MAX_MAP_TOKENS
    result = run_in_process(
        "visualize_attention.py",
        "--model",
        str(folder),
        "--source",
        source,
        "--target",
        TARGET,
        "--device",
        "cpu",
        "--output_dir",
        str(tmp_path / "out"),
    )
    assert result.returncode == 2 and "give sentences of at most" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not any((tmp_path / "out").iterdir())


def test_script_refuses_an_output_dir_that_is_a_file_before_loading(tmp_path, run_in_process):
    """It once loaded and ran the model, then failed with a traceback when making the folder."""
    afile = tmp_path / "afile"
    afile.write_text("mine")
    model = ["--model", str(tmp_path / "nope"), "--source", "x"]
    # the first existing folder on the way is a file
    result = run_in_process("visualize_attention.py", *model, "--output_dir", str(afile / "sub"))
    assert result.returncode == 2 and f"{afile} is a file, not a folder" in result.stderr, result.stderr
    assert afile.read_text() == "mine"


def test_script_refuses_an_output_dir_it_cannot_make_before_loading(tmp_path, run_in_process):
    """It once loaded and ran the model, then failed with a traceback from mkdir."""
    output_dir = tmp_path / ("x" * 300) / "maps"  # a name too long for the file system
    model = ["--model", str(tmp_path / "nope"), "--source", "x"]
    result = run_in_process("visualize_attention.py", *model, "--output_dir", str(output_dir))
    assert result.returncode == 2 and f"error: --output_dir {output_dir}: File name too long" in result.stderr
    assert "No model folder" not in result.stderr


def test_script_refuses_an_empty_output_dir(tmp_path, run_in_process, monkeypatch):
    """An empty --output_dir (an unset shell variable) wrote the attention maps into the current folder
    and the positional encoding into the file system's root, as /positional_encoding.png."""
    monkeypatch.chdir(tmp_path)
    model = ["--model", str(tmp_path / "nope"), "--source", "x"]
    result = run_in_process("visualize_attention.py", *model, "--output_dir", "")
    assert result.returncode == 2 and "--output_dir is empty" in result.stderr, result.stderr
    assert "No model folder" not in result.stderr  # refused before the model loads


def test_positional_encoding_picture_names_the_concatenated_layouts_formula(tmp_path):
    """Its title once gave the interleaved formula (odd dimensions cosines) for any layout."""
    figure = plot_positional_encoding(tmp_path / "pe.png", d_model=8, length=10, layout="concatenated")
    panel = next(ax for ax in figure.axes if ax.images)
    drawn = torch.from_numpy(panel.images[0].get_array().data)
    positions = torch.arange(10, dtype=torch.float64)[:, None]
    torch.testing.assert_close(drawn[:, 1], torch.sin(positions[:, 0] / 10000 ** (2 / 8)))  # a sine
    assert "2i+1) = cos" not in panel.get_title() and "PE(pos, 4+i) = cos" in panel.get_title()
    assert "0-3: sin, 4-7: cos" in panel.get_xlabel()


def test_a_failed_write_leaves_the_pictures_that_were_there(
    model, tokenizer, tmp_path, run_in_process, monkeypatch
):
    """The pictures were written straight over the earlier ones: a full disk left half a PNG in place of
    a whole one."""
    import errno

    from matplotlib.figure import Figure

    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    flags = [
        "--model",
        str(folder),
        "--source",
        SOURCE,
        "--device",
        "cpu",
        "--output_dir",
        str(tmp_path / "out"),
    ]
    assert run_in_process("visualize_attention.py", *flags, "--target", TARGET).returncode == 0
    before = {path.name: path.read_bytes() for path in (tmp_path / "out").iterdir()}

    def full_disk(self, target, *args, **kwargs):  # some bytes reach the disk, then it is full
        if isinstance(target, (str, Path)):
            Path(target).write_bytes(b"\x89PNG half")
        else:
            target.write(b"\x89PNG half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", full_disk)
    failed = run_in_process("visualize_attention.py", *flags)
    assert failed.returncode == 1 and "No space left on device" in failed.stderr, failed.stderr
    assert {path.name: path.read_bytes() for path in (tmp_path / "out").iterdir()} == before


def test_sentences_are_read_as_the_training_data_is(model, tokenizer, keeping_spaces_at_the_ends):
    # A folder saved before the tokenizer stripped the ends (e107b12) still encodes a sentence's line break
    # or surrounding spaces as word-start tokens no training sentence has: the maps are read as translate's.
    kept = keeping_spaces_at_the_ends(tokenizer)
    maps = attention_maps(model, kept, f" {SOURCE}\n", f"{TARGET}\n")
    expected = attention_maps(model, tokenizer, SOURCE, TARGET)
    assert maps.source_tokens == expected.source_tokens and maps.target_tokens == expected.target_tokens
    torch.testing.assert_close(maps.cross, expected.cross)
