"""Run a script of `scripts/` as if the disk filled up while it writes a model's weights, for the tests.

    python tests/full_disk.py scripts/average_checkpoints.py [its flags]

`save_pretrained` writes part of its weights file and then fails as safetensors does on a full disk
(a `SafetensorError` naming os error 28, which is not an OSError); everything else runs as it is.
"""

import runpy
import sys
from pathlib import Path

from safetensors import SafetensorError
from transformers import PreTrainedModel

FULL_DISK = "Error while serializing: I/O error: No space left on device (os error 28)"


def save_until_full(self: PreTrainedModel, save_directory: str | Path, *args, **kwargs) -> None:
    Path(save_directory).mkdir(parents=True, exist_ok=True)
    (Path(save_directory) / "model.safetensors").write_bytes(b"\0" * 1024)  # the part written
    raise SafetensorError(FULL_DISK)


if __name__ == "__main__":
    PreTrainedModel.save_pretrained = save_until_full
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
