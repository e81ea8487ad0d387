"""Score a trained model folder with BLEU and chrF (sacreBLEU, through `evaluate`).

(Not named evaluate.py: a script of that name would shadow the `evaluate` library for every script here.)

    python scripts/evaluate_model.py --model outputs/tiny-en-es      # embedded corpus, test split
    python scripts/evaluate_model.py --model DIR --test_file test.tsv --source_lang de --target_lang en
"""

import argparse
import sys
from pathlib import Path

from vanilla_transformer.cli import (
    add_length_penalty_form,
    check_output_file,
    non_negative_int,
    positive_int,
    replaced_when_complete,
    utf8_stdout,
)
from vanilla_transformer.corpus import default_corpus_path
from vanilla_transformer.evaluation import evaluate_model, format_scores
from vanilla_transformer.modeling_vanilla_transformer import length_penalty_problem
from vanilla_transformer.parallel_data import resolve_languages

utf8_stdout()  # what is printed, in UTF-8 whatever the locale

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--model", required=True, help="model folder (or Hub id)")
parser.add_argument("--test_file", help="local .tsv/.csv/.jsonl file to score (default: embedded corpus)")
parser.add_argument("--split", default="test", help="split of the embedded corpus (default: test)")
parser.add_argument("--source_lang", help="default: en (needed with --source_column)")
parser.add_argument(
    "--target_lang",
    help="default: es (needed with --target_column); it also picks BLEU's tokeniser, as sacreBLEU does (zh, "
    "ja, ko: theirs; else 13a)",
)
parser.add_argument("--source_column")
parser.add_argument("--target_column")
parser.add_argument("--max_samples", type=positive_int, help="score only the first N pairs")
parser.add_argument("--batch_size", type=positive_int, default=32, help="sentences per batch (default: 32)")
parser.add_argument("--num_beams", type=positive_int, help="default: the model's generation config (4)")
parser.add_argument("--length_penalty", type=float, help="default: the model's generation config (0.6)")
add_length_penalty_form(parser)
parser.add_argument(
    "--no_repeat_ngram_size",
    type=non_negative_int,
    help="forbid repeating any token n-gram; 0: off (default: the model's generation config: off unless set)",
)
parser.add_argument(
    "--bleu_tokenize",
    help="sacreBLEU's BLEU tokeniser: 13a, intl, zh, char, none, ja-mecab, ko-mecab, flores200, ... "
    "(default: sacreBLEU's for --target_lang: zh for Chinese, MeCab's for Japanese and Korean, else 13a; "
    "char suits Thai, Lao, Khmer, Myanmar); moses-compound-split: the paper's tokenised BLEU with compound "
    "splitting (needs sacremoses); the BLEU signature names it",
)
parser.add_argument("--device", help="cpu, cuda, ... (default: cuda if available)")
parser.add_argument(
    "--trust_remote_code",
    action="store_true",
    help="load a model whose folder (or Hub repo) holds model code of its own, running that code; this "
    "package's models need none",
)
parser.add_argument(
    "--hypotheses",
    type=Path,
    help="also write the translations here, one line per scored pair in file order (rows skipped for an "
    "empty side, which the summary counts, have none)",
)
args = parser.parse_args()
if problem := length_penalty_problem(args.length_penalty, beam_search=False):  # None: not given
    parser.error(f"--length_penalty {problem}")
try:
    resolve_languages(args)
except ValueError as error:
    parser.error(str(error))
if args.test_file and args.split != "test":
    parser.error("--split names a split of the embedded corpus; a --test_file is scored whole")
if args.hypotheses is not None:  # checked now (its folder writable too), not after the whole evaluation
    try:
        check_output_file(args.hypotheses, args.test_file or default_corpus_path(), args.model)
    except ValueError as error:
        parser.error(f"--hypotheses {error}")

data_options = {
    "source_lang": args.source_lang,
    "target_lang": args.target_lang,
    "source_column": args.source_column,
    "target_column": args.target_column,
}
split = args.split
if args.test_file:
    data_options["test_file"] = args.test_file
    split = "test"
try:
    result = evaluate_model(
        args.model,
        split=split,
        max_samples=args.max_samples,
        batch_size=args.batch_size,
        device=args.device,
        data_options=data_options,
        trust_remote_code=args.trust_remote_code,
        bleu_tokenize=args.bleu_tokenize,
        # Unset: the model's own settings, with which its card's scores were computed.
        **({"num_beams": args.num_beams} if args.num_beams else {}),
        **({"length_penalty": args.length_penalty} if args.length_penalty is not None else {}),
        **({"length_penalty_form": args.length_penalty_form} if args.length_penalty_form else {}),
        **(
            {"no_repeat_ngram_size": args.no_repeat_ngram_size}
            if args.no_repeat_ngram_size is not None
            else {}
        ),
    )
except (ValueError, OSError) as error:
    parser.error(str(error))
except KeyboardInterrupt:  # Ctrl-C: nothing was written; stop as command-line tools do
    sys.exit(130)
print("\n".join(format_scores(result)))
if args.hypotheses:
    try:
        with replaced_when_complete(args.hypotheses) as stream:
            stream.writelines(h + "\n" for h in result["hypotheses"])
    except OSError as error:  # a full disk, a read-only folder: the scores above stand
        sys.exit(f"error: --hypotheses {args.hypotheses}: {error}")
