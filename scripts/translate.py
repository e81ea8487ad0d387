"""Translate lines of text with a trained model folder, in batches.

echo "In the beginning, God created the heavens and the earth." | python scripts/translate.py --model DIR
python scripts/translate.py --model DIR --input en.txt --output es.txt --num_beams 4
python scripts/translate.py --model CT2_DIR --engine ctranslate2 < en.txt   # scripts/export_ctranslate2.py

An --output file is written beside its final name and renamed when every line is translated: a failure
or Ctrl-C leaves the file as it was. Standard output gets each line as it is translated: typed at a
terminal, each line as it is entered; read from a file or a pipe, 8 batches of lines at a time (so that
lines of similar length share a batch).
"""

import argparse
import contextlib
import os
import sys

from vanilla_transformer.cli import (
    add_length_penalty_form,
    check_output_file,
    input_bytes,
    non_negative_int,
    positive_int,
    replaced_when_complete,
    utf8_stdout,
)
from vanilla_transformer.evaluation import load_model_folder
from vanilla_transformer.modeling_vanilla_transformer import length_penalty_problem
from vanilla_transformer.translation import LineError, decoded_lines, translate_lines, translate_stream

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument(
    "--model", required=True, help="model folder (or Hub id); a CTranslate2 export with --engine"
)
parser.add_argument(
    "--engine",
    choices=["transformers", "ctranslate2"],
    default="transformers",
    help="generate() of the model folder, or a folder from scripts/export_ctranslate2.py",
)
parser.add_argument("--input", type=input_bytes, default="-", help="UTF-8 text (default: stdin)")
parser.add_argument("--output", default="-", help="default: stdout")
parser.add_argument("--batch_size", type=positive_int, default=32, help="sentences per batch (default: 32)")
parser.add_argument("--num_beams", type=positive_int, help="default: the model's generation config (4)")
parser.add_argument("--length_penalty", type=float, help="default: the model's generation config")
add_length_penalty_form(parser)
parser.add_argument("--max_new_tokens", type=positive_int, help="default: source length + 50")
parser.add_argument(
    "--no_repeat_ngram_size",
    type=non_negative_int,
    help="forbid repeating any token n-gram; 0: off (default: the model's generation config: off unless set)",
)
parser.add_argument(
    "--do_sample", action=argparse.BooleanOptionalAction, help="default: the model's generation config"
)
parser.add_argument("--device", help="cpu, cuda, ... (default: cuda if available, for either engine)")
parser.add_argument(
    "--trust_remote_code",
    action="store_true",
    help="load a model whose folder (or Hub repo) holds model code of its own, running that code; this "
    "package's models need none",
)
args = parser.parse_args()
if args.output != "-":
    try:
        check_output_file(args.output, args.input, args.model)  # the open input: `--output F < F` too
    except ValueError as error:
        parser.error(str(error))
if problem := length_penalty_problem(args.length_penalty, beam_search=False):  # None: not given
    parser.error(f"--length_penalty {problem}")
options = {
    "num_beams": args.num_beams,
    "length_penalty": args.length_penalty,
    "length_penalty_form": args.length_penalty_form,
    "max_new_tokens": args.max_new_tokens,
    "no_repeat_ngram_size": args.no_repeat_ngram_size,
}
generate_kwargs = {key: value for key, value in options.items() if value is not None}


# Lines typed at a terminal are translated as they come; a file's, in windows of sentences to sort.
window = 1 if args.input.isatty() else args.batch_size * 8
if args.engine == "ctranslate2":
    if args.do_sample or args.max_new_tokens is not None:
        parser.error("--do_sample and --max_new_tokens are for --engine transformers")
    if generate_kwargs.pop("length_penalty_form", "power") != "power":
        parser.error(
            "CTranslate2 divides by |Y|^alpha only: --length_penalty_form gnmt is for --engine transformers"
        )
    from vanilla_transformer.export_ctranslate2 import CTranslate2Translator, import_ctranslate2

    try:
        ctranslate2 = import_ctranslate2()  # a clear error naming the install where it is missing
        device = args.device or ("cuda" if ctranslate2.get_cuda_device_count() > 0 else "cpu")
        translator = CTranslate2Translator(args.model, device=device)
    except (OSError, ValueError, ImportError, RuntimeError) as error:
        parser.error(str(error))
    lines = translate_stream(  # numbered: a warning about a translation names its line
        lambda texts, numbers: translator.translate(
            texts, batch_size=args.batch_size, line_numbers=numbers, **generate_kwargs
        ),
        decoded_lines(args.input),
        window=window,
        numbered=True,
    )
else:
    try:
        model, tokenizer = load_model_folder(args.model, args.device, args.trust_remote_code)
    except (OSError, ValueError, RuntimeError) as error:
        parser.error(str(error))
    if args.do_sample is not None:  # unset: the model's generation config decides, as for the others
        generate_kwargs["do_sample"] = args.do_sample
    lines = translate_lines(
        model,
        tokenizer,
        decoded_lines(args.input),
        batch_size=args.batch_size,
        window=window,
        **generate_kwargs,
    )
if args.output == "-":  # UTF-8 as the input and an --output file are, not the locale's encoding
    utf8_stdout()
output = contextlib.nullcontext(sys.stdout) if args.output == "-" else replaced_when_complete(args.output)
try:
    with output as stream:
        for translation in lines:
            stream.write(translation + "\n")
            if stream is sys.stdout:
                sys.stdout.flush()
except LineError as error:  # not UTF-8; longer than an export's positions
    sys.exit(f"error: {args.input.name}: {error}")
except (ValueError, RuntimeError) as error:
    sys.exit(f"error: {error}")
except KeyboardInterrupt:
    sys.exit(130)
except BrokenPipeError:  # the reader left (`| head`): stop quietly, as command-line tools do
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
    sys.exit(141)
except OSError as error:  # the output cannot be written: a full disk, a read-only folder, ...
    written = "standard output" if args.output == "-" else f"--output {args.output}"
    sys.exit(f"error: writing {written} failed: {error}")
