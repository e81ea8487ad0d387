"""The documentation's code runs as written: the Python blocks of README.md and of the model card (the
template model_card.md, rendered into a small trained folder's README.md), read from the Markdown at test
time, each run in a working folder holding the paths it names, with the claims their comments make
checked; README's shell commands, run where cheap (the others skipped for the GPUs or the Hub they need,
or excused with the test that covers them), and the scripts and flags they name; README's Sizes table."""

import ast
import io
import json
import re
import shlex
import tokenize
from collections.abc import Callable
from pathlib import Path

import datasets
import pytest
import torch
import torch.nn.functional as F
from test_training import corpus_files, small_args  # noqa: F401  (a fixture and a helper)
from transformers import GenerationMixin

from vanilla_transformer import VanillaTransformerConfig, VanillaTransformerForConditionalGeneration
from vanilla_transformer.corpus import load_default_corpus
from vanilla_transformer.training import parse_config, train

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

# A comment's check: a function of the snippet's namespace (an expression statement's value is under
# "_"), or the reason it is not checked here.
Check = Callable[[dict], None] | str


def code_blocks(text: str, language: str) -> list[tuple[int, str]]:
    """The fenced blocks of `language` in Markdown `text`: (line number of the block's first line, code)."""
    pattern = re.compile(rf"^```{language}\n(.*?)^```", re.MULTILINE | re.DOTALL)
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in pattern.finditer(text)]


def python_block(path: Path, marker: str) -> tuple[int, str]:
    """The one Python block of the Markdown file `path` that contains `marker`."""
    found = [block for block in code_blocks(path.read_text(encoding="utf-8"), "python") if marker in block[1]]
    assert len(found) == 1, f"{len(found)} Python blocks of {path} contain {marker!r}"
    return found[0]


def run_snippet(block: tuple[int, str], filename: str, checks: dict[str, Check], namespace: dict) -> dict:
    """Runs the code `block` (from `python_block`) statement by statement in `namespace`, as written
    (tracebacks name the Markdown file's lines). After each statement, the check of every comment on its
    lines or on the comment lines just above it runs. Every comment of the code must have an entry in
    `checks` and every entry its comment, so a comment changed in the docs fails here until its check
    follows it."""
    first_line, code = block
    comments = {  # line number in the block: the comment's text
        token.start[0]: token.string[1:].strip()
        for token in tokenize.generate_tokens(io.StringIO(code).readline)
        if token.type == tokenize.COMMENT
    }
    unused = dict(checks)
    previous_end = 0
    for node in ast.parse(code).body:
        said = [comments[n] for n in range(previous_end + 1, node.end_lineno + 1) if n in comments]
        previous_end = node.end_lineno
        ast.increment_lineno(node, first_line - 1)
        if isinstance(node, ast.Expr):
            namespace["_"] = eval(compile(ast.Expression(node.value), filename, "eval"), namespace)
        else:
            exec(compile(ast.Module([node], type_ignores=[]), filename, "exec"), namespace)
        for comment in said:
            assert comment in checks, f"{filename}: the comment {comment!r} has no check in this test"
            check = unused.pop(comment, None)
            if callable(check):
                check(namespace)
    assert not unused, f"{filename}: no comment {list(unused)} any more: update the test"
    return namespace


# ---------------------------------------------------------------- README.md


def test_readme_python_blocks_are_all_run_here():
    """Each Python block of README.md is run by one test below (found by a marker it contains): a new
    block fails here until a test runs it."""
    markers = ['from_preset("base"', 'from_pretrained("my-transformer"', 'pipeline("translation"']
    markers.append("convert_from_marian(")
    blocks = code_blocks(README.read_text(encoding="utf-8"), "python")
    assert sorted(sum(marker in code for marker in markers) for _, code in blocks) == [1] * len(blocks)
    assert len(blocks) == len(markers)


