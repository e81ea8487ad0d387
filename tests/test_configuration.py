import dataclasses
import json

import pytest

from vanilla_transformer import PRESETS, VanillaTransformerConfig


def test_defaults_are_the_paper_base_model():
    config = VanillaTransformerConfig()
    assert (config.d_model, config.num_heads, config.d_ff) == (512, 8, 2048)
    assert (config.num_encoder_layers, config.num_decoder_layers) == (6, 6)
    assert config.dropout == 0.1 and config.label_smoothing == 0.1
    assert config.attention_dropout == 0.0 and config.activation_dropout == 0.0
    assert config.activation_function == "relu"
    assert (
        config.norm_first is False and config.scale_embedding is True and config.tie_word_embeddings is True
    )
    assert config.position_encoding_layout == "interleaved"
    assert config.is_encoder_decoder and config.head_dim == 64


def test_attention_bias_is_off_as_in_the_paper_and_on_for_configurations_saved_before_it():
    assert VanillaTransformerConfig().attention_bias is False
    assert VanillaTransformerConfig.from_dict({}).attention_bias is True  # a config.json from before it
    assert VanillaTransformerConfig.from_dict({"attention_bias": False}).attention_bias is False
    assert VanillaTransformerConfig.from_dict(VanillaTransformerConfig().to_dict()).attention_bias is False
    with pytest.raises(ValueError, match="`attention_bias` must be True or False, got 'false'"):
        VanillaTransformerConfig(attention_bias="false")


