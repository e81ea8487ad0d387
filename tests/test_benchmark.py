"""The benchmark compares like with like: MarianMTModel of the same shape, the same batches."""

import os
import subprocess
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tests.conftest import count_returns, tiny_config
from tools.benchmark import (
    ENGINES,
    GENERATE_LENGTH,
    benchmark_generate,
    build_model,
    corpus_batches,
    deployment,
    dropout_timing,
    format_tables,
    generate_forward_share,
    generate_options,
    linear_kernel_report,
    marian_like,
    step_flops,
    training_loss,
)
from vanilla_transformer.conversion import config_from_marian
from vanilla_transformer.corpus import load_default_corpus
from vanilla_transformer.kernels_vanilla_transformer import LinearKernel
from vanilla_transformer.tokenization import train_bpe_tokenizer


def test_marian_counterpart_has_the_same_architecture_and_size():
    config = tiny_config(num_encoder_layers=3)
    models = {kind: build_model(kind, config, "cpu", torch.float32) for kind in ("ours", "marian")}
    trained = {kind: sum(p.numel() for p in m.parameters() if p.requires_grad) for kind, m in models.items()}
    # Marian's frozen position tables and its final-logits-bias buffer are not trained.
    assert trained["marian"] == trained["ours"]
    back = config_from_marian(marian_like(config))
    for field in ("d_model", "num_heads", "d_ff", "num_encoder_layers", "num_decoder_layers", "vocab_size"):
        assert getattr(back, field) == getattr(config, field), field
    assert back.activation_function == "relu" and back.scale_embedding and back.tie_word_embeddings
    assert (
        models["marian"].config._attn_implementation == models["ours"].config._attn_implementation == "sdpa"
    )


@pytest.mark.parametrize("suppress_end", [False, True])
def test_both_models_generate_exactly_the_benchmark_length(suppress_end):
    """Without an end token, or with it forbidden before the length: never shorter, never longer, even
    for models that would rather end at once (a large bias on the end token's logit)."""
    config = tiny_config(add_final_logits_bias=True)
    source = torch.randint(3, 99, (1, 5), generator=torch.Generator().manual_seed(0))
    for kind in ("ours", "marian"):
        model = build_model(kind, config, "cpu", torch.float32).eval()
        with torch.no_grad():
            model.final_logits_bias[0, config.eos_token_id] = 100.0
        assert model.generate(source, max_new_tokens=GENERATE_LENGTH).shape[1] < 1 + GENERATE_LENGTH
        for beams in (1, 2):
            output = model.generate(source, **generate_options(beams, suppress_end=suppress_end))
            assert output.shape == (1, 1 + GENERATE_LENGTH)


def test_batches_generate_timings_and_tables():
    train = load_default_corpus()["train"].select(range(2000))
    tokenizer = train_bpe_tokenizer(list(train["en"]) + list(train["es"]), 300)
    bucketed = corpus_batches(tokenizer, 1024, 3, padding_heavy=False)
    heavy = corpus_batches(tokenizer, 1024, 3, padding_heavy=True)

    def padding(batches):
        return 1 - sum(int((b["labels"] != -100).sum()) for b in batches) / sum(
            b["labels"].numel() for b in batches
        )

    assert padding(heavy) > padding(bucketed) + 0.1
    assert [len(b["input_ids"]) for b in heavy] == [len(b["input_ids"]) for b in bucketed]
    config = tiny_config(vocab_size=len(tokenizer))
    models = {kind: build_model(kind, config, "cpu", torch.float32) for kind in ("ours", "marian")}
    timings = benchmark_generate(models, "cpu", batch_size=2, num_beams=2, repeats=1)
    shares = generate_forward_share(models, "cpu", batch_size=2, num_beams=2)
    assert all(0.0 < share < 1.0 for share in shares.values())
    table = format_tables(
        {
            "device": "cpu",
            "dtype": "float32",
            "threads": 2,
            "torch": torch.__version__,
            "matmul_peak_flops": 1e9,
            "presets": {
                "tiny": {
                    "generate beam 2 batch 2": timings,
                    "generate beam 2 batch 2 share in forward": shares,
                }
            },
        }
    )
    assert "| tiny | generate beam 2 batch 2 (s) |" in table
    assert "| tiny | generate beam 2 batch 2: share of time in model forward |" in table
    forward = {kind: timings[kind] * shares[kind] for kind in timings}
    row = "| tiny | generate beam 2 batch 2: time in model forward (s, median x share) |"
    assert f"{row} {forward['ours']:.3f} | {forward['marian']:.3f} |" in table


