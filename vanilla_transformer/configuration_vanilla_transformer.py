"""Configuration of the Transformer of "Attention Is All You Need" (Vaswani et al., 2017).

Self-contained (imports only transformers and its dependency packaging): this file is copied next to
saved checkpoints so that `AutoConfig.from_pretrained(..., trust_remote_code=True)` works without this
package installed.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import numbers
import os
from typing import Any, ClassVar

import transformers
from packaging.version import Version
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

# The oldest transformers this code (and a model folder's copy of it) runs on: older versions failed
# without saying why, 4.x at loading ("must be called with a dataclass type or instance") and 5.20 at the
# first `generate()` (an unexpected keyword argument 'cache').
MINIMUM_TRANSFORMERS = "5.24"


def check_transformers_version(installed: str = transformers.__version__) -> None:
    """Raise an ImportError naming the upgrade where `installed` is older than MINIMUM_TRANSFORMERS."""
    if Version(installed) < Version(MINIMUM_TRANSFORMERS):
        raise ImportError(
            f"This model's code needs transformers {MINIMUM_TRANSFORMERS} or later, and this Python has "
            f'{installed}: pip install -U "transformers>={MINIMUM_TRANSFORMERS}" (which needs Python 3.11).'
        )


check_transformers_version()

POSITION_ENCODING_LAYOUTS = ("interleaved", "concatenated")

# Paper, Table 3 ("base" and "big"); "tiny" is sized for a 10-minute run on 2 CPU cores: with that
# compute, d_model 192 learned more than 256 (more sentences seen in the same time; docs/recipe.md).
# Its recipe was tuned with biases on the attention projections, and keeps them: without them it scored
# 0.23 BLEU less over three seeds, with a looping output on the main job's (docs/recipe.md, "The paper's
# attention, without biases").
PRESETS: dict[str, dict[str, Any]] = {
    "base": {},
    "big": {"d_model": 1024, "num_heads": 16, "d_ff": 4096, "dropout": 0.3},
    "tiny": {
        "vocab_size": 8000,
        "d_model": 192,
        "num_heads": 4,
        "d_ff": 768,
        "num_encoder_layers": 3,
        "num_decoder_layers": 3,
        "attention_bias": True,
    },
}


def is_integer(value: Any) -> bool:
    """An integer (a NumPy one too), and not a bool (True is an int to Python, but no size or token id)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def python_number(value: Any) -> Any:
    """A NumPy integer or real number (in a list too) as Python's int or float; anything else as it is.

    The checks take NumPy's numbers as sizes, rates and token ids, but json cannot write them: such a
    configuration failed to print, and its model to save ("Object of type int64 is not JSON
    serializable"; the generation config copies the token ids).
    """
    if isinstance(value, list):  # eos_token_id; the same list where nothing changes
        items = [python_number(item) for item in value]
        return value if all(new is old for new, old in zip(items, value, strict=True)) else items
    if is_integer(value) and not isinstance(value, int):
        return int(value)
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, int, float)):
        return float(value)
    return value


LOSS_FIELDS = ("label_smoothing", "unlikelihood_weight")


