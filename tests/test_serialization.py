"""Saving, loading (also without this package installed), Auto classes, tying and checkpointing."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import logged_messages
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM, GenerationConfig

from tests.conftest import EOS, TINY_TERMS, assert_same_up_to_rounding, gradient_scale, tiny_model
from vanilla_transformer import VanillaTransformerForConditionalGeneration, VanillaTransformerModel
from vanilla_transformer.configuration_vanilla_transformer import check_transformers_version
from vanilla_transformer.kernels_vanilla_transformer import set_linear_kernel


def test_attention_biases_are_saved_and_a_folder_from_before_the_field_keeps_them(tmp_path, batch):
    """The paper's projections have no biases (the default); a config.json written before
    `attention_bias` existed describes a model that had them: loaded as one without, its biases
    would be dropped, with only a warning."""
    paper = tiny_model()
    paper.save_pretrained(tmp_path / "paper")
    assert json.loads((tmp_path / "paper" / "config.json").read_text())["attention_bias"] is False
    assert not any(key.endswith("proj.bias") for key in load_file(tmp_path / "paper" / "model.safetensors"))
    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "paper")
    assert (
        loaded.config.attention_bias is False and loaded.model.encoder.layers[0].self_attn.q_proj.bias is None
    )

    biased = tiny_model(attention_bias=True)
    with torch.no_grad():
        for name, parameter in biased.named_parameters():
            if name.endswith("proj.bias"):  # trained biases, not the initial zeros
                parameter.normal_()
    biased.save_pretrained(tmp_path / "older")
    config = json.loads((tmp_path / "older" / "config.json").read_text())
    del config["attention_bias"]
    (tmp_path / "older" / "config.json").write_text(json.dumps(config))
    loaded, info = AutoModelForSeq2SeqLM.from_pretrained(
        tmp_path / "older", attn_implementation="eager", output_loading_info=True
    )
    assert loaded.config.attention_bias is True
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        assert torch.equal(loaded.eval()(**batch).logits, biased(**batch).logits)


def test_save_load_round_trip_gives_identical_logits(tmp_path, batch):
    model = tiny_model(norm_first=True, position_encoding_layout="concatenated")
    model.save_pretrained(tmp_path)
    files = {path.name for path in tmp_path.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors"} <= files
    assert {"configuration_vanilla_transformer.py", "modeling_vanilla_transformer.py"} <= files
    # Positions are computed, not stored; the tied matrix is stored once.
    keys = load_file(tmp_path / "model.safetensors").keys()
    assert not any("position" in key for key in keys)
    assert "model.shared.weight" in keys and "lm_head.weight" not in keys

    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(loaded) is VanillaTransformerForConditionalGeneration
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).logits, model(**batch).logits, atol=0, rtol=0)
    assert loaded.generation_config.num_beams == 4


def test_auto_classes_resolve_the_model_type(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_vanilla_transformer.VanillaTransformerConfig",
        "AutoModel": "modeling_vanilla_transformer.VanillaTransformerModel",
        "AutoModelForSeq2SeqLM": "modeling_vanilla_transformer.VanillaTransformerForConditionalGeneration",
    }
    assert AutoConfig.from_pretrained(tmp_path).model_type == "vanilla_transformer"
    base = AutoModel.from_pretrained(tmp_path)
    assert type(base) is VanillaTransformerModel
    torch.testing.assert_close(base.shared.weight, model.model.shared.weight)


def test_meta_device_loading_keeps_positions_and_ties(tmp_path, batch):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForSeq2SeqLM.from_pretrained(
        tmp_path, device_map="cpu", attn_implementation="eager"
    ).eval()
    assert loaded.lm_head.weight is loaded.model.shared.weight
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).logits, model(**batch).logits, atol=0, rtol=0)


def test_trust_remote_code_load_without_the_package(tmp_path, batch, monkeypatch, request):
    model = tiny_model()
    model.save_pretrained(tmp_path / "model")
    # The modeling code travels with its relative imports: the kernel module too.
    assert (tmp_path / "model" / "kernels_vanilla_transformer.py").is_file()
    # One kernel on both sides, so that the comparison below is of code, not of summation order.
    monkeypatch.setenv("VANILLA_TRANSFORMER_ONEDNN", "torch")
    previous = set_linear_kernel("torch")
    request.addfinalizer(lambda: set_linear_kernel(previous))
    with torch.no_grad():
        expected = model.generate(
            batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=6
        )
    torch.save({"batch": batch, "expected": expected}, tmp_path / "io.pt")
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["vanilla_transformer"] = None  # any import of the package now fails
        import torch
        from transformers import AutoConfig, AutoModelForSeq2SeqLM
        try:
            import vanilla_transformer
        except ImportError:
            pass
        else:
            raise SystemExit("the package is importable")
        folder = {str(tmp_path / "model")!r}
        assert AutoConfig.from_pretrained(folder, trust_remote_code=True).model_type == "vanilla_transformer"
        model = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True).eval()
        assert "vanilla_transformer" not in type(model).__module__.split(".")[0]
        io = torch.load({str(tmp_path / "io.pt")!r})
        batch = io["batch"]
        generated = model.generate(
            batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=6
        )
        assert torch.equal(generated, io["expected"]), (generated, io["expected"])
        model.save_pretrained({str(tmp_path / "resaved")!r})  # the pipeline never used in this process
        print("remote code OK", type(model).__module__)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "remote code OK transformers_modules" in result.stdout
    # Saved again from the remote code, the folder still carries all its code and its pipeline entry.
    original, resaved = tmp_path / "model", tmp_path / "resaved"
    for name in ("modeling", "kernels", "configuration", "pipeline"):
        code = f"{name}_vanilla_transformer.py"
        assert (resaved / code).read_bytes() == (original / code).read_bytes(), code
    pipelines = json.loads((resaved / "config.json").read_text())["custom_pipelines"]
    assert pipelines == json.loads((original / "config.json").read_text())["custom_pipelines"]
    assert pipelines["translation"]["impl"] == "pipeline_vanilla_transformer.TranslationPipeline"


@pytest.mark.slow  # a process for each version read, the package out of its reach
@pytest.mark.parametrize("old", ["4.57.6", "5.20.2"])
def test_a_folder_loaded_by_an_older_transformers_names_the_version_it_needs(tmp_path, old):
    """A folder's code on transformers 4.57 failed at loading with "must be called with a dataclass type
    or instance", on 5.20 at the first `generate()` with an unexpected keyword argument 'cache'. Here
    the installed version is made to read as the old one, the package out of reach."""
    tiny_model().save_pretrained(tmp_path / "model")
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["vanilla_transformer"] = None
        import transformers
        transformers.__version__ = {old!r}
        from transformers import AutoConfig
        AutoConfig.from_pretrained({str(tmp_path / "model")!r}, trust_remote_code=True)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules")},
    )
    assert result.returncode != 0
    expected = f"needs transformers 5.24 or later, and this Python has {old}: pip install -U"
    assert expected in result.stderr, result.stderr[-3000:]
    check_transformers_version("5.24.0")
    check_transformers_version("5.25.0")
    with pytest.raises(ImportError, match=r'pip install -U "transformers>=5.24"'):
        check_transformers_version("5.24.0.dev0")


def test_untied_output_projection_survives_save_and_load(tmp_path):
    model = tiny_model(tie_word_embeddings=False)
    assert model.lm_head.weight is not model.model.shared.weight
    model.save_pretrained(tmp_path)
    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is not loaded.model.shared.weight
    assert loaded.model.encoder.embed_tokens is loaded.model.shared is loaded.model.decoder.embed_tokens
    torch.testing.assert_close(loaded.lm_head.weight, model.lm_head.weight)


@pytest.mark.parametrize("stored_as", [None, "model.encoder.embed_tokens.weight", "lm_head.weight"])
def test_a_checkpoint_without_the_shared_matrix_loads_as_marians_does(tmp_path, stored_as):
    """transformers' own common test (`test_model_weights_reload_no_missing_tied_weights`): a checkpoint
    without `model.shared.weight` loaded with the embedding left on the meta device and no missing key
    (generate() then failed on a meta tensor), or, with the matrix under `lm_head.weight` alone, failed
    comparing meta tensors. MarianMTModel reports the matrix missing and initialises it, or ties it from
    the copy that is present: so does this model now."""
    from safetensors.torch import save_file

    model = tiny_model()
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    shared = weights.pop("model.shared.weight")
    if stored_as is not None:
        weights[stored_as] = shared.clone()
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded, info = VanillaTransformerForConditionalGeneration.from_pretrained(
        tmp_path, output_loading_info=True
    )
    assert not [name for name, tensor in loaded.named_parameters(remove_duplicate=False) if tensor.is_meta]
    assert loaded.model.encoder.embed_tokens is loaded.model.shared is loaded.model.decoder.embed_tokens
    assert loaded.lm_head.weight is loaded.model.shared.weight
    if stored_as is None:  # reported and initialised, as Marian's
        assert "model.shared.weight" in info["missing_keys"]
        assert not torch.equal(loaded.model.shared.weight, shared)
    else:  # tied from the copy present
        assert not info["missing_keys"] and torch.equal(loaded.model.shared.weight, shared)
    assert loaded.generate(torch.tensor([[5, 6, 7, EOS]]), num_beams=1, max_new_tokens=2).shape[1] <= 3


def test_resize_token_embeddings_keeps_the_three_way_tie(tmp_path, batch):
    model = tiny_model()
    model.resize_token_embeddings(120)
    assert model.config.vocab_size == 120
    assert model.lm_head.weight is model.model.shared.weight
    assert model.model.encoder.embed_tokens is model.model.shared is model.model.decoder.embed_tokens
    assert model(**batch).logits.shape[-1] == 120
    model.save_pretrained(tmp_path)
    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path)
    assert (
        loaded.model.shared.weight.shape == (120, 32) and loaded.lm_head.weight is loaded.model.shared.weight
    )


def test_resizing_an_untied_output_layer_keeps_it_a_decoding_layer(tmp_path, batch):
    """transformers rebuilds an untied output layer as a plain `nn.Linear` when resizing: the layer
    lost the kernel class (and its per-step decoding kernel) that a model built or loaded has."""
    from vanilla_transformer.kernels_vanilla_transformer import Linear

    model = tiny_model(tie_word_embeddings=False)
    before = model(**batch).logits
    old_size = before.shape[-1]
    model.resize_token_embeddings(old_size + 20)
    head = model.lm_head
    assert type(head) is Linear and head.per_step and head.weight.shape == (old_size + 20, 32)
    assert head.weight is not model.model.shared.weight
    after = model(**batch).logits
    assert after.shape[-1] == old_size + 20
    assert_same_up_to_rounding(after[..., :old_size], before, TINY_TERMS)  # the old rows kept
    generated = model.generate(batch["input_ids"], num_beams=1, max_new_tokens=5)
    plain = model.generate(batch["input_ids"], num_beams=1, max_new_tokens=5, use_cache=False)
    assert torch.equal(generated, plain)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path)
    assert type(loaded.lm_head) is Linear and torch.equal(loaded.lm_head.weight, head.weight)
    # `post_init()` after resizing (transformers' own tests call it) re-drew the whole layer.
    resized = head.weight.detach().clone()
    model.post_init()
    assert torch.equal(model.lm_head.weight, resized)


def test_resizing_below_a_special_token_is_refused_before_anything_changes():
    """Shrunk below the end-of-sentence id, a model once generated with warnings, saved, and then failed
    to load; the size counts `pad_to_multiple_of`."""
    model = tiny_model()
    before = model.model.shared.weight.clone()
    with pytest.raises(ValueError, match="eos_token_id"):
        model.resize_token_embeddings(EOS)
    assert torch.equal(model.model.shared.weight, before) and model.config.vocab_size == before.shape[0]
    model.resize_token_embeddings(EOS, pad_to_multiple_of=8)  # rounded up to 8: every special id fits
    assert model.config.vocab_size == 8
    for multiple in (1.3, 8.0, 0, -8):  # the size it made was blamed on vocab_size ("got 100.1")
        with pytest.raises(
            ValueError, match=rf"pad_to_multiple_of must be a positive integer, got {multiple}"
        ):
            model.resize_token_embeddings(99, pad_to_multiple_of=multiple)
    assert model.config.vocab_size == 8
    import numpy as np

    model.resize_token_embeddings(np.int64(99), pad_to_multiple_of=np.int64(8))  # transformers: ints only
    assert model.config.vocab_size == 104


def test_resizing_the_base_model_resizes_the_decoder_vocabulary_too(tmp_path, batch):
    """`AutoModel`'s class resized its shared matrix but left `decoder_vocab_size` at the old size: the
    decoder refused the new ids, and the saved folder failed to load (sizes that disagree while shared)."""
    model = VanillaTransformerModel(tiny_model().config).eval()
    model.resize_token_embeddings(120)
    assert model.config.vocab_size == model.config.decoder_vocab_size == 120
    assert model.decoder.embed_tokens is model.shared and model.shared.weight.shape[0] == 120
    new_ids = torch.tensor([[110, 2]])
    out = model(input_ids=new_ids, decoder_input_ids=new_ids)
    model.save_pretrained(tmp_path)
    loaded = AutoModel.from_pretrained(tmp_path).eval()
    assert loaded.config.decoder_vocab_size == 120
    reloaded = loaded(input_ids=new_ids, decoder_input_ids=new_ids).last_hidden_state
    assert_same_up_to_rounding(reloaded, out.last_hidden_state, TINY_TERMS)
    with pytest.raises(ValueError, match="eos_token_id"):
        model.resize_token_embeddings(EOS)
    assert model.shared.weight.shape[0] == 120


def test_resizing_a_model_with_two_embedding_matrices_is_refused_before_anything_changes():
    """Both classes refuse a model with a source and a target matrix: the base model once let
    transformers grow the encoder's matrix, then refused in `set_input_embeddings` ("set each embedding
    itself"), leaving 120 rows against `vocab_size` 99, a folder that saved and did not load."""
    config = tiny_model().config
    config.share_encoder_decoder_embeddings, config.decoder_vocab_size = False, 50
    for model in (VanillaTransformerModel(config), VanillaTransformerForConditionalGeneration(config)):
        base = model.get_encoder().embed_tokens
        before = (base.weight.shape, model.config.vocab_size, model.config.decoder_vocab_size)
        for size in (120, None):
            with pytest.raises(ValueError, match="Resizing needs one embedding matrix shared"):
                model.resize_token_embeddings(size)
        assert model.get_encoder().embed_tokens is base
        assert (base.weight.shape, model.config.vocab_size, model.config.decoder_vocab_size) == before


