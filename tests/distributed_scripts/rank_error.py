"""2-process DDP where one rank, not the main one, raises during step 2 (in `compute_loss`, as `_taken_completions` or
any rank-local check would) and the other goes on into the step's collectives. Each rank writes the time it started
step 2 into `rank-<i>.started`; the raising rank dies with its error.

    accelerate launch --config_file recipes/accelerate_configs/ddp_cpu.yaml rank_error.py OUTPUT_DIR

tests/test_distributed.py checks what the launcher does then: it stops the waiting rank and exits non-zero with the
raising rank's error within seconds, not after `ddp_timeout` (30 minutes by default).
"""

import os
import sys
import time

from accelerate.utils import DistributedType
from common import check_launch

from tvopd_trl import TVOPDTrainer
from tvopd_trl.testing import tiny_config, tiny_pair_trainer


class FailingTrainer(TVOPDTrainer):
    def compute_loss(self, model, inputs, *args, **kwargs):
        if self.state.global_step == 1:
            with open(os.path.join(self.args.output_dir, f"rank-{self.accelerator.process_index}.started"), "w") as f:
                f.write(str(time.time()))
            if self.accelerator.process_index == 1:
                raise RuntimeError("rank 1 failed in step 2")
        return super().compute_loss(model, inputs, *args, **kwargs)


def main(output_dir):
    args = tiny_config(output_dir, max_steps=4, ddp_timeout=1800)
    trainer = tiny_pair_trainer(args, trainer_class=FailingTrainer)
    check_launch(trainer.accelerator, DistributedType.MULTI_CPU)
    trainer.train()


if __name__ == "__main__":
    main(sys.argv[1])