@pytest.fixture(scope="module")
def trained_folder(tmp_path_factory, corpus_files) -> Path:  # noqa: F811  (the imported fixture)
    """A small model folder as the training script writes it (8 updates, 2 checkpoints averaged, card
    included), named as the README's main job names its own: outputs/tiny-en-es."""
    output_dir = tmp_path_factory.mktemp("trained") / "outputs" / "tiny-en-es"
    overrides = {"max_steps": 8, "save_steps": 4, "keep_checkpoints": 2, "average_checkpoints": 2}
    train(parse_config(small_args(output_dir, corpus_files, eval_steps=0, **overrides)))
    return output_dir


def in_folder_with(tmp_path: Path, monkeypatch, links: dict[str, Path]) -> Path:
    """Makes `tmp_path` the working folder, with each of `links`' paths a link to its folder."""
    for name, target in links.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).symlink_to(target, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_readme_use_and_reload(tmp_path, monkeypatch):
    """README's "Use" block (the base preset, vocabulary 37,000) and the block that loads what it saved,
    in an empty working folder; each comment's claim checked after its statement."""
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    source_length = 12
    limits = []  # the number of new tokens each generate() call hands transformers
    original = GenerationMixin.generate

    def recording(self, *args, **kwargs):
        limits.append(kwargs.get("max_new_tokens"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "generate", recording)

    def base_preset(ns):
        config = ns["config"]
        assert (config.d_model, config.num_heads, config.d_ff) == (512, 8, 2048)
        assert (config.num_encoder_layers, config.num_decoder_layers, config.dropout) == (6, 6, 0.1)
        assert config.vocab_size == 37000
        assert VanillaTransformerConfig.from_preset("big").d_model == 1024
        assert VanillaTransformerConfig.from_preset("tiny").d_model == 192

    def training_mode(ns):
        assert ns["model"].training

    def label_smoothing(ns):
        model, source, labels = ns["model"], ns["source"], ns["labels"]
        assert ns["loss"].dim() == 0 and torch.isfinite(ns["loss"]) and ns["loss"].requires_grad
        # The same loss without dropout, against the formula on its logits.
        model.eval()
        with torch.no_grad():
            output = model(input_ids=source, labels=labels, return_logits=True)
        model.train()
        expected = F.cross_entropy(output.logits.flatten(0, 1), labels.flatten(), label_smoothing=0.1)
        torch.testing.assert_close(output.loss, expected)

    def evaluation_mode(ns):
        assert not any(module.training for module in ns["model"].modules())

    def stops_at(ns, limit):
        """generate() was given `limit` new tokens, and wrote that many after the start token unless an
        end token came first (an untrained model seldom writes one)."""
        translation, eos = ns["translation"], ns["model"].config.eos_token_id
        assert limits[-1] == limit
        length = translation.shape[1]
        assert length == 1 + limit or (length < 1 + limit and bool((translation == eos).any()))

    def paper_decoding(ns):
        model = ns["model"]
        assert (model.generation_config.num_beams, model.generation_config.length_penalty) == (4, 0.6)
        stops_at(ns, source_length + 50)

    def offset_and_a_set_length(ns):
        stops_at(ns, source_length + 10)
        set_length = ns["model"].generate(ns["source"], max_length_offset=10, max_new_tokens=3)
        assert limits[-1] == 3 and set_length.shape[1] <= 1 + 3

    def saved_files(ns):
        files = {p.name for p in (tmp_path / "my-transformer").iterdir()}
        expected = {"model.safetensors", "config.json", "generation_config.json"}
        expected |= {"configuration_vanilla_transformer.py", "modeling_vanilla_transformer.py"}
        # "Every folder this package saves carries [a translation pipeline], declared in config.json"
        expected.add("pipeline_vanilla_transformer.py")
        assert expected <= files, files
        declared = json.loads((tmp_path / "my-transformer" / "config.json").read_text())["custom_pipelines"]
        assert declared["translation"]["impl"] == "pipeline_vanilla_transformer.TranslationPipeline"

    use = python_block(README, 'from_preset("base"')
    namespace = run_snippet(
        use,
        "README.md",
        {
            'paper Table 3; also "big", "tiny"': base_preset,
            "in training mode, as transformers builds it": training_mode,
            "label-smoothed cross entropy (eps 0.1)": label_smoothing,
            "no dropout from here on": evaluation_mode,
            "beam 4, length penalty 0.6, stops at source length + 50": paper_decoding,
            "source length + 10 (a length set wins)": offset_and_a_set_length,
            "the paper's length penalty, GNMT's ((5 + |Y|) / 6)^0.6, instead of transformers' |Y|^0.6:": (
                "beam scores against the formula: tests/test_generation.py"
            ),
            "weights, config, generation config, code": saved_files,
        },
        {},
    )
    assert namespace["source"].shape == (2, source_length)
    assert namespace["translation"].shape[0] == 2

    saved = namespace["model"].state_dict()
    reload = python_block(README, 'from_pretrained("my-transformer"')
    loaded = run_snippet(reload, "README.md", {}, {})["model"]
    # (With the package imported its registered class loads; the folder's own code loads where the package
    # is not installed: tests/test_serialization.py.)
    assert type(loaded).__name__ == "VanillaTransformerForConditionalGeneration"
    assert loaded.state_dict().keys() == saved.keys()
    assert all(torch.equal(loaded.state_dict()[name], saved[name]) for name in saved)
    # "Importing `vanilla_transformer` registers the model with `AutoConfig`, `AutoModel` and
    # `AutoModelForSeq2SeqLM`"
    from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM

    config = AutoConfig.for_model("vanilla_transformer")
    assert isinstance(config, VanillaTransformerConfig)
    assert AutoModel._model_mapping[type(config)].__name__ == "VanillaTransformerModel"
    assert AutoModelForSeq2SeqLM._model_mapping[type(config)] is VanillaTransformerForConditionalGeneration


def test_readme_pipeline_block_on_a_trained_folder(trained_folder, tmp_path, monkeypatch):
    """README's pipeline("translation") block, in a working folder holding outputs/tiny-en-es."""
    in_folder_with(tmp_path, monkeypatch, {"outputs/tiny-en-es": trained_folder})

    def one_translation(ns):
        assert isinstance(ns["_"], list) and len(ns["_"]) == 1
        assert list(ns["_"][0]) == ["translation_text"] and isinstance(ns["_"][0]["translation_text"], str)

    namespace = run_snippet(
        python_block(README, 'pipeline("translation"'),
        "README.md",
        {
            "or a Hub repo id": "needs the Hub (tests/test_hub.py loads by repo id from a local mirror)",
            "[{'translation_text': '...'}]": one_translation,
        },
        {},
    )
    last = namespace["_"]  # the last statement: two sentences
    assert len(last) == 2 and all(list(item) == ["translation_text"] for item in last)
    assert all(isinstance(item["translation_text"], str) for item in last)


def test_readme_marian_conversion_block_on_a_local_stand_in(monkeypatch):
    """README's OPUS-MT conversion block, with `MarianMTModel.from_pretrained` answering a small random
    MarianMTModel: the tests cannot reach the Hub for Helsinki-NLP/opus-mt-en-de, so the block's names and
    calls are checked, not that checkpoint (conversions: tests/test_marian_conversion.py)."""
    from test_marian_conversion import marian_model
    from transformers import MarianMTModel

    requested = []

    def from_pretrained(name, *args, **kwargs):
        requested.append(name)
        return marian_model()

    monkeypatch.setattr(MarianMTModel, "from_pretrained", from_pretrained)
    namespace = run_snippet(python_block(README, "convert_from_marian("), "README.md", {}, {})
    assert requested == ["Helsinki-NLP/opus-mt-en-de"]
    assert type(namespace["model"]).__name__ == "VanillaTransformerForConditionalGeneration"


def test_readme_sizes_table_is_what_the_presets_build():
    """README's Sizes table: each preset's shape, dropout and parameter count (tied matrices counted
    once, at the vocabulary the row names), built on the meta device. (It once gave base and big the
    attention biases they lost when the paper's bias-free projections became their default.)"""
    text = README.read_text(encoding="utf-8")
    table = text[text.index("### Sizes") :].split("\n\n")[1].splitlines()
    header = [cell.strip() for cell in table[0].strip("|").split("|")]
    assert header[:7] == [
        "preset",
        "d_model",
        "heads",
        "d_ff",
        "layers",
        "dropout",
        "parameters (vocab 37,000)",
    ]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table[2:]]
    assert [row[0] for row in rows] == ["`base`", "`big`", "`tiny`"]
    for preset, d_model, heads, d_ff, layers, dropout, parameters, _ in rows:
        vocab = re.search(r"\(vocab ([\d,]+)\)", parameters)
        vocab_size = int(vocab[1].replace(",", "")) if vocab else 37000
        with torch.device("meta"):
            config = VanillaTransformerConfig.from_preset(preset.strip("`"), vocab_size=vocab_size)
            model = VanillaTransformerForConditionalGeneration(config)
        built = (
            config.d_model,
            config.num_heads,
            config.d_ff,
            config.num_encoder_layers,
            config.num_decoder_layers,
        )
        stated = (int(d_model), int(heads), int(d_ff), *(int(n) for n in layers.split(" + ")))
        assert built == stated, preset
        assert config.dropout == float(dropout.split()[0]), preset
        count = sum(p.numel() for p in model.parameters())
        assert count == int(parameters.split()[0].replace(",", "")), (preset, f"{count:,}")
    assert "(its CPU recipe trains with 0)" in rows[2][5]
    assert parse_config(["--output_dir", "outputs/tiny-en-es"]).dropout == 0  # the tiny recipe's


def test_readme_inline_imports_run():
    """The import statements README's text gives inline (`from vanilla_transformer import ...`)."""
    text = README.read_text(encoding="utf-8")
    statements = [" ".join(span.split()) for span in re.findall(r"(?<!`)`((?:from|import) [^`]*)`", text)]
    assert len(statements) >= 3, statements
    for statement in statements:
        exec(compile(statement, "README.md", "exec"), {})


# ---------------------------------------------------------------- the model card


# Trainer's default on a machine without an accelerator, in the card's fine-tuning example.
@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true:UserWarning")
def test_model_card_python_blocks_run_on_a_trained_folder(trained_folder, tmp_path, monkeypatch, capsys):
    """The "How to use" blocks of a trained folder's card, in a working folder holding the folder under
    the name the card loads (a local card loads the folder's name; a pushed card, its repo id). The
    fine-tuning block's `dataset = ...` placeholder is filled as its comment says, with a few pairs of
    the embedded corpus."""
    card = trained_folder / "README.md"
    text = card.read_text(encoding="utf-8")
    repo = re.search(r'^repo = "(.+)"$', text, re.MULTILINE).group(1)
    assert repo == trained_folder.name
    in_folder_with(tmp_path, monkeypatch, {repo: trained_folder})
    blocks = code_blocks(text, "python")
    assert len(blocks) == 3, "a new Python block in model_card.md: run it here"

    # 1. AutoModelForSeq2SeqLM and generate, with the generation config the card's "Decoding" states.
    generate = run_snippet(python_block(card, "model.generate("), "model card", {}, {})
    printed = ast.literal_eval(capsys.readouterr().out.strip().splitlines()[-1])
    assert isinstance(printed, list) and len(printed) == 1 and isinstance(printed[0], str)
    # "By default `generate` decodes with the repository's `generation_config.json`: as described above"
    decoding = " ".join(text.split("\nDecoding: ")[1].split("\n\n")[0].split())
    stated = re.match(
        r"beam search with (\d+) beams, length penalty ([\d.]+) in (transformers'|the paper's) form .*"
        r"and at most source length \+ (\d+) output tokens\.",
        decoding,
    )
    assert stated, decoding
    beams, penalty, form, offset = int(stated[1]), float(stated[2]), stated[3], int(stated[4])
    form = "power" if form == "transformers'" else "gnmt"
    model, inputs = generate["model"], generate["inputs"]
    config = model.generation_config
    assert (config.num_beams, config.length_penalty, config.length_penalty_form) == (beams, penalty, form)
    assert config.max_length_offset == offset
    spelled_out = model.generate(
        **inputs,
        num_beams=beams,
        length_penalty=penalty,
        length_penalty_form=form,
        max_new_tokens=inputs["input_ids"].shape[1] + offset,
    )
    assert torch.equal(generate["outputs"], spelled_out)

    # 2. pipeline("translation").
    def one_translation(ns):
        assert isinstance(ns["_"], list) and list(ns["_"][0]) == ["translation_text"]

    pipeline = run_snippet(
        python_block(card, 'pipeline("translation"'),
        "model card",
        {'[{"translation_text": "..."}]': one_translation},
        {},
    )
    assert len(pipeline["_"]) == 2
    assert all(isinstance(item["translation_text"], str) for item in pipeline["_"])
    # Block 1 printed the translation as text (no special tokens), as the pipeline gives it.
    sentence = ast.literal_eval(re.search(r"^inputs = tokenizer\(\[(.+)\], return_tensors", text, re.M)[1])
    assert printed == [pipeline["translator"](sentence)[0]["translation_text"]]

    # 3. Fine-tuning with Seq2SeqTrainer.
    corpus = load_default_corpus()
    pairs = {split: corpus[split].select(range(count)) for split, count in (("train", 16), ("validation", 4))}

    def fill_the_placeholder(ns):
        assert ns["dataset"] is Ellipsis
        ns["dataset"] = datasets.DatasetDict(
            {split: rows.select_columns(["en", "es"]) for split, rows in pairs.items()}
        )

    tuned = run_snippet(
        python_block(card, "Seq2SeqTrainer("),
        "model card",
        {'a datasets.DatasetDict whose splits have "en" and "es" text columns': fill_the_placeholder},
        {},
    )
    state = tuned["trainer"].state
    assert state.global_step == 3  # 16 pairs, batches of 64, three epochs
    assert all(torch.isfinite(torch.tensor(h["train_loss"])) for h in state.log_history if "train_loss" in h)


def test_the_cards_fine_tuning_section_says_how_to_decode_predictions_padded_with_minus_100(tmp_path):
    """With `predict_with_generate`, each batch is decoded to its own length (the source length + 50 rule),
    and `Seq2SeqTrainer` pads the predictions of the shorter batches with -100, which the tokenizer cannot
    decode (an OverflowError; OPUS-MT's MarianMTModels, whose generation configs set `max_length` 512, have
    every batch padded to it). The card's line that replaces it decodes each sentence as `generate` decoded
    it in its batch."""
    import numpy as np
    from datasets import Dataset
    from transformers import DataCollatorForSeq2Seq, Seq2SeqTrainer, Seq2SeqTrainingArguments

    from vanilla_transformer.tokenization import train_bpe_tokenizer

    text = (ROOT / "model_card.md").read_text(encoding="utf-8")
    statements = [" ".join(s.split()) for s in re.findall(r"`(preds = [^`]*-100[^`]*)`", text)]
    assert len(statements) == 1, "the card's fine-tuning section says how to decode -100 in predictions"
    rows = load_default_corpus()["train"].select(range(16))
    tokenizer = train_bpe_tokenizer(list(rows["en"]) + list(rows["es"]), vocab_size=120)
    # four pairs of different lengths, in two batches
    pairs = sorted(zip(rows["en"], rows["es"], strict=True), key=lambda pair: len(pair[0]))[::4]
    sources, targets = [source for source, _ in pairs], [target for _, target in pairs]
    data = Dataset.from_dict(dict(tokenizer(sources, text_target=targets)))
    torch.manual_seed(0)
    sizes = {"d_model": 16, "num_heads": 2, "d_ff": 32, "num_encoder_layers": 1, "num_decoder_layers": 1}
    config = VanillaTransformerConfig(vocab_size=len(tokenizer), **sizes)
    model = VanillaTransformerForConditionalGeneration(config)
    arguments = Seq2SeqTrainingArguments(
        output_dir=str(tmp_path), per_device_eval_batch_size=2, predict_with_generate=True,
        generation_num_beams=1, report_to="none", use_cpu=True,
    )  # fmt: skip
    collator = DataCollatorForSeq2Seq(tokenizer, model=model)
    trainer = Seq2SeqTrainer(model=model, args=arguments, data_collator=collator, processing_class=tokenizer)
    preds = trainer.predict(data).predictions
    assert (preds == -100).any()  # the first batch's outputs are shorter than the second's
    with pytest.raises(OverflowError):
        tokenizer.batch_decode(preds, skip_special_tokens=True)
    namespace = {"np": np, "preds": preds, "tokenizer": tokenizer}
    exec(compile(statements[0], "model_card.md", "exec"), namespace)
    expected = []
    for start in (0, 2):
        batch = collator([data[i] for i in range(start, start + 2)])
        with torch.no_grad():
            outputs = model.generate(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], num_beams=1
            )
        expected += tokenizer.batch_decode(outputs, skip_special_tokens=True)
    assert tokenizer.batch_decode(namespace["preds"], skip_special_tokens=True) == expected


