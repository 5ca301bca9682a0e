"""torchrun entry point of the fault tests: ``fault_worker.py KIND RANK STEP <moetrain args...>`` runs moetrain's
command line, rank RANK raising (KIND raise), killing itself with SIGKILL (kill), hanging (hang) or sending
itself SIGTERM (term) when it starts step STEP."""

import os
import signal
import sys
import time

from moetrain import cli
from moetrain.train.trainer import Trainer

kind, bad_rank, at_step = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
train_step = Trainer.train_step


def faulty_train_step(self, step):
    if step == at_step and int(os.environ["RANK"]) == bad_rank:
        if kind == "raise":
            raise RuntimeError("injected fault")
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "hang":
            time.sleep(3600)
        if kind == "term":  # a preemption notice reaching this rank only
            os.kill(os.getpid(), signal.SIGTERM)
    return train_step(self, step)


Trainer.train_step = faulty_train_step
raise SystemExit(cli.main(sys.argv[4:]))
