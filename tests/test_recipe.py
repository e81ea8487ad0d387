"""The small-corpus recipe's parts: learning-rate schedules, the repetition metric, the second corpus's
builder and the recipe comparison script."""

import importlib.util
import itertools
import json
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
from test_training import corpus_files, small_args  # noqa: F401  (a fixture and a helper)

from vanilla_transformer import training
from vanilla_transformer.cli import InputError
from vanilla_transformer.metrics import repeats_ngram, repetition_rate
from vanilla_transformer.training import (
    TrainingConfig,
    default_vocab_size,
    lr_factor,
    paper_peak_lr,
    parse_config,
    train,
)

ROOT = Path(__file__).resolve().parents[1]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_inverse_sqrt_is_the_papers_formula():
    d_model, warmup = 64, 8
    peak = paper_peak_lr(d_model, warmup)
    for step in (1, 4, 8, 9, 50, 4000):
        paper = d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)  # Section 5.3
        assert peak * lr_factor("inverse_sqrt", step, warmup, 0.5, 0.1) == pytest.approx(paper, rel=1e-12)


def test_paper_recipes_checkpoint_every_ten_minutes_of_the_papers_training():
    """Section 5.2: base steps took 0.4 s, big ones 1.0 s; Section 6.1: the last 5 checkpoints, written
    at 10-minute intervals, averaged for base, the last 20 for big. 8 processes: 25,000 + 25,000 tokens."""
    for preset, step_seconds, averaged, steps in (("base", 0.4, 5, 100_000), ("big", 1.0, 20, 300_000)):
        config = TrainingConfig(preset=preset, report_to="none")
        assert config.save_steps * step_seconds == pytest.approx(600)
        assert config.average_checkpoints == config.keep_checkpoints == averaged
        assert (config.max_steps, config.warmup_steps, config.lr_scale) == (steps, 4000, 1.0)
        assert config.max_tokens * 8 == 25_000 + 25_000 and config.lr_schedule == "inverse_sqrt"
        assert (config.adam_beta1, config.adam_beta2, config.adam_epsilon) == (0.9, 0.98, 1e-9)
        assert config.label_smoothing == 0.1 and config.dropout is None  # the preset's: 0.1 / 0.3


class JointVocabulary:
    """What `build_model` reads of a tokenizer: its size and special ids."""

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2

    def __len__(self) -> int:
        return 64


@pytest.mark.parametrize(("preset", "dropout"), [("base", 0.1), ("big", 0.3)])
def test_paper_recipes_build_the_papers_model_and_adam(preset, dropout):
    """Sections 5.3-5.4 and 6.1 in what training actually runs: Adam with beta1 0.9, beta2 0.98 and
    eps 1e-9 at the peak d_model^-0.5 * warmup^-0.5 (about 7e-4 for base), the preset's dropout, label
    smoothing 0.1, beam 4 with length penalty 0.6."""
    config = TrainingConfig(preset=preset, report_to="none")
    model, optimizer, peak = training.build_model(config, JointVocabulary())
    d_model = {"base": 512, "big": 1024}[preset]
    assert peak == pytest.approx(d_model**-0.5 * 4000**-0.5, rel=1e-12)
    (group,) = optimizer.param_groups
    assert (group["betas"], group["eps"], group["lr"]) == ((0.9, 0.98), 1e-9, peak)
    assert group["weight_decay"] == 0 and not group["amsgrad"]
    assert sum(p.numel() for p in group["params"]) == sum(p.numel() for p in model.parameters())
    built = model.config
    assert (built.d_model, built.dropout, built.label_smoothing) == (d_model, dropout, 0.1)
    generation = model.generation_config
    assert (generation.num_beams, generation.length_penalty, generation.early_stopping) == (4, 0.6, True)


def test_linear_schedule_warms_up_then_ends_at_zero():
    factors = [
        lr_factor("linear", step, 4, progress=(step - 1) / 10, warmup_progress=0.4) for step in range(1, 11)
    ]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    # From progress 0.4 (end of warm-up) straight down to 0 at progress 1.
    assert factors[4:] == pytest.approx([(1 - p / 10) / 0.6 for p in range(4, 10)])
    assert lr_factor("linear", 20, 4, progress=1.3, warmup_progress=0.4) == 0.0  # never negative


