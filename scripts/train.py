"""Train the paper's Transformer, evaluate it and write a model folder with its card.

    accelerate launch scripts/train.py                      # tiny preset, embedded EN->ES corpus
    accelerate launch --multi_gpu --num_processes 2 scripts/train.py   # 2 processes (GPUs, or CPUs: gloo)
    accelerate launch --config_file configs/accelerate/fsdp.yaml scripts/train.py --preset big ...

Every flag is listed by --help; the logic lives in vanilla_transformer.training.
"""

import sys

from accelerate import PartialState

from vanilla_transformer.cli import InputError, utf8_stdout
from vanilla_transformer.training import (
    Interrupted,
    MainProcessFailed,
    format_summary,
    parse_config,
    train,
)

if __name__ == "__main__":
    utf8_stdout()  # what is printed, in UTF-8 whatever the locale
    config = parse_config()
    try:
        result = train(config)
    except InputError as error:  # data files, columns or a checkpoint found unusable once read
        sys.exit(f"error: {error}")
    except MainProcessFailed:  # a process that waited for the main one, which failed and says why
        sys.exit(1)
    except FloatingPointError as error:  # a non-finite loss, stopped before it reached the weights
        sys.exit(f"error: {error}")
    except Interrupted as interrupted:  # Ctrl-C: say what is kept, once, and stop as command-line tools do
        if PartialState().is_main_process:
            print(interrupted, file=sys.stderr)
        sys.exit(130)
    if PartialState().is_main_process:  # one report, not one per process
        print(format_summary(result))