def test_gradient_checkpointing_gives_the_same_gradients(batch):
    def gradients(checkpointing: bool) -> dict[str, torch.Tensor]:
        model = tiny_model().train()  # dropout is 0 in the tiny test config
        if checkpointing:
            model.activation_checkpointing_enable({"use_reentrant": False})
            assert all(layer.gradient_checkpointing for layer in model.model.encoder.layers)
        model(**batch).loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    plain, checkpointed = gradients(False), gradients(True)
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        scale = gradient_scale(plain)
        assert_same_up_to_rounding(checkpointed[name], plain[name], TINY_TERMS, scale, msg=name)


def test_gradient_checkpointing_returns_no_cache_in_training(batch):
    """Checkpointed layers cannot write a cache (the backward replay would write it twice), so a
    training forward under checkpointing returns none, as MarianMTModel's does, not an empty one that
    a decoding continued from it would read as position 0. Without gradients it caches as usual."""
    model = tiny_model().train()
    model.gradient_checkpointing_enable()
    inputs = {"input_ids": batch["input_ids"], "decoder_input_ids": batch["labels"].clamp(min=0)}
    out = model(**inputs, use_cache=True)
    out.logits.sum().backward()
    assert out.cache is None
    with torch.no_grad():
        assert model(**inputs, use_cache=True).cache.get_seq_length() == inputs["decoder_input_ids"].shape[1]