def test_the_trainer_path_row_is_timed_right_after_the_length_bucketed_batches(monkeypatch):
    """After the padding-heavy batches MarianMTModel's Trainer-path steps ran 15-23% faster than in a
    fresh process (a state those larger batches leave behind): the Trainer path is timed on the
    length-bucketed batches right after them, the padding-heavy row last."""
    from tools import benchmark

    timed = []

    def fake_training(models, batches, device, rounds, loss_fn=benchmark.training_loss):
        padding = sum(b["labels"].numel() for b in batches) - sum(
            int((b["labels"] != -100).sum()) for b in batches
        )
        timed.append((loss_fn.__name__, padding))
        return {kind: {"tokens_per_s": 1.0, "step_s": 1.0, "total_s": 1.0} for kind in models}

    monkeypatch.setattr(benchmark, "benchmark_training", fake_training)
    monkeypatch.setattr(benchmark, "benchmark_generate", lambda models, *a, **k: dict.fromkeys(models, 1.0))
    monkeypatch.setattr(
        benchmark, "generate_forward_share", lambda models, *a, **k: dict.fromkeys(models, 1.0)
    )
    monkeypatch.setattr(benchmark, "matmul_peak_flops", lambda *a, **k: {"torch.matmul": 1e9})
    monkeypatch.setattr(benchmark, "read_bandwidth", lambda *a, **k: 1e9)
    results = benchmark.run(
        ["tiny"], batches=2, rounds=1, memory=False, deploy=False, attention_lengths=(), plot_path=None
    )
    bucketed, trainer, heavy = timed
    assert [bucketed[0], trainer[0], heavy[0]] == ["training_loss", "trainer_loss", "training_loss"]
    assert trainer[1] == bucketed[1] < heavy[1]  # the same batches, then the padded ones
    entry = results["presets"]["tiny"]
    assert {"train length-bucketed", "train Trainer path", "train padding-heavy"} <= set(entry)
    # What a reader needs to reproduce the figures: MarianMTModel's version, the code, the options.
    import transformers

    assert results["transformers"] == transformers.__version__
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    if head:  # a git checkout (CI's clone): the commit measured, marked where the tree differs from it
        assert results["commit"].split("+")[0] == head
    assert results["options"] == {
        "presets": ["tiny"],
        "max_tokens": benchmark.TRAINING_MAX_TOKENS,
        "batches": 2,
        "rounds": 1,
        "repeats": 9,
        "attention_lengths": [],
        "memory": False,
        "compile": False,
        "deploy": False,
    }


def test_kernel_report_lists_the_measured_choices():
    policy = LinearKernel(mode="auto", onednn=None)
    policy.decisions = {
        (32, (8000, 192), False, True): "onednn",
        (1, (192, 192), True, False): "torch",
        (4, (768, 192), True, True): "mkl",
    }
    policy.probe_seconds = 0.012
    results = {"device": "cpu", "dtype": "float32", "threads": 2, "torch": torch.__version__, "presets": {}}
    results["matmul_peak_flops"] = 1e11
    table = format_tables({**results, "linear_kernel": linear_kernel_report(policy)})
    assert (
        "of 3 decoding product classes, 1 measured fastest on oneDNN, 1 on packed MKL, 1 on torch's" in table
    )
    assert "32 rows x (8000 x 192), kept layout: oneDNN" in table
    assert "4 rows x (768 x 192), kept layout: packed MKL" in table
    assert "1 rows x (192 x 192)" not in table
    assert "(12 ms spent measuring)" in table


def test_step_flops_equal_torchs_count_on_an_independent_implementation():
    """The FLOP formula against torch's FlopCounterMode on MarianMTModel with eager attention (every
    product an explicit matmul), on a batch without padding, forward and backward."""
    config = tiny_config(num_encoder_layers=3, vocab_size=500)
    marian = build_model("marian", config, "cpu", torch.float32)
    marian.config._attn_implementation = "eager"
    generator = torch.Generator().manual_seed(0)
    batch_size, source_length, target_length = 4, 13, 11
    labels = torch.randint(4, 500, (batch_size, target_length), generator=generator)
    batch = {
        "input_ids": torch.randint(4, 500, (batch_size, source_length), generator=generator),
        "attention_mask": torch.ones(batch_size, source_length, dtype=torch.long),
        "labels": labels,
        "decoder_input_ids": torch.cat([torch.zeros(batch_size, 1, dtype=torch.long), labels[:, :-1]], dim=1),
    }
    counter = FlopCounterMode(display=False)
    with counter:
        training_loss(marian, batch).backward()
    assert step_flops(config, batch) == counter.get_total_flops()


