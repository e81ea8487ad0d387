"""Pictures of what the model computes: attention maps and the sinusoidal positional encoding.

Attention maps are the weights the model itself returns with `output_attentions=True` (eager
attention): softmax(Q K^T / sqrt(d_k)) per layer and head, Section 3.2. Drawn headless on standalone
matplotlib figures (Agg canvas, no pyplot state).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .cli import replaced_when_complete
from .modeling_vanilla_transformer import sinusoidal_position_encoding
from .translation import one_line

# Beyond these the pictures are unreadable (one labelled row and column per token or position) and
# their tensors grow with the square: the (positions x positions) similarity at 10^6 positions would be
# 8 TB; the eager attention weights of a 10,000-token sentence, 400 MB per head and layer.
MAX_MAP_TOKENS = 512
MAX_ENCODING_POSITIONS = 4096
# A grid of layers x (heads + 1) panels grows with the square of the tokens: at 512 tokens the tiny
# model's picture would be 56,770 x 34,140 pixels (7.8 GB to render), a base model's wider than the
# 65,536 pixels matplotlib's renderer can draw at all. Pictures stay within 2^28 pixels (1 GiB of
# RGBA while rendered) and that width and height.
MAX_MAP_PIXELS = 2**28
MAX_MAP_SIDE = 2**16 - 1
MAP_DPI = 100


@dataclass
class AttentionMaps:
    """One sentence pair's attention weights, each a (layers, heads, queries, keys) tensor.

    `source_tokens` label the encoder positions; `decoder_tokens` the decoder inputs (the target
    shifted right: start token first); `target_tokens` what each decoder position predicts.
    """

    source_tokens: list[str]
    decoder_tokens: list[str]
    target_tokens: list[str]
    encoder_self: torch.Tensor  # (L, H, S, S)
    decoder_self: torch.Tensor  # (L, H, T, T)
    cross: torch.Tensor  # (L, H, T, S)


def attention_maps(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    source: str,
    target: str | None = None,
    **generate_kwargs: Any,
) -> AttentionMaps:
    """Run `source` (and `target`, or the model's own translation of `source`) through the model with
    `output_attentions=True` and return its attention weights.

    The target is fed with teacher forcing: decoder inputs are the start token followed by the target
    tokens, and position i predicts target token i (its last token is `</s>`). The model switches to
    eager attention for the call (SDPA does not return weights) and back afterwards.
    """
    # As `translate` reads them (`one_line`): a tokenizer saved before it stripped the ends encoded a line
    # break or spaces around a sentence as word-start tokens that no training sentence has. Blank as read
    # (spaces, or a byte-order mark alone) is empty.
    if not isinstance(source, str) or not one_line(source):
        raise ValueError("The source sentence is empty: give a sentence to look inside.")
    if target is not None and not one_line(target):
        raise ValueError("The target sentence is empty: omit it to use the model's own translation.")
    source, target = one_line(source), None if target is None else one_line(target)
    device = next(model.parameters()).device
    input_ids = tokenizer(source, return_tensors="pt")["input_ids"].to(device)
    _check_map_length("source", input_ids.shape[1])
    implementation = model.config._attn_implementation
    training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            if target is None:
                generated = model.generate(input_ids, **generate_kwargs)
                # The start token the translation was decoded from: the generation config's (or a keyword's),
                # which may differ from the model configuration's.
                start = generated[:1, :1]
                target_ids = generated[:1, 1:]  # the best sequence, without the decoder start token
                target_ids = target_ids[:, : _length_through_eos(target_ids[0], tokenizer.eos_token_id)]
                _check_map_length("translated", target_ids.shape[1])  # a source near the limit, + 50
            else:
                target_ids = tokenizer(text_target=target, return_tensors="pt")["input_ids"].to(device)
                _check_map_length("target", target_ids.shape[1])
                start = torch.full_like(target_ids[:, :1], model.config.decoder_start_token_id)
            decoder_input_ids = torch.cat([start, target_ids[:, :-1]], dim=1)
            model.set_attn_implementation("eager")
            output = model(input_ids=input_ids, decoder_input_ids=decoder_input_ids, output_attentions=True)
    finally:
        model.set_attn_implementation(implementation)
        model.train(training)

    def stacked(weights: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.stack([w[0] for w in weights]).float().cpu()  # (L, H, Q, K) of batch item 0

    return AttentionMaps(
        source_tokens=tokenizer.convert_ids_to_tokens(input_ids[0].tolist()),
        decoder_tokens=tokenizer.convert_ids_to_tokens(decoder_input_ids[0].tolist()),
        target_tokens=tokenizer.convert_ids_to_tokens(target_ids[0].tolist()),
        encoder_self=stacked(output.encoder_attentions),
        decoder_self=stacked(output.decoder_attentions),
        cross=stacked(output.cross_attentions),
    )


def _check_map_length(side: str, tokens: int) -> None:
    if tokens > MAX_MAP_TOKENS:
        raise ValueError(
            f"The {side} sentence is {tokens} tokens long; attention maps are drawn for at most "
            f"{MAX_MAP_TOKENS} (one labelled row and column per token): give a shorter sentence."
        )


def _length_through_eos(ids: torch.Tensor, eos_token_id: int | None) -> int:
    """Length of `ids` up to and including the first end-of-sequence token (padding after it dropped)."""
    if eos_token_id is not None:
        hits = (ids == eos_token_id).nonzero()
        if len(hits):
            return int(hits[0, 0]) + 1
    return len(ids)


def save_figure(figure: Figure, path: str | Path) -> None:
    """Save `figure` at `path` (its format from the suffix, PNG without one), written beside it and renamed:
    a failed write (a full disk) leaves the picture that was there, not a truncated one."""
    with replaced_when_complete(path, binary=True) as stream:
        figure.savefig(stream, format=Path(path).suffix[1:] or None, dpi=MAP_DPI)


def _grid_inches(layers: int, heads: int, tokens: int) -> tuple[float, float]:
    """(width, height) in inches of `plot_attention_grid`'s figure for at most `tokens` per side."""
    panel = max(1.6, 0.22 * tokens + 0.9)
    return panel * (heads + 1), panel * layers + 0.8


def _check_grid_size(layers: int, heads: int, tokens: int) -> None:
    """Refuses a grid picture that would be too large to render (`MAX_MAP_PIXELS`, `MAX_MAP_SIDE`),
    naming the longest sentence this model's pictures can show."""

    def fits(n: int) -> bool:
        width, height = (round(inches * MAP_DPI) for inches in _grid_inches(layers, heads, n))
        return max(width, height) <= MAX_MAP_SIDE and width * height <= MAX_MAP_PIXELS

    if fits(tokens):
        return
    longest = max((n for n in range(1, tokens) if fits(n)), default=0)
    width, height = (round(inches * MAP_DPI) for inches in _grid_inches(layers, heads, tokens))
    raise ValueError(
        f"A sentence of {tokens} tokens makes a {width:,} x {height:,}-pixel picture of this model's "
        f"{layers} layers x {heads} heads, more than can be drawn ({MAX_MAP_PIXELS:,} pixels, "
        f"{MAX_MAP_SIDE:,} a side); "
        + (
            f"give sentences of at most {longest} tokens."
            if longest
            else "this model has too many heads to draw."
        )
    )


def plot_attention_grid(
    weights: torch.Tensor,
    query_tokens: Sequence[str],
    key_tokens: Sequence[str],
    path: str | Path,
    *,
    title: str,
    query_label: str = "query",
    key_label: str = "key",
) -> Figure:
    """Heatmaps of (layers, heads, queries, keys) weights: one row per layer, one column per head, and
    a last column with the average over heads. The colour scale is 0 to 1 everywhere, so maps compare
    across panels. Saves a PNG at `path` and returns the figure (each panel's image holds the exact
    weights drawn)."""
    if weights.dim() != 4:
        raise ValueError(
            f"Expected (layers, heads, queries, keys) weights, got shape {tuple(weights.shape)}."
        )
    layers, heads, queries, keys = weights.shape
    if (len(query_tokens), len(key_tokens)) != (queries, keys):
        raise ValueError(
            f"{len(query_tokens)} query and {len(key_tokens)} key labels for {queries} x {keys} weights."
        )
    _check_grid_size(layers, heads, max(queries, keys))
    figure = Figure(figsize=_grid_inches(layers, heads, max(queries, keys)), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(layers, heads + 1, squeeze=False)
    for layer in range(layers):
        for column in range(heads + 1):
            ax = axes[layer, column]
            data = weights[layer, column] if column < heads else weights[layer].mean(0)
            image = ax.imshow(data.numpy(), vmin=0.0, vmax=1.0, cmap="viridis", interpolation="nearest")
            # Tokens are text: two dollar signs in one ("$x$", "$$") made mathtext a formula of it, or fail.
            ax.set_xticks(range(keys), key_tokens, rotation=90, fontsize=7, parse_math=False)
            ax.set_yticks(range(queries), query_tokens, fontsize=7, parse_math=False)
            ax.set_title(
                f"layer {layer + 1}, " + (f"head {column + 1}" if column < heads else "mean"), fontsize=9
            )
            if layer == layers - 1:
                ax.set_xlabel(key_label, fontsize=8)
            if column == 0:
                ax.set_ylabel(query_label, fontsize=8)
    figure.colorbar(image, ax=axes, shrink=0.6, label="attention weight")
    figure.suptitle(title)
    save_figure(figure, path)
    return figure


def plot_attention_maps(maps: AttentionMaps, output_dir: str | Path) -> dict[str, Path]:
    """The three kinds of attention of Section 3.2.3 as PNGs in `output_dir`; returns their paths."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    kinds = {
        "encoder_self_attention": (
            maps.encoder_self,
            maps.source_tokens,
            maps.source_tokens,
            "Encoder self-attention",
            ("source token (query)", "source token (key)"),
        ),
        "decoder_self_attention": (
            maps.decoder_self,
            maps.decoder_tokens,
            maps.decoder_tokens,
            "Decoder masked self-attention (nothing above the diagonal: no looking ahead)",
            ("decoder input (query)", "decoder input (key)"),
        ),
        "cross_attention": (
            maps.cross,
            maps.target_tokens,
            maps.source_tokens,
            "Encoder-decoder attention (row: the target token being predicted)",
            ("target token predicted", "source token"),
        ),
    }
    for weights, *_ in kinds.values():  # every picture checked before the first is drawn
        _check_grid_size(*weights.shape[:2], max(weights.shape[2:]))
    paths = {}
    for name, (weights, queries, keys, title, (query_label, key_label)) in kinds.items():
        paths[name] = output_dir / f"{name}.png"
        plot_attention_grid(
            weights, queries, keys, paths[name], title=title, query_label=query_label, key_label=key_label
        )
    return paths


def position_similarity(length: int, d_model: int, layout: str = "interleaved") -> torch.Tensor:
    """(length, length) dot products PE(p) . PE(q) / (d_model / 2), in float64.

    Each PE(p) has squared norm d_model / 2 (one sin^2 + cos^2 = 1 per frequency), so the diagonal is 1.
    The dot product is sum_i cos((p - q) w_i): it depends only on the offset p - q, which is what lets
    the model attend by relative position (Section 3.5).
    """
    encoding = sinusoidal_position_encoding(torch.arange(length), d_model, layout, torch.float64)
    return encoding @ encoding.T / (d_model / 2)


def plot_positional_encoding(
    path: str | Path, *, d_model: int = 512, length: int = 100, layout: str = "interleaved"
) -> Figure:
    """The encoding (positions x dimensions), the similarity between positions, and similarity against
    offset for a few positions (one curve: it depends on the offset only). Saves a PNG at `path`."""
    if not 2 <= length <= MAX_ENCODING_POSITIONS or d_model < 2 or d_model % 2:
        raise ValueError(
            f"Need 2 <= length <= {MAX_ENCODING_POSITIONS} and an even d_model >= 2, got length {length}, "
            f"d_model {d_model}."
        )
    encoding = sinusoidal_position_encoding(torch.arange(length), d_model, layout, torch.float64)
    similarity = position_similarity(length, d_model, layout)
    figure = Figure(figsize=(16, 4.6), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, 3, width_ratios=[1.5, 1, 1.1])
    image = axes[0].imshow(
        encoding.numpy(), aspect="auto", cmap="RdBu", vmin=-1, vmax=1, interpolation="nearest"
    )
    axes[0].set_xlabel(
        "dimension (even: sin, odd: cos)"
        if layout == "interleaved"
        else f"dimension (0-{d_model // 2 - 1}: sin, {d_model // 2}-{d_model - 1}: cos)"
    )
    axes[0].set_ylabel("position")
    formula = (  # the layout's own: in the concatenated one, dimension 2i + 1 is a sine too
        f"PE(pos, 2i) = sin(pos / 10000^(2i/{d_model})), PE(pos, 2i+1) = cos(...)"
        if layout == "interleaved"
        else f"PE(pos, i) = sin(pos / 10000^(2i/{d_model})), PE(pos, {d_model // 2}+i) = cos(...)"
    )
    axes[0].set_title(formula, fontsize=9)
    figure.colorbar(image, ax=axes[0], shrink=0.8)
    image = axes[1].imshow(similarity.numpy(), cmap="viridis", interpolation="nearest")
    axes[1].set_xlabel("position")
    axes[1].set_ylabel("position")
    axes[1].set_title("PE(p) . PE(q) / (d_model / 2): near positions are similar", fontsize=9)
    figure.colorbar(image, ax=axes[1], shrink=0.8)
    for position in sorted({0, length // 4, length // 2}):
        offsets = range(-position, length - position)
        axes[2].plot(list(offsets), similarity[position].numpy(), label=f"from position {position}")
    axes[2].set_xlabel("offset q - p")
    axes[2].set_ylabel("similarity")
    axes[2].set_title("Similarity depends only on the offset", fontsize=9)
    axes[2].grid(alpha=0.3)
    axes[2].legend(fontsize=8)
    save_figure(figure, path)
    return figure


__all__ = [
    "AttentionMaps",
    "attention_maps",
    "plot_attention_grid",
    "plot_attention_maps",
    "plot_positional_encoding",
    "position_similarity",
]