def test_checkpointing_some_decoder_layers_returns_no_cache_in_training():
    """With `every_n_layers` the first decoder layer may be left unchecked while a later one is
    checkpointed: the cache returned held the first layer's positions only, and a decoding continued
    from it gave other logits than the full forward. None is returned, as MarianMTModel's."""
    model = tiny_model().train()
    model.activation_checkpointing_enable(every_n_layers=3)  # counts the 2 encoder layers first
    assert [layer.gradient_checkpointing for layer in model.model.decoder.layers] == [False, True]
    out = model(input_ids=torch.tensor([[5, 6, 7, EOS]]), decoder_input_ids=torch.tensor([[1, 8, 9]]))
    assert out.cache is None


def test_a_model_switched_to_greedy_search_saves_and_keeps_its_beam_settings(tmp_path):
    """The generation config carries the paper's beam settings (length penalty 0.6, early stopping).
    Switched to greedy search (`num_beams = 1`), transformers refused to save it, so `save_pretrained`
    and Trainer's next checkpoint failed; the settings now stay dormant, and apply again with beams.
    Other wrong settings are still refused."""
    model = tiny_model("sdpa")
    paper = (model.generation_config.early_stopping, model.generation_config.length_penalty)
    assert paper == (True, 0.6)
    model.generation_config.num_beams = 1
    model.save_pretrained(tmp_path / "greedy")
    # Loaded without transformers' warning that they "are not valid and may be ignored" (it validates
    # the file as a plain GenerationConfig first); a warning about another flag still shows.
    with logged_messages(GenerationConfig.__module__) as warnings:
        loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "greedy")
        assert not [w for w in warnings if "generation flags are not valid" in w], warnings
        GenerationConfig(num_beams=1, length_penalty=0.6, temperature=0.5)
        assert any("not valid and may be ignored: ['temperature', 'length_penalty']" in w for w in warnings)
    config = loaded.generation_config
    assert (config.num_beams, config.early_stopping, config.length_penalty) == (1, *paper)
    source = torch.randint(3, 99, (2, 7), generator=torch.Generator().manual_seed(0))
    assert torch.equal(loaded.generate(source), model.generate(source, num_beams=1))
    assert torch.equal(
        loaded.generate(source, num_beams=4), model.generate(source, num_beams=4, length_penalty=0.6)
    )
    model.generation_config.temperature = 0.5  # a sampling setting without sampling: refused, as before
    with pytest.raises(ValueError, match="temperature"):
        model.save_pretrained(tmp_path / "sampling")


