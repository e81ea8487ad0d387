"""Run `scripts/train.py` under Accelerate's FSDP2 on CPU processes (gloo), for the tests.

Accelerate 1.x selects FSDP only when its processes drive GPUs or other accelerators; on CPUs it
ignores the FSDP configuration and runs DDP. torch's FSDP2 (`fully_shard`) itself runs on CPUs with
gloo, so this launcher lets Accelerate set up the processes as usual and then switches its state to
FSDP with the plugin that `accelerate launch --config_file configs/accelerate/fsdp.yaml` describes:
`prepare`, `save_state`, `load_state` and `get_state_dict` then take their FSDP2 paths, as on GPUs.

    accelerate launch --config_file configs/accelerate/fsdp.yaml --num_processes 2 \\
        --mixed_precision no tests/fsdp_on_cpu.py [train.py flags]
"""

import runpy
import sys
from pathlib import Path

from accelerate import Accelerator
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

plain_init = Accelerator.__init__


def init_with_fsdp(self: Accelerator, *args, **kwargs) -> None:
    plugin = FullyShardedDataParallelPlugin()  # from the FSDP_* variables `accelerate launch` sets
    plain_init(self, *args, **kwargs)
    assert self.distributed_type == DistributedType.MULTI_CPU, self.distributed_type
    PartialState().distributed_type = DistributedType.FSDP
    AcceleratorState().distributed_type = DistributedType.FSDP
    AcceleratorState().fsdp_plugin = plugin


Accelerator.__init__ = init_with_fsdp
script = Path(__file__).resolve().parents[1] / "scripts" / "train.py"
sys.argv = [str(script), *sys.argv[1:]]
runpy.run_path(str(script), run_name="__main__")