def test_a_config_json_from_before_attention_bias_read_by_from_json_file_has_the_biases(tmp_path):
    """`from_json_file` (public, documented by transformers) builds `cls(**dict)`, not `from_dict`: a
    config.json saved before the field then described a network without the biases its weights have."""
    saved = VanillaTransformerConfig(d_model=16, num_heads=2).to_dict()
    del saved["attention_bias"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert VanillaTransformerConfig.from_json_file(tmp_path / "config.json").attention_bias is True
    saved["attention_bias"] = False
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert VanillaTransformerConfig.from_json_file(tmp_path / "config.json").attention_bias is False


def test_presets_and_overrides():
    big = VanillaTransformerConfig.from_preset("big")
    assert (big.d_model, big.num_heads, big.d_ff, big.dropout) == (1024, 16, 4096, 0.3)
    assert VanillaTransformerConfig.from_preset("base").to_dict() == VanillaTransformerConfig().to_dict()
    tiny = VanillaTransformerConfig.from_preset("tiny", vocab_size=500, dropout=0.2)
    assert tiny.d_model == PRESETS["tiny"]["d_model"] and tiny.vocab_size == 500 and tiny.dropout == 0.2
    # The paper's sizes are its network; the CPU recipe's keeps the attention biases it was tuned with.
    assert not big.attention_bias and not VanillaTransformerConfig.from_preset("base").attention_bias
    assert tiny.attention_bias
    with pytest.raises(ValueError, match="Unknown preset 'huge'"):
        VanillaTransformerConfig.from_preset("huge")
    # A misspelt field was kept as an unused attribute, the preset's value in force.
    with pytest.raises(
        ValueError, match=r"\['dropuot'\] are no fields .* \(dropuot: did you mean 'dropout'\?\)"
    ):
        VanillaTransformerConfig.from_preset("tiny", dropuot=0.3)
    # transformers' own fields and the standard names are fields.
    aliased = VanillaTransformerConfig.from_preset("tiny", hidden_size=64, output_attentions=True)
    assert aliased.d_model == 64 and aliased.output_attentions is True
    # A property or method passed the check, and setting `head_dim` failed as an AttributeError.
    with pytest.raises(ValueError, match=r"\['head_dim'\] are no fields .* d_model / num_heads: set those\)"):
        VanillaTransformerConfig.from_preset("tiny", head_dim=32)
    with pytest.raises(ValueError, match=r"\['save_pretrained'\] are no fields"):
        VanillaTransformerConfig.from_preset("tiny", save_pretrained=1)


def test_standard_attribute_names_are_aliases():
    config = VanillaTransformerConfig(
        d_model=64, num_heads=4, d_ff=128, num_encoder_layers=3, num_decoder_layers=2
    )
    assert config.hidden_size == 64 and config.num_attention_heads == 4 and config.intermediate_size == 128
    assert config.encoder_layers == 3 and config.decoder_layers == 2 and config.num_hidden_layers == 2
    config.hidden_size = 128
    assert config.d_model == 128


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"d_model": 100, "num_heads": 8}, "divisible by `num_heads`"),
        ({"d_model": 0}, "`d_model` must be a positive"),
        ({"vocab_size": -1}, "`vocab_size` must be a positive"),
        ({"num_encoder_layers": 0}, "`num_encoder_layers` must be a positive"),
        ({"d_model": 6, "num_heads": 2}, None),
        ({"d_model": 9, "num_heads": 3}, "must be even"),
        ({"dropout": 1.0}, r"`dropout` must be in \[0, 1\)"),
        ({"attention_dropout": -0.1}, "`attention_dropout`"),
        ({"label_smoothing": 1.5}, "`label_smoothing`"),
        ({"activation_function": "sigmoidish"}, "Unknown `activation_function`"),
        ({"position_encoding_layout": "rotary"}, "Unknown `position_encoding_layout`"),
        ({"pad_token_id": 37000}, "`pad_token_id`"),
        ({"eos_token_id": [2, 99999]}, "`eos_token_id`"),
        ({"decoder_vocab_size": 500}, "`decoder_vocab_size` \\(500\\) differs"),
        (
            {"share_encoder_decoder_embeddings": False, "decoder_vocab_size": 0},
            "`decoder_vocab_size` must be",
        ),
        ({"layer_norm_eps": 0.0}, "`layer_norm_eps`"),
        ({"layer_norm_eps": float("nan")}, "`layer_norm_eps`"),
        ({"qkv_init_gain": 0.0}, "`qkv_init_gain` must be a positive finite number"),
        ({"qkv_init_gain": float("inf")}, "`qkv_init_gain` must be a positive finite number, got inf"),
        # Types: these passed and failed later in torch (or in a comparison naming no field).
        ({"d_model": 32.0}, "`d_model` must be a positive integer, got 32.0"),
        ({"num_heads": True}, "`num_heads` must be a positive integer, got True"),
        ({"d_ff": None}, "`d_ff` must be a positive integer, got None"),
        ({"dropout": None}, "`dropout` must be a number, got None"),
        ({"label_smoothing": "0.1"}, "`label_smoothing` must be a number, got '0.1'"),
        ({"pad_token_id": 0.0}, "`pad_token_id` must be an integer token id or None, got 0.0"),
        ({"decoder_start_token_id": False}, "`decoder_start_token_id` must be an integer"),
        ({"eos_token_id": []}, "`eos_token_id` is an empty list"),
        ({"activation_function": ["relu"]}, "Unknown `activation_function`"),
        ({"norm_first": "false"}, "`norm_first` must be True or False, got 'false'"),
        ({"scale_embedding": None}, "`scale_embedding` must be True or False, got None"),
        ({"tie_word_embeddings": 0}, "`tie_word_embeddings` must be True or False, got 0"),
        ({"is_encoder_decoder": False}, "`is_encoder_decoder` must be True"),  # generate() failed
        # A quoted "false" (a hand-edited config.json) is truthy: every forward built a cache.
        ({"use_cache": "false"}, "`use_cache` must be True or False, got 'false'"),
    ],
)
def test_invalid_values_raise_value_error_naming_the_field(overrides, message):
    if message is None:
        assert VanillaTransformerConfig(**overrides).head_dim == 3
        return
    with pytest.raises(ValueError, match=message):
        VanillaTransformerConfig(**overrides)