def test_a_greedy_folder_is_decoded_by_seq2seq_trainer_as_the_readme_says(tmp_path):
    """README: a greedy folder's file given as `Seq2SeqTrainingArguments(generation_config=FOLDER)` is
    refused when `Seq2SeqTrainer` is built (it validates the file strictly, dormant beam settings and
    all; the arguments take it); left out, the trainer decodes with the model's own configuration,
    greedy."""
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

    model = tiny_model("sdpa")
    model.generation_config.num_beams = 1
    model.save_pretrained(tmp_path / "greedy")
    strict = Seq2SeqTrainingArguments(
        tmp_path / "out", report_to="none", use_cpu=True, generation_config=str(tmp_path / "greedy")
    )
    with pytest.raises(ValueError, match="length_penalty"):
        Seq2SeqTrainer(model=model, args=strict)
    arguments = Seq2SeqTrainingArguments(
        tmp_path / "out", report_to="none", predict_with_generate=True, use_cpu=True
    )
    source = torch.randint(3, 99, (2, 7), generator=torch.Generator().manual_seed(0))
    pairs = [{"input_ids": row, "labels": row} for row in source]
    predicted = Seq2SeqTrainer(model=model, args=arguments).predict(pairs).predictions
    greedy = model.generate(source, num_beams=1)
    assert torch.equal(torch.as_tensor(predicted)[:, : greedy.shape[1]], greedy)