def test_dropout_timing_compares_both_implementations():
    timings = dropout_timing((64, 32), repeats=2)
    assert set(timings) == {"F.dropout", "vanilla_transformer dropout"}
    assert all(seconds > 0 for seconds in timings.values())


@pytest.mark.slow  # exports and times four engines
def test_deployment_times_every_engine_and_checks_the_float32_export():
    """Each engine in its own process on the same weights; CTranslate2 float32 must give our tokens.
    Beam search over a random model's near-uniform scores meets near-ties that float32 rounding breaks
    either way, so there one row of 32 may differ (one did, from its 6th token, with one initialisation
    of this model); greedy search must agree everywhere."""
    pytest.importorskip("ctranslate2")
    table = deployment(tiny_config(vocab_size=300), repeats=1)
    assert set(table) == {"greedy batch 1", "beam 4 batch 1", "greedy batch 32", "beam 4 batch 32"}
    for setting, engines in table.items():
        allowed = 1 if setting == "beam 4 batch 32" else 0
        assert engines["float32 export rows differing"] <= allowed, setting
        assert engines["float32 export identical"] == (engines["float32 export rows differing"] == 0)
        assert all(engines[engine]["seconds"] > 0 for engine in ENGINES)
        assert engines["ctranslate2 int8"]["threads"] in (1, os.cpu_count())


def test_ctranslate2_latency_times_translate_batch_alone(monkeypatch):
    """`tools/ctranslate2_latency.py` times `translate_batch` only, as the torch engines' timed calls are
    `generate()` only: reading the output's token names back as ids is done for the warm-up's output."""
    pytest.importorskip("ctranslate2")
    from tools import ctranslate2_latency

    reads = []

    class Result:
        def __init__(self, length):
            self.length = length

        @property
        def hypotheses(self):
            reads.append(self.length)
            return [[f"<{i + 4}>" for i in range(self.length)]]

    class Translator:
        def __init__(self, export_dir, intra_threads):
            pass

        def translate_batch(self, tokens, max_input_length, **options):
            return [Result(options["max_decoding_length"]) for _ in tokens]

    monkeypatch.setattr(ctranslate2_latency.ctranslate2, "Translator", Translator)
    results = ctranslate2_latency.latency("unused", {"2 1": [[5, 6, 2], [7, 8, 2]]}, repeats=3)
    assert results["2 1"]["tokens"] == [[4, 5, 6], [4, 5, 6]]
    # the warm-up's two rows, once per thread count tried; none in the three timed calls
    assert len(reads) == 2 * len({1, os.cpu_count() or 1})


def test_linear_kernel_comparison_withholds_packed_mkl_from_one_variant(monkeypatch):
    """`--compare linear_kernel`: the baseline's policy has no packed MKL to choose, each variant keeps
    its own decisions, and the process's policy is as before afterwards."""
    from tools.decoding_steps_ab import compare, variants
    from vanilla_transformer import kernels_vanilla_transformer as kernels

    policy = kernels.linear_kernel()
    previous = kernels.set_linear_kernel("auto")
    seen = []
    original_decide = kernels.LinearKernel.decide

    def decide(self, *args):
        seen.append(self.mkl is not None)
        return original_decide(self, *args)

    monkeypatch.setattr(kernels.LinearKernel, "decide", decide)
    mkl = policy.mkl
    policy.decisions[(1, (3, 3), False, False)] = "torch"  # a decision of the process, not of a variant
    try:
        rows = compare(tiny_config(d_model=64, d_ff=128), repeats=1, comparison="linear_kernel")
        assert policy.mkl is mkl and policy.decisions == {(1, (3, 3), False, False): "torch"}
    finally:
        kernels.set_linear_kernel(previous)
    assert all(row["same tokens"] and row["ratio"] > 0 for row in rows)
    assert list(variants("linear_kernel")) == ["without packed MKL", "with packed MKL"]
    if mkl is not None:
        # every class is decided once per variant (kept between calls), with and without MKL to choose
        assert seen.count(True) == seen.count(False) > 0