def test_model_card_translate_command(trained_folder, tmp_path, monkeypatch, run_in_process):
    """The card's `scripts/translate.py` command, as written, in a working folder holding the model under
    the card's name and the input file it names. (The template's other bash block, "Command", renders a
    training record's `command`, which nothing in the package writes.)"""
    text = (trained_folder / "README.md").read_text(encoding="utf-8")
    commands = [code.strip() for _, code in code_blocks(text, "bash")]
    assert len(commands) == 1, "a new bash block in the card: run it here"
    words = shlex.split(commands[0])
    assert words[:2] == ["python", "scripts/translate.py"]
    options = dict(zip(words[2::2], words[3::2], strict=True))
    folder = in_folder_with(tmp_path, monkeypatch, {options["--model"]: trained_folder})
    (folder / options["--input"]).write_text("Jesus wept.\nGod is love.\n", encoding="utf-8")

    result = run_in_process("translate.py", *words[2:])
    assert result.returncode == 0, result.stderr
    assert len((folder / options["--output"]).read_text(encoding="utf-8").splitlines()) == 2


# ---------------------------------------------------------------- README's shell commands


def readme_commands() -> list[tuple[str, str]]:
    """(command, comment) of each command in README's bash blocks (continuation lines joined) and of its
    inline code that runs a script, each once."""
    text = README.read_text(encoding="utf-8")
    commands = []
    for _, code in code_blocks(text, "bash"):
        for line in code.replace("\\\n", " ").splitlines():
            command, _, comment = line.partition("  # ")
            commands.append((" ".join(command.split()), comment.strip()))
    spans = re.findall(r"(?<!`)`([^`]*scripts/\w+\.py\s[^`]*)`", text)
    commands += [(" ".join(span.split()), "") for span in spans]  # a span may go on over a line break
    first = {}  # each command once, with the first comment it has
    for command, comment in commands:
        if command and (command not in first or not first[command]):
            first[command] = comment
    return list(first.items())