def test_cooldown_scales_either_schedule_down_to_zero_over_the_last_share():
    for schedule in ("inverse_sqrt", "linear"):
        plain = {p: lr_factor(schedule, 40, 8, p, 0.2) for p in (0.5, 0.75, 0.9, 0.99)}
        cooled = {
            p: lr_factor(schedule, 40, 8, p, 0.2, cooldown=0.25) for p in (0.5, 0.75, 0.9, 0.99, 1.0, 1.2)
        }
        assert cooled[0.5] == plain[0.5] and cooled[0.75] == plain[0.75]  # before the last quarter: untouched
        assert cooled[0.9] == pytest.approx(0.4 * plain[0.9]) and cooled[0.99] == pytest.approx(
            0.04 * plain[0.99]
        )
        assert cooled[1.0] == 0.0 and cooled[1.2] == 0.0  # never negative
    assert lr_factor("inverse_sqrt", 40, 8, 0.5, 0.2) == (8 / 40) ** 0.5
    assert lr_factor("inverse_sqrt", 4, 8, 0.9, 0.2, cooldown=0.25) == pytest.approx(0.5 * 0.4)  # warm-up too


def test_training_cools_down_over_the_last_updates(tmp_path, corpus_files):  # noqa: F811
    args = small_args(
        tmp_path / "run", corpus_files, max_steps=12, eval_steps=0, logging_steps=1, test_samples=1
    )
    result = train(parse_config([*args, "--lr_cooldown", "0.25", "--max_train_minutes", "0"]))
    peak = paper_peak_lr(64, 8, 2.0)  # small_args: d_model 64, 8 warm-up updates, lr_scale 2
    # Update s runs at progress (s - 1) / 12; the last quarter (updates 11 and 12) is cooled.
    paper = {s: peak * min(s / 8, (8 / s) ** 0.5) for s in range(1, 13)}
    expected = {s: paper[s] * min(1.0, (1 - (s - 1) / 12) / 0.25) for s in range(1, 13)}
    assert logged_lrs(result) == pytest.approx(expected, rel=1e-9)
    assert expected[12] < expected[11] < paper[11] and expected[10] == paper[10]


def logged_lrs(result: dict) -> dict[int, float]:
    return {h["step"]: h["lr"] for h in result["history"] if "lr" in h}


def test_training_follows_the_linear_schedule_to_the_end_of_the_updates(tmp_path, corpus_files):  # noqa: F811
    args = small_args(
        tmp_path / "run", corpus_files, max_steps=12, eval_steps=0, logging_steps=1, test_samples=1
    )
    result = train(parse_config([*args, "--lr_schedule", "linear"]))
    peak = paper_peak_lr(64, 8, 2.0)  # small_args: d_model 64, 8 warm-up updates, lr_scale 2
    expected = {s: peak * s / 8 if s <= 8 else peak * (12 - (s - 1)) / (12 - 8) for s in range(1, 13)}
    assert logged_lrs(result) == pytest.approx(expected, rel=1e-9)
    # The budget shapes this schedule: resumed with a larger one, the rate went back up from near 0
    # while the card said it fell to 0 once, at the new end. Refused, naming it; a --max_steps the run
    # has reached finishes it as it is (no further update).
    linear = [*args, "--lr_schedule", "linear", "--resume_from_checkpoint"]
    earlier = str(tmp_path / "run" / "checkpoints" / "step-00000008")
    for flag, value in (("--max_steps", "24"), ("--max_train_minutes", "9.0")):
        with pytest.raises(InputError, match=rf"another recipe \({flag} \S+ -> {value}\).* length sets"):
            train(parse_config([*linear, earlier, flag, value]))
    # 8: no more than the warm-up, which a new run is refused (its rate would only rise).
    assert train(parse_config([*linear, "latest", "--max_steps", "8"]))["metrics"]["steps"] == 12