def test_decoding_steps_comparison_times_both_variants(monkeypatch):
    """`tools.decoding_steps_ab` times `generate()` with the layers' `decoding_step` and with their
    `forward` (the patched variant really takes no layer step) and reports identical tokens."""
    from tools.decoding_steps_ab import CELLS, compare
    from vanilla_transformer.modeling_vanilla_transformer import VanillaTransformerDecoderLayer

    steps = count_returns(monkeypatch, VanillaTransformerDecoderLayer, "decoding_step")
    rows = compare(tiny_config(), repeats=1)
    assert [row["cell"] for row in rows] == [
        "greedy batch 1",
        "beam 4 batch 1",
        "greedy batch 32",
        "beam 4 batch 32",
    ]
    assert len(rows) == len(CELLS)
    for row in rows:
        assert row["same tokens"] and row["layer forward"] > 0 and row["decoding_step"] > 0
        assert row["ratio"] == pytest.approx(row["decoding_step"] / row["layer forward"])
    # 31 cached steps x 2 layers per call: 2 calls per cell with the layers' steps, 2 without
    assert len(steps) == len(CELLS) * 2 * 31 * 2


def test_forward_share_counts_the_encoder_once():
    """`generate` runs the encoder outside the model's forward: once left out of the models' share, and
    so counted as transformers' loop."""
    from tests.conftest import tiny_model
    from tools.benchmark import forward_share

    model = tiny_model()
    source = torch.randint(4, 99, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert forward_share(model, "cpu", lambda: model.get_encoder()(input_ids=source)) > 0.5
        # The encoder inside the model's forward: counted once, a share of at most the whole.
        whole = forward_share(model, "cpu", lambda: model(input_ids=source, decoder_input_ids=source))
    assert 0.5 < whole <= 1.0


@pytest.mark.slow  # compiles a decoding step
def test_compiled_decoding_step_comparison_decodes_what_generate_does():
    """`tools.compiled_decoding_step`: its step loop decodes the tokens greedy `generate()` does, and
    each compiled variant (here dynamo with its eager backend: the same plumbing without inductor's
    compile time) is timed and checked against the eager step."""
    from tools.benchmark import GENERATE_LENGTH, build_model, generation_inputs
    from tools.compiled_decoding_step import compare, decode, greedy_step

    config = tiny_config()
    model = build_model("ours", config, "cpu", torch.float32).eval()
    source, options = generation_inputs({"ours": model}, "cpu", 1, 1)
    seconds, tokens = decode(model, source, greedy_step(model), GENERATE_LENGTH)
    with torch.inference_mode():
        expected = model.generate(source, **options)[:, 1:]  # after the start token
    assert seconds > 0 and torch.equal(tokens, expected)

    result = compare(config, repeats=1, backend="eager")
    variants = [
        "compiled",
        "compiled, frozen weights",
        "compiled, C++ wrapper",
        "compiled, C++ wrapper, frozen weights",
    ]
    assert list(result["seconds_per_token"]) == ["eager", "generate()", *variants]
    assert all(value > 0 for value in result["seconds_per_token"].values())
    assert list(result["first_call_s"]) == variants and all(v > 0 for v in result["first_call_s"].values())
    assert result["same_tokens"] == dict.fromkeys(variants, True)


def test_scoring_forward_comparison_times_what_it_names(monkeypatch):
    """`tools.scoring_forward`: the shipped way checks no kept copy, the "checked copies" way checks
    them at every forward and "unchecked copies" never; all three give the loss of torch's kernel."""
    from tests.conftest import tiny_model
    from tools.scoring_forward import WAYS, time_ways, way
    from vanilla_transformer import kernels_vanilla_transformer as kernels

    checked = []
    original = kernels.value_checksum
    monkeypatch.setattr(kernels, "value_checksum", lambda sources: checked.append(1) or original(sources))
    previous = kernels.set_linear_kernel("onednn" if kernels.linear_kernel().onednn is not None else "torch")
    try:
        model = tiny_model("sdpa").eval()
        source = torch.randint(4, 99, (1, 9), generator=torch.Generator().manual_seed(0))
        labels = torch.randint(4, 99, (1, 5), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            expected = model(input_ids=source, labels=labels).loss
            counts = {}
            for name in WAYS:
                with way(name):
                    for _ in range(2):  # counted: the second forward's checks (the first may make copies)
                        before = len(checked)
                        torch.testing.assert_close(model(input_ids=source, labels=labels).loss, expected)
                counts[name] = len(checked) - before
            medians = time_ways(lambda: model(input_ids=source, labels=labels), rounds=1, calls=1)
    finally:
        kernels.set_linear_kernel(previous)
    assert counts["shipped"] == 0 and counts["unchecked copies"] == 0
    if kernels.linear_kernel().onednn is not None:
        assert counts["checked copies"] > 0  # every forward checks the kept layouts
    assert list(medians) == list(WAYS) and all(value > 0 for value in medians.values())


@pytest.mark.parametrize("tool", ["tools.decoding_steps_ab", "tools.compiled_decoding_step"])
def test_tools_timing_two_ways_of_this_model_time_the_default_network(monkeypatch, tool):
    """The tools that time this model against itself (not against MarianMTModel) run the configuration's
    network: without attention biases by default, the paper's (and the bias-free stacked Q/K/V product),
    not the biased network `build_model` makes to match MarianMTModel."""
    import importlib

    module = importlib.import_module(tool)
    seen = []

    class Stop(Exception):
        pass

    def inputs(models, *args):
        seen.append(models["ours"].model.decoder.layers[0].self_attn.q_proj.bias)
        raise Stop

    monkeypatch.setattr(module, "generation_inputs", inputs)
    for attention_bias in (False, True):
        with pytest.raises(Stop):
            module.compare(tiny_config(attention_bias=attention_bias), repeats=1)
    assert seen[0] is None and seen[1] is not None


@pytest.mark.slow  # two fresh processes
def test_benchmark_processes_times_both_models_in_turns_in_each_fresh_process(capsys, monkeypatch):
    """`tools.benchmark_processes`: each process is a new one (its own kernel choices) that times both
    models as the benchmark does; the ratios printed are computed from the printed medians; a count
    below 1 is refused before any process starts."""
    import re

    from tools import benchmark, benchmark_processes

    spawned = []
    spawn = benchmark.subprocess.run

    def run(*args, **kwargs):
        spawned.append(spawn(*args, **kwargs))
        return spawned[-1]

    monkeypatch.setattr(benchmark.subprocess, "run", run)
    benchmark_processes.main(["--preset", "tiny", "--processes", "1", "--repeats", "1"])
    output = capsys.readouterr().out
    rows = re.findall(r"^\| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+)x \|$", output, re.M)
    assert [row[0] for row in rows] == ["1"] and len(spawned) == 1 and spawned[0].returncode == 0
    _, ours, marian, ratio = rows[0]
    assert float(ours) > 0 and float(marian) > 0
    assert float(ratio) == pytest.approx(float(ours) / float(marian), abs=0.006)
    assert f"median ratio {ratio}x (from {ratio}x to {ratio}x)" in output
    with pytest.raises(SystemExit):
        benchmark_processes.main(["--processes", "0"])
    assert len(spawned) == 1


def test_products_and_rest_splits_a_later_step_and_restores_the_kernels(capsys):
    """`tools.products_and_rest`: without products, every linear layer of both models is replaced (a
    later step of ours: per layer the joint Q/K/V, the self-attention output, the cross-attention query
    and output and the two feed-forward matrices, then the output layer; MarianMTModel's projects Q, K
    and V apart), and `F.linear` and this model's kernel mode are what they were afterwards (switching
    the mode drops the measured choices, which are measured again when next needed). The printed
    products are the whole step less the rest, and each ratio is ours / MarianMTModel's. The generation
    loop's share is timed outside `forward`, whose timing wrapper is gone afterwards."""
    import re

    import torch.nn.functional as F

    from tools import products_and_rest
    from vanilla_transformer import kernels_vanilla_transformer as kernels
    from vanilla_transformer.configuration_vanilla_transformer import VanillaTransformerConfig

    linear, mode = F.linear, kernels.linear_kernel().mode
    products_and_rest.main(["--preset", "tiny", "--repeats", "3"])  # medians: one call each was noisy
    assert F.linear is linear and kernels.linear_kernel().mode == mode
    model = torch.nn.Linear(2, 2)
    with products_and_rest.forward_timed(model, spent := [0.0]):
        model(torch.ones(2))
    assert spent[0] > 0 and "forward" not in vars(model)
    output = capsys.readouterr().out
    layers = VanillaTransformerConfig.from_preset("tiny").decoder_layers
    assert f"ours {6 * layers + 1}, MarianMTModel {8 * layers + 1}" in output
    row = r"^\| (\w[\w ]*) \| ([\d.-]+) \| ([\d.-]+) \| ([\d.-]+)x \|$"
    rows = {name: tuple(map(float, values)) for name, *values in re.findall(row, output, re.M)}
    assert list(rows) == ["whole step", "products", "rest", "of which the generation loop"]
    whole, products, rest, loop = rows.values()
    for kind in (0, 1):
        assert whole[kind] > 0 and rest[kind] > 0
        assert products[kind] == pytest.approx(whole[kind] - rest[kind], abs=0.002)
        assert 0 < loop[kind] < whole[kind]  # a step's time outside the model's forward
    for ours, marian, ratio in rows.values():
        # The ratio is printed to 0.005 of the unrounded times, each printed to 0.0005 ms: a short time's
        # rounding moves the ratio of the printed ones by up to 0.0005 (1 + ratio) / marian more
        rounding = 0.005 + 0.0005 * (1 + ours / marian) / marian + 1e-9
        assert ratio == pytest.approx(ours / marian, abs=rounding)


@pytest.mark.slow  # a fresh process that probes kernels and trains both models
def test_benchmark_processes_times_a_training_row_in_a_fresh_process(capsys):
    """`--train`: each process times both models' training steps on the benchmark's batches; the
    printed ratio is ours / MarianMTModel of the printed throughputs."""
    import re

    from tools import benchmark_processes

    benchmark_processes.main(["--preset", "tiny", "--train", "trainer", "--processes", "1", "--rounds", "1"])
    output = capsys.readouterr().out
    assert "train Trainer path, tiny: target tokens per second" in output
    rows = re.findall(r"^\| (\d+) \| ([\d,]+) \| ([\d,]+) \| ([\d.]+)x \|$", output, re.M)
    assert len(rows) == 1
    ours, marian = (float(value.replace(",", "")) for value in rows[0][1:3])
    assert ours > 0 and marian > 0
    assert float(rows[0][3]) == pytest.approx(ours / marian, abs=0.006)


def test_benchmark_script_refuses_bad_flags_before_measuring(tmp_path, run_in_process, monkeypatch):
    """`--repeats 0` ended minutes of measuring in a StatisticsError, and a `--json` or `--plot` that
    cannot be written lost every measurement at the end, in a traceback; the default plot path was
    relative to the working folder (docs/ missing elsewhere). Each is refused before anything runs."""
    import tools.benchmark

    monkeypatch.setattr(tools.benchmark, "run", lambda *args, **kwargs: pytest.fail("measured"))
    afile = tmp_path / "afile"
    afile.write_text("mine")
    refusals = {
        ("--repeats", "0"): "argument --repeats: must be a positive integer, got 0",
        ("--batches", "-1"): "argument --batches: must be a positive integer",
        ("--attention_lengths", "256", "0"): "argument --attention_lengths: must be a positive integer",
        (
            "--json",
            str(tmp_path / "missing" / "b.json"),
        ): f"--json {tmp_path / 'missing' / 'b.json'}: the folder",
        ("--json", str(tmp_path)): "is a folder; name a file to write",
        ("--plot", str(afile / "p.png")): "--plot",
        ("--device", "nonsense"): "--device nonsense:",
    }
    for args, message in refusals.items():
        result = run_in_process("benchmark.py", *args)
        assert result.returncode == 2 and message in result.stderr, (args, result.stderr)
    assert afile.read_text() == "mine"
    monkeypatch.chdir(tmp_path)  # no docs/ here: the default plot is the repository's
    with pytest.raises(pytest.fail.Exception, match="measured"):
        run_in_process("benchmark.py", "--presets", "tiny")
    # Without the ctranslate2 extra, --deploy (the default) ended the run after the first preset's
    # measurements, in a traceback, with no table printed.
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # as if not installed
    result = run_in_process("benchmark.py", "--presets", "tiny")
    assert result.returncode == 2, result.stderr
    assert 'pip install "ctranslate2>=4.5"' in result.stderr and "--no-deploy" in result.stderr
    with pytest.raises(pytest.fail.Exception, match="measured"):
        run_in_process("benchmark.py", "--presets", "tiny", "--no-deploy")


def test_the_matmul_peak_leaves_out_a_kernel_that_cannot_run_the_dtype(monkeypatch):
    """oneDNN without kernels for a dtype on this CPU (bfloat16 on an AVX2-only one) raised from inside
    the benchmark's first measurement: that row is left out, torch's stays."""
    from tools import benchmark

    def refused(*args, **kwargs):
        raise RuntimeError("could not create a primitive descriptor for the inner product")

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", refused, raising=False)
    rates = benchmark.matmul_peak_flops("cpu", torch.float32, size=64, repeats=1)
    assert list(rates) == ["torch.matmul"] and rates["torch.matmul"] > 0