# README commands not run here, each with the reason (a pattern matching the command's start: the reason):
# minutes of work, the user's own files, or what another test runs already.
NOT_RUN = {
    r"pip install torch==2\.13\.0 && pip install -e \. && accelerate launch": (
        "installs packages, then the main job (minutes); small runs: tests/test_training.py"
    ),
    r"pip install torch==2\.13\.0 && pip install -e \"\.\[test\]\"": "the test suite itself (.ci/run)",
    r"pip install -e ": "installs packages",
    r"accelerate launch --multi_gpu --num_processes 2 scripts/train\.py$": (
        "the main job on two processes (minutes); two CPU processes: tests/test_training.py"
    ),
    r"accelerate launch scripts/train\.py \[flags\]": "the main job (minutes)",
    r"python scripts/evaluate_model\.py --model DIR --test_file": (
        "placeholders DIR and test.tsv; a test file scored: tests/test_training.py"
    ),
    r"python scripts/translate\.py --model outputs/tiny-en-es$": (
        "needs a terminal; tests/test_training.py types at a pseudo-terminal"
    ),
    r"python scripts/finetune\.py ": "more.tsv is the user's data; fine-tuning: tests/test_finetuning.py",
    r"python scripts/average_checkpoints\.py ": (
        "names the main job's checkpoints (test_readme_average_command_names_checkpoints_the_main_job_keeps);"
        " the script on a run's checkpoints: tests/test_training.py"
    ),
    r"python scripts/export_ctranslate2\.py |python scripts/translate\.py --model outputs/tiny-en-es-ct2": (
        "tests/test_export_ctranslate2.py runs the export and translate.py on it"
    ),
    r"python scripts/visualize_attention\.py ": "writes docs/attention; tests/test_visualization.py runs it",
    r"(python )?scripts/build_messages_corpus\.py ": (
        "reads the machine's gettext catalogs; tests/test_recipe.py"
    ),
    r"python scripts/benchmark\.py ": "minutes of timing; tests/test_benchmark.py",
}
# README commands that need what the tests do not have: skipped, with the reason.
NEEDS = {
    r"accelerate launch --config_file configs/accelerate/(ddp|fsdp)\.yaml": (
        "needs GPUs (fsdp.yaml on CPU processes: tests/fsdp_on_cpu.py)"
    ),
    r"(python )?scripts/(push_to_hub|train)\.py (--folder|--push_to_hub)": (
        "needs the Hub and a token (tests/test_hub.py uploads to a local mirror)"
    ),
    r"python scripts/convert_marian\.py --model Helsinki-NLP/": (
        "needs the Hub (conversions: tests/test_convert_script.py)"
    ),
}