def test_save_and_load_round_trip(tmp_path):
    config = VanillaTransformerConfig.from_preset(
        "tiny", norm_first=True, position_encoding_layout="concatenated"
    )
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "vanilla_transformer"
    loaded = VanillaTransformerConfig.from_pretrained(tmp_path)
    assert loaded.to_dict() == config.to_dict()
    # Against the values set, not only `to_dict` on both sides (a field it dropped compared equal).
    assert saved["norm_first"] is True and saved["position_encoding_layout"] == "concatenated"
    assert loaded.norm_first is True and loaded.position_encoding_layout == "concatenated"
    fields = [f.name for f in dataclasses.fields(config) if f.name != "transformers_version"]  # set on saving
    assert all(getattr(loaded, name) == getattr(config, name) for name in fields)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"label_smoothing": 1.5}, "`label_smoothing`"),
        ({"dropout": -1.0}, r"`dropout` must be in \[0, 1\)"),
        ({"num_heads": 5}, "divisible by `num_heads`"),
        ({"hidden_size": 7}, "divisible by `num_heads`"),  # an alias, set after the config is built
    ],
)
def test_loading_overrides_are_checked_like_constructor_arguments(tmp_path, overrides, message):
    # transformers sets these keyword overrides on the loaded config after its own checks ran.
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    from vanilla_transformer import VanillaTransformerForConditionalGeneration

    VanillaTransformerConfig.from_preset("tiny", vocab_size=64).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        AutoConfig.from_pretrained(tmp_path, **overrides)
    VanillaTransformerForConditionalGeneration(
        VanillaTransformerConfig.from_preset("tiny", vocab_size=64)
    ).save_pretrained(tmp_path)
    for loader in (
        VanillaTransformerForConditionalGeneration.from_pretrained,
        AutoModelForSeq2SeqLM.from_pretrained,
    ):
        with pytest.raises(ValueError, match=message):
            loader(tmp_path, **overrides)
    good = AutoConfig.from_pretrained(tmp_path, label_smoothing=0.2, return_unused_kwargs=True, other=1)
    assert good[0].label_smoothing == 0.2 and good[1] == {"other": 1}
    # A new size for the one shared vocabulary sizes both sides, as the constructor does (the saved
    # decoder_vocab_size once made this override fail the check).
    resized = AutoConfig.from_pretrained(tmp_path, vocab_size=80)
    assert (resized.vocab_size, resized.decoder_vocab_size) == (80, 80)


def test_a_hand_edited_config_file_with_a_float_size_is_refused_on_loading(tmp_path):
    VanillaTransformerConfig.from_preset("tiny", vocab_size=64).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**saved, "d_model": 192.0}))
    with pytest.raises(ValueError, match=r"`d_model` must be a positive integer, got 192\.0"):
        VanillaTransformerConfig.from_pretrained(tmp_path)


def test_a_hand_edited_config_file_with_a_quoted_flag_is_refused_on_loading(tmp_path):
    # "false" is truthy: the folder's post-LN model loaded as a pre-LN one.
    VanillaTransformerConfig.from_preset("tiny", vocab_size=64).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**saved, "norm_first": "false"}))
    with pytest.raises(ValueError, match="`norm_first` must be True or False, got 'false'"):
        VanillaTransformerConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_heads": 5}, "divisible by `num_heads`"),  # was a view() shape error in the forward pass
        ({"vocab_size": 30}, r"`decoder_vocab_size` \(50\) differs"),  # was a model of two sizes
        ({"pad_token_id": 99}, "`pad_token_id`"),  # was an assertion in nn.Embedding
        ({"activation_function": "sigmoidish"}, "Unknown `activation_function`"),  # was a KeyError
    ],
)
def test_fields_set_after_construction_are_checked_when_a_model_is_built(changes, message):
    from vanilla_transformer import VanillaTransformerForConditionalGeneration, VanillaTransformerModel

    config = VanillaTransformerConfig(
        vocab_size=50, d_model=16, num_heads=2, d_ff=32, num_encoder_layers=1, num_decoder_layers=1
    )
    config.update(changes)
    for model_class in (VanillaTransformerModel, VanillaTransformerForConditionalGeneration):
        with pytest.raises(ValueError, match=message):
            model_class(config)