def test_linear_schedule_decays_with_the_time_budget(tmp_path, corpus_files, monkeypatch, caplog):  # noqa: F811
    # A clock that advances 20 ms each time the loop reads it: the same number of updates fits the
    # 0.6 s budget on any machine, however slow or busy.
    ticks = itertools.count()
    clock = types.SimpleNamespace(perf_counter=lambda: 0.02 * next(ticks), strftime=time.strftime)
    monkeypatch.setattr(training, "time", clock)
    args = small_args(tmp_path / "run", corpus_files, max_steps=100_000, eval_steps=0, logging_steps=1)
    args += [
        "--warmup_steps",
        "2",
        "--max_train_minutes",
        "0.01",
        "--lr_schedule",
        "linear",
        "--test_samples",
        "1",
    ]
    result = train(parse_config(args))
    assert result["metrics"]["stopped_by"] == "max_train_minutes"
    lrs = [lr for _, lr in sorted(logged_lrs(result).items())]
    peak = paper_peak_lr(64, 2, 2.0)
    assert lrs[1] == pytest.approx(peak) and max(lrs) == pytest.approx(peak)
    after_warmup = lrs[1:]
    assert all(b <= a for a, b in itertools.pairwise(after_warmup)), lrs
    assert len(lrs) >= 4 and lrs[-1] < 0.5 * peak, lrs  # the budget, not the 100,000 updates, sets the decay
    # Resumed with its budget spent: no update, and the advice is a new run, not a larger budget (which
    # a resume of this schedule refuses).
    with caplog.at_level("WARNING", logger=training.__name__):
        again = train(parse_config([*args, "--resume_from_checkpoint", "latest"]))
    assert again["metrics"]["steps"] == result["metrics"]["steps"]
    assert "start a new run in another --output_dir" in caplog.text and "Raise it" not in caplog.text


def test_default_vocabulary_grows_with_the_corpus_within_bounds():
    assert default_vocab_size(306_981) == 4000  # the embedded corpus: 4,000 measured best (docs/recipe.md)
    assert default_vocab_size(433_923) == 6000
    assert default_vocab_size(10) == 1000 and default_vocab_size(10**9) == 37000  # the paper's, at most
    sizes = [default_vocab_size(words) for words in range(0, 4_000_000, 50_000)]
    assert sizes == sorted(sizes) and all(size % 1000 == 0 for size in sizes)


def test_bad_schedule_is_rejected():
    with pytest.raises(ValueError, match="--lr_schedule must be one of"):
        TrainingConfig(lr_schedule="cosine")
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="--lr_cooldown must be between 0 and 1"):
            TrainingConfig(lr_cooldown=bad)


def test_length_penalty_form_goes_to_the_decoding_settings():
    assert TrainingConfig().decoding()["length_penalty_form"] == "power"  # transformers' and CTranslate2's
    paper = TrainingConfig(length_penalty_form="gnmt").decoding()
    assert paper["length_penalty_form"] == "gnmt" and paper["length_penalty"] == 0.6
    assert "length_penalty_form" not in TrainingConfig(num_beams=1).decoding()  # no beams, no penalty
    with pytest.raises(ValueError, match="--length_penalty_form must be one of"):
        TrainingConfig(length_penalty_form="wu")


def test_repetition_counts_outputs_with_a_4gram_seen_three_times():
    looping = "der Vorschau der Vorschau der Vorschau der Vorschau"  # "der Vorschau der Vorschau" x3
    assert repeats_ngram(looping)
    assert not repeats_ngram("de la casa de la casa de la casa")  # each 4-gram twice only
    assert not repeats_ngram("a b c")  # shorter than a 4-gram
    # Scripts without spaces: a sentence was one word, and a Chinese or Thai model's loops counted none.
    assert repeats_ngram("我们的的的的的的的") and repeats_ngram("ไปไปไปไปไปไป")
    assert repeats_ngram("他说我们走吧我们走吧我们走吧。") and not repeats_ngram("他说我们走吧，我们走吧。")
    assert not repeats_ngram("我们今天去北京，明天去上海，后天回家。")  # a sentence without a loop
    assert repeats_ngram("東京の東京の東京の東京の") and not repeats_ngram("Tokyo 東京 Tokyo 東京")
    assert repetition_rate([looping, "ok", "a b c d a b c d a b c d"]) == pytest.approx(2 / 3)
    assert repetition_rate([]) == 0.0
    with pytest.raises(ValueError, match="not a single string"):
        repetition_rate("a b c d")