def matching(patterns: dict[str, str], command: str) -> list[str]:
    return [reason for pattern, reason in patterns.items() if re.match(pattern, command)]


def test_each_readme_command_is_run_skipped_or_excused():
    """Every README command is run by `test_readme_command`, skipped there for what it needs, or not run
    for a reason in NOT_RUN, and no pattern of those lists is left without its command."""
    commands = [command for command, _ in readme_commands()]
    for command in commands:
        assert len(matching(NOT_RUN, command) + matching(NEEDS, command)) <= 1, command
    for pattern in [*NOT_RUN, *NEEDS]:
        assert any(re.match(pattern, command) for command in commands), f"no README command {pattern!r}"


@pytest.mark.parametrize(
    ("command", "comment"),
    [command for command in readme_commands() if not matching(NOT_RUN, command[0])],
    ids=lambda value: value[:60],
)
def test_readme_command(command, comment, trained_folder, tmp_path, monkeypatch, run_in_process):
    """Each README command cheap to run here (not in NOT_RUN), run as written in a working folder holding
    outputs/tiny-en-es (the placeholder DIR standing for it; evaluate_model.py with `--max_samples 4`
    added, for the whole test split is 798 verses); those that need GPUs or the Hub are skipped with the
    reason, and a new command fails here until it is run or excused."""
    if reasons := matching(NEEDS, command):
        pytest.skip(reasons[0])
    folder = in_folder_with(tmp_path, monkeypatch, {"outputs/tiny-en-es": trained_folder})
    stdin = ""
    if command.startswith("echo "):
        echoed, command = command.split(" | ")
        stdin = " ".join(shlex.split(echoed)[1:]) + "\n"
    words = [word if word != "DIR" else "outputs/tiny-en-es" for word in shlex.split(command)]
    assert words[0] == "python" and re.fullmatch(r"scripts/\w+\.py", words[1]), (
        f"a new README command: run it here or give the reason it is not: {command}"
    )
    name, args = Path(words[1]).name, words[2:]
    options = dict(zip(args[::2], args[1::2], strict=False))
    if "--input" in options:
        (folder / options["--input"]).write_text("Jesus wept.\nGod is love.\n", encoding="utf-8")
    if name == "evaluate_model.py":
        args += ["--max_samples", "4"]

    result = run_in_process(name, *args, stdin=stdin)
    assert result.returncode == 0, result.stderr
    if name == "evaluate_model.py":
        assert comment == "test split: BLEU, chrF, signatures"
        lines = result.stdout.splitlines()
        assert lines[0] == "test: 4 sentences"
        assert re.match(r"BLEU +\d+\.\d\d +nrefs:1\|case:mixed\|eff:no\|tok:13a\|", lines[1]), lines
        assert re.match(r"chrF +\d+\.\d\d +nrefs:1\|case:mixed\|eff:yes\|nc:6\|", lines[2]), lines
    elif stdin:  # stdin -> stdout: one line each (empty, maybe: the model has had 8 updates)
        assert comment in ("stdin -> stdout, batched", "")
        assert len(result.stdout.splitlines()) == len(stdin.splitlines())
    else:
        assert name == "translate.py" and options["--output"] == "es.txt", command
        assert len((folder / "es.txt").read_text(encoding="utf-8").splitlines()) == 2