def check_loss_value(name: str, value: Any) -> None:
    """A ValueError naming `name` (one of `LOSS_FIELDS`) where `value` is not a number it may take:
    a smoothing in [0, 1), a non-negative finite unlikelihood weight (NaN refused)."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise ValueError(f"`{name}` must be a number, got {value!r}.")
    if name == "label_smoothing" and not 0.0 <= value < 1.0:
        raise ValueError(f"`label_smoothing` must be in [0, 1), got {value}.")
    if name == "unlikelihood_weight" and not 0 <= value < float("inf"):
        raise ValueError(f"`unlikelihood_weight` must be a non-negative finite number, got {value}.")


class VanillaTransformerConfig(PretrainedConfig):
    """Hyper-parameters of the encoder-decoder Transformer (paper Section 3, Table 3).

    The defaults are the paper's base model. Field names follow the paper's symbols; the standard
    transformers names (`hidden_size`, `num_attention_heads`, `encoder_layers`, ...) are aliases;
    `num_hidden_layers` names the decoder's layers (`num_decoder_layers`), which generation caches hold.

    Args:
        vocab_size: size of the joint source/target vocabulary.
        d_model: width of every sub-layer output and embedding.
        num_heads: attention heads h; d_k = d_v = d_model / h.
        d_ff: inner width of the position-wise feed-forward networks.
        num_encoder_layers, num_decoder_layers: N for each stack.
        dropout: P_drop on each sub-layer output and on embeddings + positions.
        attention_dropout: dropout on attention probabilities (0 in the paper).
        activation_dropout: dropout on the feed-forward hidden layer (0 in the paper).
        activation_function: feed-forward non-linearity ("relu" in the paper).
        layer_norm_eps: epsilon of every LayerNorm.
        norm_first: False is the paper's post-LN `LayerNorm(x + Sublayer(x))`; True is pre-LN with a
            final LayerNorm on each stack.
        scale_embedding: multiply embeddings by sqrt(d_model) (paper Section 3.4).
        tie_word_embeddings: share the (target) embedding matrix with the pre-softmax projection.
        share_encoder_decoder_embeddings: one matrix for source and target embeddings (the paper's
            joint vocabulary). False gives the decoder its own matrix, of `decoder_vocab_size` rows: its
            own vocabulary, or the encoder's (equal sizes) in a matrix of its own.
        decoder_vocab_size: target vocabulary size when the embeddings are not shared.
        attention_bias: biases on the attention's four projections. False is the paper's W^Q, W^K, W^V
            and W^O (Section 3.2.2), which have none; True adds them (zero at initialisation), as
            fairseq, torch's MultiheadAttention and Marian do (a converted Marian model has them, and so
            does the tiny preset, whose recipe was tuned with them). A saved configuration without
            the field predates it, when every model had them: loading one gives True.
        add_final_logits_bias: a fixed bias on the output logits (not in the paper; Marian checkpoints
            have one; a buffer, as in MarianMTModel: loaded and saved, not trained).
        position_encoding_layout: "interleaved" (sin on even, cos on odd dimensions: the paper) or
            "concatenated" (all sines then all cosines: transformers' Marian).
        label_smoothing: epsilon_ls of the training loss (paper Section 5.4).
        unlikelihood_weight: weight of a token-level unlikelihood term added to the training loss (Welleck
            et al., 2019; not in the paper, 0 = off): at each target position, -log(1 - p(c)) for every
            distinct earlier token c of the target other than the label, a push against repeating
            what the translation already said.
        qkv_init_gain: gain of the Xavier-uniform initialisation of the attention's query, key and value
            projections. The paper does not say how it initialised weights; 2**-0.5 is fairseq's (the
            three initialised as one (3 d_model, d_model) matrix would be), with which the tiny recipe
            learned markedly more in the same updates than with 1.0 (each its own Xavier-uniform
            matrix); docs/recipe.md, fourth round. Only training from scratch reads it.
    """

    model_type: ClassVar[str] = "vanilla_transformer"
    keys_to_ignore_at_inference: ClassVar[list[str]] = ["cache"]
    attribute_map: ClassVar[dict[str, str]] = {
        "hidden_size": "d_model",
        "num_attention_heads": "num_heads",
        "encoder_attention_heads": "num_heads",
        "decoder_attention_heads": "num_heads",
        "intermediate_size": "d_ff",
        "encoder_ffn_dim": "d_ff",
        "decoder_ffn_dim": "d_ff",
        "encoder_layers": "num_encoder_layers",
        "decoder_layers": "num_decoder_layers",
        # Generation caches hold decoder layers only.
        "num_hidden_layers": "num_decoder_layers",
    }

    vocab_size: int = 37000
    d_model: int = 512
    num_heads: int = 8
    d_ff: int = 2048
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    dropout: float | int = 0.1
    attention_dropout: float | int = 0.0
    activation_dropout: float | int = 0.0
    activation_function: str = "relu"
    layer_norm_eps: float = 1e-5
    norm_first: bool = False
    scale_embedding: bool = True
    tie_word_embeddings: bool = True
    share_encoder_decoder_embeddings: bool = True
    decoder_vocab_size: int | None = None
    attention_bias: bool = False
    add_final_logits_bias: bool = False
    position_encoding_layout: str = "interleaved"
    label_smoothing: float | int = 0.1
    unlikelihood_weight: float | int = 0.0
    qkv_init_gain: float | int = 2**-0.5
    use_cache: bool = True
    is_encoder_decoder: bool = True
    pad_token_id: int | None = 0
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    decoder_start_token_id: int | None = 1

    def __post_init__(self, **kwargs: Any) -> None:
        super().__post_init__(**kwargs)
        if self.decoder_vocab_size is None:
            self.decoder_vocab_size = self.vocab_size
        self._check_values()

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> Any:
        """`PretrainedConfig.from_dict`, with the value checks repeated after the keyword overrides; a
        dictionary without `attention_bias` (a folder saved before the field) has the biases.

        transformers sets most overrides (`from_pretrained(folder, label_smoothing=0.2)`, also through
        `AutoConfig` and the model classes) on the built config, after `__post_init__` has checked it: a
        bad value would otherwise pass unchecked into the model.
        """
        # Saved before the field existed, when the attention projections always had biases.
        config_dict = {"attention_bias": True, **config_dict}
        loaded = super().from_dict(config_dict, **kwargs)
        config = loaded[0] if isinstance(loaded, tuple) else loaded
        named = {config.attribute_map.get(key, key) for key in kwargs}
        resized = "vocab_size" in named and "decoder_vocab_size" not in named
        if config.decoder_vocab_size is None or (resized and config.share_encoder_decoder_embeddings):
            config.decoder_vocab_size = config.vocab_size  # one shared matrix: the new size, as built
        config._check_values()
        return loaded

    @classmethod
    def from_json_file(cls, json_file: str | os.PathLike) -> Any:
        """`PretrainedConfig.from_json_file` through `from_dict`: transformers' builds `cls(**dict)`, so a
        config.json saved before `attention_bias` lost its biases (and the value checks of `from_dict`)."""
        return cls.from_dict(cls._dict_from_json_file(json_file))

    def to_dict(self) -> dict[str, Any]:
        """`PretrainedConfig.to_dict`, with NumPy numbers as Python ones (see `python_number`): also those
        set after the checks ran (`model.config.label_smoothing = numpy.float64(0.2)`), which failed to
        print and to save (`__repr__`, `to_json_string` and `save_pretrained` all go through here)."""
        return {key: python_number(value) for key, value in super().to_dict().items()}

    def _check_values(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if python_number(value) is not value:  # a NumPy number: Python's, which json needs
                setattr(self, field.name, python_number(value))
        for name in (
            "norm_first",
            "scale_embedding",
            "tie_word_embeddings",
            "share_encoder_decoder_embeddings",
            "attention_bias",
            "add_final_logits_bias",
            "use_cache",
        ):
            # "false" in a hand-edited config.json is truthy: it built another network without a word
            # (use_cache: a cache in every forward), where transformers' own configs refuse a str.
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"`{name}` must be True or False, got {getattr(self, name)!r}.")
        if self.is_encoder_decoder is not True:  # False: generate() ran it as a decoder-only model
            raise ValueError(
                f"`is_encoder_decoder` must be True, this model being an encoder-decoder; got "
                f"{self.is_encoder_decoder!r}."
            )
        if self.share_encoder_decoder_embeddings and self.decoder_vocab_size != self.vocab_size:
            raise ValueError(
                f"`decoder_vocab_size` ({self.decoder_vocab_size}) differs from `vocab_size` "
                f"({self.vocab_size}) while `share_encoder_decoder_embeddings` is True (one matrix)."
            )
        for name in (
            "vocab_size",
            "decoder_vocab_size",
            "d_model",
            "num_heads",
            "d_ff",
            "num_encoder_layers",
            "num_decoder_layers",
        ):
            value = getattr(self, name)  # 512.0 (a hand-edited config.json) failed deep in torch
            if not is_integer(value) or value <= 0:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
        if self.d_model % self.num_heads != 0:
            raise ValueError(
                f"`d_model` ({self.d_model}) must be divisible by `num_heads` ({self.num_heads}) so that "
                "each head has width d_k = d_model / num_heads."
            )
        if self.d_model % 2 != 0:
            raise ValueError(
                f"`d_model` must be even for sinusoidal positions (sin/cos pairs), got {self.d_model}."
            )
        for name in (
            "dropout",
            "attention_dropout",
            "activation_dropout",
            "qkv_init_gain",
            "layer_norm_eps",
        ):
            value = getattr(self, name)  # None or "0.1" failed a comparison without naming the field
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                raise ValueError(f"`{name}` must be a number, got {value!r}.")
        for name in ("dropout", "attention_dropout", "activation_dropout"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"`{name}` must be in [0, 1), got {value}.")
        # (`LOSS_FIELDS` are checked as they are set, in the constructor too: `__setattr__`)
        if not 0 < self.qkv_init_gain < float("inf"):  # NaN included
            raise ValueError(f"`qkv_init_gain` must be a positive finite number, got {self.qkv_init_gain}.")
        if not 0 < self.layer_norm_eps < float("inf"):  # NaN included
            raise ValueError(f"`layer_norm_eps` must be a positive finite number, got {self.layer_norm_eps}.")
        if not isinstance(self.activation_function, str) or self.activation_function not in ACT2FN:
            raise ValueError(
                f"Unknown `activation_function` {self.activation_function!r}; "
                f"choose one of transformers' activations, e.g. 'relu' (the paper), 'gelu', 'swish'."
            )
        if (
            not isinstance(self.position_encoding_layout, str)
            or self.position_encoding_layout not in POSITION_ENCODING_LAYOUTS
        ):
            raise ValueError(
                f"Unknown `position_encoding_layout` {self.position_encoding_layout!r}; "
                f"choose one of {POSITION_ENCODING_LAYOUTS}."
            )
        smallest = min(self.vocab_size, self.decoder_vocab_size)
        eos = self.eos_token_id if isinstance(self.eos_token_id, list) else [self.eos_token_id]
        if not eos:  # generate() indexes the first end-of-sequence id
            raise ValueError("`eos_token_id` is an empty list; give an id, a list of ids, or None.")
        named = [("pad_token_id", self.pad_token_id), ("bos_token_id", self.bos_token_id)]
        named += [("decoder_start_token_id", self.decoder_start_token_id)] + [
            ("eos_token_id", e) for e in eos
        ]
        for name, value in named:
            if value is not None and not is_integer(value):  # 0.0, False: failed in the embeddings
                raise ValueError(f"`{name}` must be an integer token id or None, got {value!r}.")
            if value is not None and not 0 <= value < smallest:
                raise ValueError(f"`{name}` ({value}) must lie in [0, {smallest}), the vocabulary size.")

    def __setattr__(self, name: str, value: Any) -> None:
        # The loss reads these at each forward, and setting them on a built model is the way to change
        # it (`model.config.label_smoothing = 0.2`): checked as they are set, there as in the constructor.
        if name in LOSS_FIELDS:
            check_loss_value(name, value)
        super().__setattr__(name, value)

    @property
    def head_dim(self) -> int:
        """d_k = d_v = d_model / h."""
        return self.d_model // self.num_heads

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> VanillaTransformerConfig:
        """A configuration from the paper's Table 3 ("base", "big") or the CPU-sized "tiny".

        Keyword arguments override single fields, e.g. `from_preset("base", vocab_size=32000)`; a name
        that is no field of the configuration is refused (the constructor would keep it as an unused
        attribute, so that a misspelt `dropuot=0.3` left the preset's dropout in place without a word).
        """
        if name not in PRESETS:
            raise ValueError(f"Unknown preset {name!r}; choose one of {sorted(PRESETS)}.")
        config = cls(**PRESETS[name])
        fields = {field.name for field in dataclasses.fields(cls)}
        unknown = [key for key in overrides if key not in fields and not cls._settable(config, key)]
        if unknown:
            close = {key: difflib.get_close_matches(key, sorted(fields), n=1) for key in unknown}
            hints = "".join(f" ({key}: did you mean {match[0]!r}?)" for key, match in close.items() if match)
            if "head_dim" in unknown:  # a field of many transformers configurations
                hints += " (head_dim is d_model / num_heads: set those)"
            raise ValueError(f"from_preset: {unknown} are no fields of {cls.__name__}{hints}.")
        return cls(**{**PRESETS[name], **overrides})

    @staticmethod
    def _settable(config: PretrainedConfig, key: str) -> bool:
        """Whether `key` is an alias or an attribute of `config` the constructor may set: not a property
        without a setter (`head_dim`, whose setting failed as an AttributeError; `output_attentions` has
        one) nor a method (`save_pretrained`)."""
        if key in config.attribute_map:
            return True
        try:
            found = inspect.getattr_static(config, key)
        except AttributeError:
            return False
        if isinstance(found, property):
            return found.fset is not None
        return not (isinstance(found, (classmethod, staticmethod)) or callable(found))


__all__ = ["PRESETS", "VanillaTransformerConfig"]