@pytest.fixture
def locale_dir(tmp_path) -> Path:
    """Three German catalogs written with polib, one of them a name list."""
    polib = pytest.importorskip("polib")
    folder = tmp_path / "locale" / "de" / "LC_MESSAGES"
    folder.mkdir(parents=True)
    catalogs = {
        "tool": [
            ("_Open file", "Datei _öffnen", []),
            ("Cannot open %s: %s", "Kann %s nicht öffnen: %s", []),
            ("Copied %d files", "Dateien kopiert", []),  # placeholder lost: dropped
            ("Fuzzy message", "Unsichere Nachricht", ["fuzzy"]),  # dropped
            ("OK", "OK", []),  # identical: dropped
            ("Shared message", "Gemeinsame Nachricht", []),
        ],
        "iso_3166": [("Germany", "Deutschland", [])],  # a name list: skipped
    }
    for name, entries in catalogs.items():
        catalog = polib.POFile()
        for source, target, flags in entries:
            catalog.append(polib.POEntry(msgid=source, msgstr=target, flags=flags))
        catalog.save_as_mofile(str(folder / f"{name}.mo"))
    return tmp_path / "locale"


def test_messages_corpus_keeps_clean_pairs_and_whole_catalogs_per_split(locale_dir, tmp_path, capsys):
    builder = load_script("build_messages_corpus")
    assert builder.normalise("_Open\n  the  &file") == "Open the file"
    assert builder.normalise("Von-_links-nach-rechts, pinentry|_OK") == "Von-links-nach-rechts, pinentry|OK"
    for text in ("escape & as &amp; or &#38;", "same as %_d", "define `_POSIX2_LOCALEDEF'", "pam_*_item()"):
        assert builder.normalise(text) == text  # once "escape & as amp; or #38;", "same as %d", ...
    assert builder.normalise("function _open_osfhandle failed") == "function _open_osfhandle failed"
    assert builder.placeholders("%2$s of {name} at %.*s") == builder.placeholders("{name}: %.*s %2$s")
    assert list(builder.placeholders("%05d, %1$-08.3f and %'d%%").elements()) == [
        "%05d",
        "%1$-08.3f",
        "%'d",
        "%%",
    ]
    # Zeros read as flags or as a width: a run of them took quadratic time (8,000: 2 s; these 200,000,
    # about 20 minutes), now linear (milliseconds). Not timed: a process that does not end in 10 minutes
    # is a hang.
    script = f"import runpy; b = runpy.run_path({str(ROOT / 'scripts' / 'build_messages_corpus.py')!r}); "
    script += "assert not b['placeholders']('%' + '0' * 200_000)"
    subprocess.run([sys.executable, "-c", script], check=True, timeout=600)

    output = tmp_path / "corpus"
    assert builder.main(["--locale-dir", str(locale_dir), "--output-dir", str(output)]) == 0
    rows = {
        split: [json.loads(line) for line in (output / f"{split}.jsonl").read_text().splitlines()]
        for split in ("train", "validation", "test")
    }
    kept = [row for split in rows.values() for row in split]
    assert sorted(r["en"] for r in kept) == ["Cannot open %s: %s", "Open file", "Shared message"]
    assert {"en": "Open file", "de": "Datei öffnen"} in kept
    # One catalog, one split.
    assert sum(bool(split) for split in rows.values()) == 1
    assert builder.catalog_split("tool") in [name for name, split in rows.items() if split]
    assert "left no pairs for" in capsys.readouterr().err  # said, not silent
    again = tmp_path / "again"  # the other scripts' underscore spelling of each flag is taken too
    assert (
        builder.main(["--locale_dir", str(locale_dir), "--output_dir", str(again), "--max_words", "30"]) == 0
    )
    for split in ("train", "validation", "test"):
        assert (again / f"{split}.jsonl").read_bytes() == (output / f"{split}.jsonl").read_bytes()
    with pytest.raises(SystemExit):  # the rows' "en" field is the source: "en" as target would overwrite it
        builder.main(["--locale-dir", str(locale_dir), "--output-dir", str(output), "--language", "en"])