def test_readme_commands_name_existing_scripts_files_and_flags(run_in_process):
    """Every `scripts/X.py` a README command runs exists, every flag given to it (or to `accelerate
    launch`) is one its `--help` lists, and every file of the repository a command names (configs/...)
    exists: also for the commands not run here."""
    from accelerate.commands.launch import launch_command_parser

    launch_flags = {flag for action in launch_command_parser()._actions for flag in action.option_strings}
    flags_of: dict[str, set[str]] = {}
    checked = 0
    for command, _ in readme_commands():
        words = shlex.split(command.replace("$(nproc)", "2"))
        for word in words:
            if word.startswith("configs/"):
                assert (ROOT / word).is_file(), f"{command}: no {word}"
        scripts = [i for i, word in enumerate(words) if re.fullmatch(r"scripts/\w+\.py", word)]
        if words[:2] == ["accelerate", "launch"]:
            given = {word for word in words[2 : scripts[0]] if word.startswith("--")}
            assert given <= launch_flags, (
                f"{command}: accelerate launch has no {sorted(given - launch_flags)}"
            )
        for position in scripts:
            name = Path(words[position]).name
            assert (ROOT / words[position]).is_file(), command
            if name not in flags_of:
                shown = run_in_process(name, "--help")
                assert shown.returncode == 0, shown.stderr
                flags_of[name] = set(re.findall(r"(?<![\w-])--[\w-]+", shown.stdout))
            given = {w for w in words[position + 1 :] if w.startswith("--")}
            given = set().union(*(set(re.split(r"(?=--)", flag)) - {""} for flag in given))  # --a/--b
            assert given <= flags_of[name], f"{command}: {name} has no {sorted(given - flags_of[name])}"
            checked += 1
    assert checked >= 15, checked


def test_readme_average_command_names_checkpoints_the_main_job_keeps():
    """The README's average_checkpoints.py command names checkpoints of the main job (the default
    recipe's): among the last it keeps, under the names it writes."""
    command = next(c for c, _ in readme_commands() if "scripts/average_checkpoints.py" in c)
    path = re.search(r"--checkpoints (\S+)", command).group(1)
    stem, choices = re.fullmatch(r"outputs/tiny-en-es/checkpoints/(step-\d*)\{([\d,]+)\}", path).groups()
    named = [stem + choice for choice in choices.split(",")]
    recipe = parse_config(["--output_dir", "outputs/tiny-en-es"])
    last = recipe.max_steps - recipe.save_steps * (recipe.keep_checkpoints - 1)
    kept = [f"step-{step:08d}" for step in range(last, recipe.max_steps + 1, recipe.save_steps)]
    assert len(named) == 3 and set(named) <= set(kept), (named, kept)