def test_numpy_numbers_are_sizes_and_rates_as_python_ones_are():
    """The integer and number checks take NumPy's scalars (`len(...)` of an array, a swept rate), as the
    comparisons before them did; bools and floats stay refused as sizes."""
    numpy = pytest.importorskip("numpy")
    config = VanillaTransformerConfig(
        vocab_size=numpy.int64(50), d_model=numpy.int32(16), num_heads=2, d_ff=32, dropout=numpy.float32(0.1)
    )
    assert config.vocab_size == 50 and config.d_model == 16
    with pytest.raises(ValueError, match="`d_model` must be a positive integer"):
        VanillaTransformerConfig(vocab_size=50, d_model=numpy.float64(16.0), num_heads=2, d_ff=32)


def test_a_configuration_with_numpy_numbers_prints_and_saves_as_python_numbers(tmp_path):
    """json cannot write NumPy scalars: a configuration given them (which the checks take) failed to print,
    and its model's save_pretrained stopped with "Object of type int64 is not JSON serializable", also
    for one set after the model was built."""
    numpy = pytest.importorskip("numpy")
    from vanilla_transformer import VanillaTransformerForConditionalGeneration

    config = VanillaTransformerConfig(
        vocab_size=numpy.int64(50),
        d_model=numpy.int32(16),
        num_heads=2,
        d_ff=32,
        num_encoder_layers=1,
        num_decoder_layers=1,
        dropout=numpy.float32(0.25),
        eos_token_id=[numpy.int64(2), 3],
    )
    assert '"vocab_size": 50' in repr(config)
    model = VanillaTransformerForConditionalGeneration(config)
    model.config.label_smoothing = numpy.float64(0.2)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert (saved["vocab_size"], saved["d_model"], saved["eos_token_id"]) == (50, 16, [2, 3])
    assert (saved["dropout"], saved["label_smoothing"]) == (0.25, 0.2)
    assert VanillaTransformerConfig.from_pretrained(tmp_path).to_dict() == model.config.to_dict()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"label_smoothing": 1.5}, r"`label_smoothing` must be in \[0, 1\), got 1.5"),
        ({"label_smoothing": -0.5}, r"`label_smoothing` must be in \[0, 1\), got -0.5"),
        ({"label_smoothing": "0.1"}, "`label_smoothing` must be a number, got '0.1'"),
        ({"unlikelihood_weight": -1.0}, "`unlikelihood_weight` must be a non-negative finite number, got -1"),
    ],
)
def test_loss_settings_set_after_the_model_is_built_are_checked_as_they_are_set(changes, message):
    """The loss reads `label_smoothing` and `unlikelihood_weight` at each forward, and setting them on a
    built model is the documented way to change it (the model's own warning says so). Set there, they
    missed the checks: training took a smoothing of 1.5 or -0.5 without a word, which torch's
    cross entropy (the eval-mode loss) refuses. Now the assignment itself is refused, and the loss
    keeps the value before it."""
    import torch
    import torch.nn.functional as F

    from vanilla_transformer import VanillaTransformerForConditionalGeneration

    torch.manual_seed(0)
    model = VanillaTransformerForConditionalGeneration(
        VanillaTransformerConfig(
            vocab_size=20, d_model=8, num_heads=2, d_ff=16, num_encoder_layers=1, num_decoder_layers=1
        )
    )
    ids = torch.tensor([[5, 6, 7, 2]])
    model.config.label_smoothing = 0.2  # a good value set later is the loss's: torch's smoothed loss
    model.eval()
    output = model(input_ids=ids, labels=ids)
    assert torch.allclose(output.loss, F.cross_entropy(output.logits[0], ids[0], label_smoothing=0.2))
    with pytest.raises(ValueError, match=message):
        model.config.update(changes)
    with pytest.raises(ValueError, match=message):
        setattr(model.config, *next(iter(changes.items())))
    assert model.config.label_smoothing == 0.2 and model.config.unlikelihood_weight == 0.0
    assert torch.equal(model(input_ids=ids, labels=ids).loss, output.loss)