def test_messages_corpus_writes_a_new_folder_whole_or_not_at_all(locale_dir, tmp_path, monkeypatch, capsys):
    """The three files were written one by one into --output-dir, whatever it held: someone's own
    train.jsonl was overwritten without a word, and a run that failed part way left a mix of new and old
    files."""
    builder = load_script("build_messages_corpus")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "train.jsonl").write_text('{"en": "my own", "de": "mein eigenes"}\n')
    with pytest.raises(SystemExit):
        builder.main(["--locale-dir", str(locale_dir), "--output-dir", str(mine)])
    assert "exists and is not an empty folder" in capsys.readouterr().err
    assert (mine / "train.jsonl").read_text() == '{"en": "my own", "de": "mein eigenes"}\n'

    def fail_on_test(pairs, path, language):
        if path.name == "test.jsonl":
            raise OSError(28, "No space left on device")
        path.write_text("")

    monkeypatch.setattr(builder, "write_jsonl", fail_on_test)
    output = tmp_path / "corpus"
    with pytest.raises(SystemExit, match="No space left on device"):
        builder.main(["--locale-dir", str(locale_dir), "--output-dir", str(output)])
    assert not output.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["locale", "mine"]


def test_messages_corpus_without_polib_says_so_before_any_download(tmp_path, monkeypatch, capsys):
    """polib is imported where the catalogs are read: without it the script ended in a traceback, after
    downloading and unpacking 18 Debian packages."""
    builder = load_script("build_messages_corpus")
    monkeypatch.setattr(builder, "fetch_locale_dir", lambda _: pytest.fail("downloaded"))
    monkeypatch.setattr(builder, "polib_missing", lambda: True)
    with pytest.raises(SystemExit):
        builder.main(["--output-dir", str(tmp_path / "corpus")])
    assert "reading the catalogs needs polib: pip install polib" in capsys.readouterr().err
    assert not (tmp_path / "corpus").exists()


@pytest.mark.parametrize("content", [b"not a catalog", b"\xde\x12\x04\x95"], ids=["not-mo", "cut-short"])
def test_a_catalog_that_is_not_one_is_named(locale_dir, tmp_path, capsys, content):
    """polib's errors went up as a traceback naming no file ("unpack requires a buffer of 8 bytes")."""
    builder = load_script("build_messages_corpus")
    broken = locale_dir / "de" / "LC_MESSAGES" / "broken.mo"
    broken.write_bytes(content)
    output = tmp_path / "corpus"
    with pytest.raises(SystemExit):
        builder.main(["--locale-dir", str(locale_dir), "--output-dir", str(output)])
    assert f"{broken} is not a readable .mo catalog" in capsys.readouterr().err
    assert not output.exists()


def test_held_out_messages_close_to_training_ones_are_dropped(monkeypatch):
    """Messages shared by several programs differ in case or quoting; compared exactly, 68 of them once
    sat in both the training and the test split of the built corpus."""
    builder = load_script("build_messages_corpus")
    pairs = {
        "a": [("Cannot open %s", "x"), ("Command line", "y")],
        "b": [("cannot open '%s'", "z"), ("command-line:", "w"), ("New message", "v")],
    }
    monkeypatch.setattr(builder, "catalog_split", lambda name: "train" if name == "a" else "test")
    monkeypatch.setattr(builder, "catalog_pairs", lambda path, max_words: pairs[path.stem])
    splits = builder.build([Path("a.mo"), Path("b.mo")], 50)
    assert splits["train"] == pairs["a"] and splits["test"] == [("New message", "v")]


