"""Fine-tune a trained model folder with transformers' Seq2SeqTrainer on a local parallel file.

    python scripts/finetune.py --model outputs/tiny-en-es --train_file more.tsv --output_dir outputs/tuned

Every flag is listed by --help; the logic lives in vanilla_transformer.finetuning.
"""

import sys

from accelerate import PartialState

from vanilla_transformer.cli import parse_dataclass, utf8_stdout
from vanilla_transformer.finetuning import FinetuneConfig, finetune

if __name__ == "__main__":
    utf8_stdout()  # what is printed, in UTF-8 whatever the locale
    config = parse_dataclass(FinetuneConfig, __doc__.split("\n\n")[0])
    try:
        metrics = finetune(config)
    except (OSError, ValueError) as error:  # files, columns, data that cannot train
        sys.exit(f"error: {error}")
    except KeyboardInterrupt:  # Ctrl-C: stop as command-line tools do, without a traceback, saying it once
        if PartialState().is_main_process:
            print(
                "interrupted; if a checkpoint-N folder was written in --output_dir, continue with the same "
                "flags and --resume_from_checkpoint latest",
                file=sys.stderr,
            )
        sys.exit(130)
    if not PartialState().is_main_process:  # one report, not one per process
        sys.exit(0)
    for name in ("loss", "bleu", "chrf", "gen_len"):
        print(f"{name:8s} before {metrics[f'before_{name}']:8.3f}   after {metrics[f'after_{name}']:8.3f}")