def test_compare_recipes_validates_its_flags(tmp_path, capsys):
    """--train_file alone trained both sides and then failed in the Marian side (KeyError: 'test'), after
    twice --minutes of training; an --output_dir that is a file, or under one, failed with a traceback,
    and an empty one wrote into the current folder."""
    compare = load_script("compare_recipes")
    (tmp_path / "file").write_text("")
    for flags, message in (
        (["--output_dir", "x", "--minutes", "0"], "--minutes must be positive"),
        (["--output_dir", "x", "--validation_file", "v.tsv"], "together, or none of them"),
        (["--output_dir", "x", "--train_file", "t.tsv"], "together, or none of them"),
        (["--output_dir", "x", "--train_file", "t.tsv", "--test_file", "t.tsv"], "together, or none"),
        (["--output_dir", " "], "--output_dir is empty"),
        (["--output_dir", str(tmp_path / "file")], "is a file, not a folder"),
        (["--output_dir", str(tmp_path / "file" / "x")], "is a file, not a folder"),
    ):
        with pytest.raises(SystemExit):
            compare.parse_args(flags)
        assert message in capsys.readouterr().err, flags
    files = ["--train_file", "t.tsv", "--validation_file", "v.tsv", "--test_file", "s.tsv"]
    parsed = compare.parse_args(["--output_dir", str(tmp_path / "new"), *files])
    assert parsed.output_dir == tmp_path / "new" and parsed.train_file == "t.tsv"


def test_compare_recipes_formats_the_table():
    compare = load_script("compare_recipes")
    row = {"updates": 10, "train_minutes": 1.0, "bleu": 13.0, "chrf": 40.0}
    row |= {"repetition": 0.02, "reference_repetition": 0.01}
    table = compare.format_table({"ours": row, "marian": row | {"bleu": 10.0}})
    assert "| ours | 10 | 1.0 | 13.00 | 40.00 | 2.0% (references 1.0%) |" in table
    assert "BLEU ours / marian: 1.30x" in table and "not an equal budget" not in table
    stopped = row | {"stopped_by": "max_steps"}
    table = compare.format_table({"ours": stopped, "marian": row | {"stopped_by": "max_train_minutes"}})
    assert "The ours run stopped at its update limit, not after the minutes: not an equal budget." in table
    assert "The marian run" not in table


def test_compare_recipes_trains_ours_for_the_minutes_alone(tmp_path, monkeypatch):
    """Ours kept the recipe's 1,650 updates, which a fast machine finished minutes before the Marian side
    stopped: the minutes alone stop it now (a --max_steps of the user's, after it, still counts), at the
    seed of both sides."""
    compare = load_script("compare_recipes")
    commands = []

    def run(command, check):
        commands.append(command)
        return types.SimpleNamespace(returncode=1)  # as a failed run: nothing to read afterwards

    monkeypatch.setattr(compare.subprocess, "run", run)
    for ours_args in ("", "--max_steps 30"):
        args = compare.parse_args(["--output_dir", str(tmp_path), "--seed", "3", "--ours_args", ours_args])
        with pytest.raises(SystemExit):
            compare.run_ours(args)
        command = commands[-1]
        steps = [command[i + 1] for i, flag in enumerate(command) if flag == "--max_steps"]
        assert int(steps[0]) >= 10**9 and steps[1:] == ([] if not ours_args else ["30"])
        assert command[command.index("--seed") + 1] == "3"


def test_compare_recipes_refuses_ours_args_it_cannot_pass_on(capsys):
    """Unbalanced quotes ended in shlex's traceback; --output_dir trained ours where its metrics.json was
    not read (a FileNotFoundError after the training), --max_train_minutes (or its abbreviation) or a
    data flag made the comparison unequal without a word."""
    compare = load_script("compare_recipes")
    assert compare.parse_args(
        ["--output_dir", "x", "--ours_args", "--vocab_size 400 --max_steps=3"]
    ).ours_args
    for ours_args, message in (
        ("--lr_scale '2", "No closing quotation"),
        ("--output_dir=elsewhere", "sets --output_dir,"),
        ("--max_train 60", "sets --max_train_minutes,"),
        ("--seed 1 --train_file other.tsv --target_lang de", "sets --seed, --target_lang, --train_file,"),
        # ours alone trained on other data, or scored otherwise (the Marian side at beam 4, every pair)
        ("--num_beams 1 --test_samples 5", "sets --num_beams, --test_samples, which would train or score"),
        ("--dataset_name x --length_pen 1", "sets --dataset_name, --length_penalty, --length_penalty_form,"),
    ):
        with pytest.raises(SystemExit):
            compare.parse_args(["--output_dir", "x", f"--ours_args={ours_args}"])
        assert message in capsys.readouterr().err


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="a file size limit (POSIX)")
def test_compare_recipes_leaves_an_earlier_result_whole_when_writing_fails(tmp_path, monkeypatch):
    """Each side's result was written in place: a disk that filled up part way (here a file size limit,
    which fails the write the same way) left half a JSON file where the earlier result was."""
    import resource

    compare = load_script("compare_recipes")
    earlier = tmp_path / "ours.json"
    earlier.write_text('{"bleu": 13.0}')
    result = {"bleu": 14.0, "hypotheses": ["una frase"] * 1000}  # 14 kB
    monkeypatch.setattr(compare, "run_ours", lambda args: result)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write over the limit: an error, not a kill
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limits[1]))
    try:
        with pytest.raises(OSError, match="File too large"):
            compare.main(["--output_dir", str(tmp_path), "--only", "ours"])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
    assert earlier.read_text() == '{"bleu": 13.0}' and sorted(tmp_path.iterdir()) == [earlier]
    assert compare.main(["--output_dir", str(tmp_path), "--only", "ours"]) == 0
    assert json.loads(earlier.read_text()) == result


@pytest.mark.slow  # three processes, each importing transformers: about 26 s
def test_compare_recipes_ends_a_failed_side_with_its_error_not_tracebacks(tmp_path):
    """A bad data file: train.py said so, then each of the two compare_recipes processes above it added a
    CalledProcessError traceback; the Marian side alone (--only marian) ended in load_parallel_data's."""
    missing = str(tmp_path / "missing.tsv")
    command = [sys.executable, str(ROOT / "scripts/compare_recipes.py"), "--output_dir", str(tmp_path / "c")]
    command += ["--train_file", missing, "--validation_file", missing, "--test_file", missing]
    command += ["--minutes", "0.01"]
    for only, said in (
        ((), [f"--train_file {missing} is not a file", "the ours run failed"]),
        (
            ("--only", "marian"),
            [f"train file {missing} does not exist"],
        ),
    ):
        result = subprocess.run([*command, *only], capture_output=True, text=True, timeout=300, check=False)
        assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
        assert all(message in result.stderr for message in said), result.stderr[-3000:]


@pytest.mark.slow
def test_compare_recipes_runs_both_sides(tmp_path, corpus_files):  # noqa: F811
    output = tmp_path / "compare"
    command = [sys.executable, str(ROOT / "scripts/compare_recipes.py"), "--output_dir", str(output)]
    command += [
        "--train_file",
        corpus_files["train_file"],
        "--validation_file",
        corpus_files["validation_file"],
    ]
    command += ["--test_file", corpus_files["test_file"], "--minutes", "0.02", "--marian_vocab_size", "400"]
    command += ["--ours_args", "--vocab_size 400 --config_overrides d_model=64,d_ff=128,num_heads=4"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    results = json.loads((output / "comparison.json").read_text())
    for side in ("ours", "marian"):
        assert results[side]["updates"] > 0 and results[side]["train_minutes"] >= 0.02
        assert 0 <= results[side]["bleu"] <= 100 and 0 <= results[side]["repetition"] <= 1
        # both stopped by the minutes: ours' recipe stopped at its 1,650 updates, minutes early
        assert results[side]["stopped_by"] == "max_train_minutes"
    run = results["run"]
    assert run["arguments"]["minutes"] == 0.02 and run["arguments"]["seed"] == 0
    assert run["machine"]["cores"] >= 1 and run["versions"]["transformers"]
    assert "not an equal budget" not in result.stdout
    assert "| ours |" in result.stdout and "| marian |" in result.stdout
